"""`fill_random_weights` (glmtune plan --measure's weights) leaves every buffer as the family sets it:
the rotary frequencies of a transformers model came out of `to_empty` uninitialized (only GLM-5's
rotary module was reset), and a clean-clone run measured NaN at step 1 on a tiny Qwen3."""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from glmtune.models.glm5 import get_preset
from glmtune.models.glm5.spec import GLM5
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.spec import HF
from glmtune.plan.random_weights import fill_random_weights


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers() if "inv_freq" in name}


def _after_fill(spec, args) -> torch.nn.Module:
    model = spec.weights.build(args, torch.float32, "meta")
    # `to_empty` hands back whatever the allocator held; torch's deterministic mode fills such memory
    # with NaN (torch.utils.deterministic.fill_uninitialized_memory), so a buffer left unset shows
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        fill_random_weights(model, torch.device("cpu"), 0.02, seed=0, reset_buffers=spec.weights.reset_buffers)
    finally:
        torch.use_deterministic_algorithms(previous)
    return model


def test_transformers_rotary_frequencies_are_computed_again():
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, architectures=["Qwen3ForCausalLM"])
    args = HfArgs.from_config_dict(config.to_dict(), "Qwen3ForCausalLM")
    expected = _buffers(HF.weights.build(args, torch.float32, "cpu"))
    actual = _buffers(_after_fill(HF, args))
    assert expected and actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, msg=name)


def test_glm5_buffers_are_as_the_sharded_load_sets_them():
    args = get_preset("tiny")
    expected = _buffers(GLM5.weights.build(args, torch.float32, "cpu"))
    model = _after_fill(GLM5, args)
    actual = _buffers(model)
    assert expected and actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, msg=name)
    assert all(torch.isfinite(b).all() for b in model.buffers() if b.is_floating_point())
