"""Shared fixtures for the LoRA tests: tiny models and adapters that actually change outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glmtune import load_pretrained
from glmtune.config.schema import PeftConfig
from glmtune.models.glm5 import build_model, get_preset
from tests.parity.hf_reference import make_hf_model


def lora_cfg(**changes) -> PeftConfig:
    return PeftConfig(**{"method": "lora", "rank": 4, "alpha": 8.0, **changes})


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> None:
    """Non-zero A and B everywhere: a fresh adapter (B = 0) would prove nothing."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * scale)


def tokens(batch: int = 2, seq: int = 24, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random transformers GlmMoeDsaForCausalLM saved by transformers itself."""
    path = tmp_path_factory.mktemp("hf-glm5")
    make_hf_model("glm5").save_pretrained(path)
    return path


@pytest.fixture
def ours(hf_dir) -> torch.nn.Module:
    """glmtune's model of `hf_dir`, fp32, the exact reference kernels."""
    return load_pretrained(hf_dir, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm")


@pytest.fixture
def tiny() -> torch.nn.Module:
    return build_model(get_preset("tiny"), seed=0)
