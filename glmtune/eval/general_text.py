"""General capability as loss: nats per token on a held-out plain text outside the tuned task.

The text (UTF-8, no chat template, no special tokens) is tokenized once, cut to its first
`max_tokens` tokens, and split into non-overlapping windows of `window` tokens; each window is
one forward pass and every token after a window's first is predicted from the tokens before it
in that window. The loss is the mean cross-entropy over all predicted tokens, in nats: a
fine-tune that damaged general language modelling raises it (the gate `max_increase`).
Windows are identical for every model (same tokenizer: `glmtune eval` refuses different ones).
"""

from __future__ import annotations

from pathlib import Path

import torch

from glmtune.eval.scorers.base import MetricDef

GENERAL_TEXT_METRIC = MetricDef("loss", "mean next-token loss on the held-out general text", "nats_per_token", False)


def text_windows(tokenizer, path: Path, max_tokens: int, window: int) -> list[list[int]]:
    """Token windows of the text (the last one may be shorter; a 1-token tail is dropped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: general_text must be UTF-8 ({exc.reason} at byte {exc.start})") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError(f"{path}: general_text has fewer than 2 tokens; nothing to score")
    return windows


@torch.no_grad()
def general_text_loss(model, windows: list[list[int]]) -> tuple[float, int]:
    """(mean loss in nats per predicted token, number of predicted tokens)."""
    device = model.lm_head.weight.device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for ids in windows:
            ids_1T = torch.tensor([ids], device=device)
            targets_1T = torch.full_like(ids_1T, -100)
            targets_1T[:, :-1] = ids_1T[:, 1:]
            out = model(ids_1T, targets=targets_1T, compute_logits=False)
            total += float(out.loss_sum)
            count += int(out.num_targets)
    finally:
        model.train(was_training)
    return total / count, count
