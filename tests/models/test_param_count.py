"""The closed-form parameter count (glmtune/models/glm5/param_count.py) equals the model built
on the meta device, exactly, for the presets and for configs that change which tensors exist
(tied embeddings, attention biases, shared-indexer layers, no shared expert, 0 to 2 MTP layers)."""

from __future__ import annotations

import pytest

from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.param_count import largest_tensor, parameter_count

TINY = get_preset("tiny")
VARIANTS = {
    "tiny": TINY,
    "glm5": get_preset("glm5"),
    "glm5.2": get_preset("glm5.2"),
    "tiny tied, attention bias": TINY.replace(tie_word_embeddings=True, attention_bias=True),
    "tiny without MTP, no shared expert": TINY.replace(num_nextn_predict_layers=0, n_shared_experts=0),
    "tiny two MTP layers, two shared experts": TINY.replace(num_nextn_predict_layers=2, n_shared_experts=2),
    "every indexer shared but the first": TINY.replace(num_hidden_layers=6, first_k_dense_replace=1,
                                                       indexer_types=["full"] + ["shared"] * 5),
    "all dense, uneven widths": TINY.replace(num_hidden_layers=3, first_k_dense_replace=3, hidden_size=96,
                                             q_lora_rank=48, kv_lora_rank=24, index_n_heads=3, index_head_dim=24,
                                             qk_rope_head_dim=8, attention_bias=True),
    "no decoder layers": TINY.replace(num_hidden_layers=0),
}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # no shared expert: a 0-wide MLP
@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_count_is_the_built_models(name):
    args = VARIANTS[name]
    model = build_model(args, device="meta")
    assert parameter_count(args) == sum(p.numel() for p in model.parameters())
    assert largest_tensor(args) == max(p.numel() for p in model.parameters())
    # the router's selection bias is a buffer: not counted
    assert any(name.endswith("e_score_correction_bias") for name, _ in model.named_buffers()) == (
        "sparse" in args.mlp_layer_types or args.num_nextn_predict_layers > 0)
