import torch

from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.spec import GLM5
from glmtune.train.metrics import routing_stats
from glmtune.train.router_balance import update_router_biases


def test_sign_update_raises_underloaded_and_lowers_overloaded_experts():
    model = build_model(get_preset("tiny"), seed=0)
    layers = GLM5.compute.moe_layers(model)
    assert [name for name, _ in layers] == ["model.layers.2.mlp", "model.layers.3.mlp"]
    counts = {name: torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]) for name, _ in layers}
    update_router_biases(layers, counts, rate=0.01)
    bias = layers[0][1].gate.e_score_correction_bias
    assert bias[0].item() < 0 and bias[7].item() < 0 and (bias[1:7] > 0).all()
    logits_before = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits_before).all()


def test_routing_stats():
    balanced = routing_stats(torch.full((8,), 5.0))
    assert balanced["max_load"] == 1.0 and abs(balanced["router_entropy"] - 1.0) < 1e-9
    assert balanced["mean_load"] == 5.0 and balanced["load_cv"] == 0.0 and balanced["idle_experts"] == 0.0
    skewed = routing_stats(torch.tensor([8.0, 0, 0, 0]))
    assert skewed["max_load"] == 4.0 and skewed["router_entropy"] == 0.0
    assert skewed["mean_load"] == 2.0 and skewed["idle_experts"] == 0.75
    assert abs(skewed["load_cv"] - 3 ** 0.5) < 1e-12  # std [6, 2, 2, 2] / 2


def test_forward_records_tokens_per_expert():
    model = build_model(get_preset("tiny"), seed=0)
    model(torch.randint(0, 4000, (2, 10)))
    counts = model.model.layers[2].mlp.tokens_per_expert
    assert counts.sum().item() == 2 * 10 * model.args.num_experts_per_tok
