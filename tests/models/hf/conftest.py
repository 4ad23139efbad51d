"""Tiny Llama-, Qwen3-, Qwen3-MoE- and GLM-4-shaped checkpoints, built from config (no downloads).

Each is written once per session (`save_pretrained` of transformers' own model from a seeded
random init) into a temporary directory; tests read them and never write there.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Glm4Config,
    LlamaConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 96
_COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32),
    "glm4": lambda: Glm4Config(**_COMMON, head_dim=16),
}


def write_checkpoint(name: str, directory) -> None:
    config = CONFIGS[name]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def tiny_dir(request, tmp_path_factory):
    """An HF directory of each tiny architecture (config.json + model.safetensors)."""
    directory = tmp_path_factory.mktemp(request.param)
    write_checkpoint(request.param, directory)
    return directory


def packed_batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of documents of `lengths` back to back, packed as glmtune's data loader packs them:
    positions restart per document, targets are each next token within its document (-100 at a
    document's last token)."""
    generator = torch.Generator().manual_seed(seed)
    ids, positions, documents, targets = [], [], [], []
    for doc, length in enumerate(lengths):
        tokens = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        ids += tokens
        positions += list(range(length))
        documents += [doc] * length
        targets += tokens[1:] + [-100]
    row = lambda values: torch.tensor([values])
    return {"input_ids": row(ids), "position_ids": row(positions), "document_ids": row(documents),
            "targets": row(targets)}


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """One tiny Qwen3 directory (config.json + model.safetensors), for tests of one architecture."""
    directory = tmp_path_factory.mktemp("qwen3_only")
    write_checkpoint("qwen3", directory)
    return directory
