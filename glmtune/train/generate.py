"""Greedy decoding for before/after samples and evaluation.

No KV cache: each step re-runs the prompt plus what was generated. That is
quadratic but exact, and on the tiny default model it costs milliseconds; fast
serving belongs to inference engines, which load our HF exports.
"""

from __future__ import annotations

import torch
from torch import nn

from glmtune.distributed.fsdp_state import release_gathered
from glmtune.peft.family import spec_of


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: set[int]) -> list[int]:
    """Token ids generated after `prompt_ids`, stopping at (and excluding) a stop id. The next
    token's logits come from the model's family (`Compute.last_token_logits`)."""
    last_token_logits = spec_of(model).compute.last_token_logits
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    out: list[int] = []
    try:
        for _ in range(max_new_tokens):
            input_ids = torch.tensor([ids], device=device)
            next_id = int(last_token_logits(model, input_ids)[0].float().argmax())
            if next_id in stop_ids:
                break
            ids.append(next_id)
            out.append(next_id)
    finally:
        model.train(was_training)
        release_gathered(model)  # FSDP2 would otherwise keep the root's gathered weights registered
    return out
