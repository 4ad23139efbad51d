"""The model a config builds carries the config's kernel settings into every layer."""

from __future__ import annotations

import pytest
import torch

from glmtune.config import load_config
from glmtune.models.glm5.attention import MLAttention, set_attention_score_buffer
from glmtune.models.common.rmsnorm import RMSNorm
from glmtune.models.glm5.moe import MoE
from glmtune.train.model_source import build_model_from_config


def test_attention_and_moe_settings_reach_every_layer_including_mtp():
    cfg = load_config(None, ["--model.attention_score_buffer_mib=3", "--model.moe_dispatch_backend=torch"])
    model, _ = build_model_from_config(cfg, "cpu")
    attentions = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert len(attentions) == model.args.num_hidden_layers + len(model.mtp)  # MTP layers too
    assert {m.score_buffer_bytes for m in attentions} == {3 << 20}
    assert {m.dispatcher.backend for m in model.modules() if isinstance(m, MoE)} == {"torch"}


def test_norm_backend_reaches_every_norm():
    """model.norm_backend: every RMSNorm of the model, the MTP layers' and the attention's inner norms
    included (the kernels' numerics: tests/kernels/test_rms_norm.py)."""
    model, _ = build_model_from_config(load_config(None, ["--model.norm_backend=triton"]), "cpu")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    layers = model.args.num_hidden_layers + len(model.mtp)
    assert len(norms) >= 4 * layers and {m.backend for m in norms} == {"triton"}
    model, _ = build_model_from_config(load_config(None, []), "cpu")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert {m.backend for m in norms} == {"auto"}  # the kernels on a CUDA tensor, eager on this CPU:
    x = torch.randn(3, norms[0].weight.shape[0])
    eager = norms[0].weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norms[0].eps))
    assert torch.equal(norms[0](x), eager)


def test_default_score_buffer_is_one_gib_and_negative_is_refused():
    model, _ = build_model_from_config(load_config(None, []), "cpu")
    assert {m.score_buffer_bytes for m in model.modules() if isinstance(m, MLAttention)} == {1 << 30}
    with pytest.raises(ValueError, match="attention_score_buffer_mib must be >= 0, got -1"):
        set_attention_score_buffer(model, -1)
