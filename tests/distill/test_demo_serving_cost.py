"""The scorecard's serving-cost facts for distillation (issue 48): a local model's parameters and
active parameters per token beside its tokens/s and peak memory, for teacher and student alike.

The counts are checked against the module tree of the saved model directly (every parameter outside
the MTP layers; per token: a MoE layer's routed experts at top-k of n, the input embedding out), so
a count that drifts from the weights fails here; the Markdown scorecard shows both per model, and a
dash for an endpoint, whose engine does not say."""

from __future__ import annotations

import pytest

from glmtune import save_pretrained
from glmtune.eval.operations import parameter_counts
from glmtune.eval.report_md import render_markdown
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.registry import spec_for
from tests.eval.report_fixture import make_scorecard


def _direct_counts(model, top_k: int, n_experts: int) -> tuple[int, int]:
    named = [(name, p.numel()) for name, p in model.named_parameters() if not name.startswith("mtp.")]
    total = sum(n for _, n in named)
    routed = sum(n for name, n in named if ".mlp.experts." in name)
    embedding = sum(n for name, n in named if name.startswith("model.embed_tokens."))
    return total, total - routed + routed * top_k // n_experts - embedding


@pytest.mark.parametrize("overrides", [{}, {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "dense", "sparse"],
                                            "indexer_types": ["full", "shared", "full"], "n_routed_experts": 4}],
                         ids=["teacher-tiny", "student-3-layers-4-experts"])
def test_parameters_and_active_parameters_of_a_saved_model(overrides, tmp_path):
    args = get_preset("tiny").replace(**overrides)
    model = build_model(args, seed=0)
    hf_dir = tmp_path / "hf"
    save_pretrained(model, hf_dir)
    counts = parameter_counts(spec_for(hf_dir), hf_dir)
    total, active = _direct_counts(model, args.num_experts_per_tok, args.n_routed_experts)
    assert counts == {"parameters": total, "active_parameters": active}
    assert active < total  # the MoE's idle experts and the embedding lookup are not per-token cost


def test_the_scorecard_shows_them_per_model_and_a_dash_for_an_endpoint():
    card = make_scorecard(num_candidates=2)
    labels = [m["label"] for m in card["models"]]
    card["operations"][labels[0]].update(parameters=2_241_440, active_parameters=1_324_672)
    card["operations"][labels[1]].update(parameters=1_100_000, active_parameters=700_000)
    md = render_markdown(card)
    assert "| model | device | parameters | active parameters | requests |" in md
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()
            if line.startswith("| ") and " | cpu | " in line}
    assert " | cpu | 2,241,440 | 1,324,672 | " in rows[labels[0]]
    assert " | cpu | 1,100,000 | 700,000 | " in rows[labels[1]]
    assert " | cpu | — | — | " in rows[labels[2]]  # no counts recorded (an endpoint)
