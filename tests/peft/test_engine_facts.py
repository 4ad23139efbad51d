"""glmtune's per-engine facts (`glmtune/peft/engines.py`) against what the engines' own loader code
did with our adapters (fixtures captured by `make test-engines`, tests/engines/capture.py)."""

import json
from pathlib import Path

import pytest

from glmtune.peft.engines import ENGINES, AdapterTraits, serve_command

_TRAITS = AdapterTraits(rank=8, alpha=16.0, rslora=False, kv_b=False, shared_experts=True,
                        expert_projections=frozenset({"down_proj"}))

FIXTURES = Path(__file__).parent / "engine_fixtures"


def _fixture(engine: str, layout: str, variant: str) -> dict:
    return json.loads((FIXTURES / f"{engine}-{layout}-{variant}.json").read_text())


def _exact(fix: dict, config: str = "default") -> bool:
    """Every tensor maps to a module and is applied at the scale training used."""
    view = fix["configs"][config]
    return view["refusal"] is None and all(
        t["applied"] and t["scale"] == pytest.approx(fix["trained_scale"]) for t in view["tensors"].values())


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_checked_version_is_the_fixtures(engine):
    assert {_fixture(engine, "per_expert", "full")["engine_version"]} == {ENGINES[engine].checked}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_layout_loaded_is_the_one_applied_exactly(engine):
    exact = {layout for layout in ("peft", "per_expert") if _exact(_fixture(engine, layout, "full"))}
    assert exact == {ENGINES[engine].layout}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_rslora_scaling(engine):
    assert _exact(_fixture(engine, ENGINES[engine].layout, "rslora")) == ENGINES[engine].scales_rslora


def test_vllm_refuses_single_projection_experts():
    for variant in ("down_only", "gate_up_only", "experts_down_only"):
        assert "pack_moe" in _fixture("vllm", "per_expert", variant)["configs"]["default"]["refusal"]
    assert not ENGINES["vllm"].one_expert_projection  # the table refuses such an adapter for vLLM


def test_vllm_rank_default_and_copied_targets():
    fix = _fixture("vllm", "per_expert", "full")
    assert fix["max_lora_rank_default"] == 16 == ENGINES["vllm"].max_lora_rank_default
    unwrapped = [n for n, t in fix["configs"]["target_modules_copied"]["tensors"].items() if not t["applied"]]
    assert unwrapped and all(".mlp.experts." in n for n in unwrapped)


def test_sglang_drops_expert_deltas_silently_without_both_projection_names():
    fix = _fixture("sglang", "per_expert", "experts_down_only")
    default, all_ = fix["configs"]["default"], fix["configs"]["target_all"]
    dropped = [n for n, t in default["tensors"].items() if not t["applied"]]
    assert dropped and all(".mlp.experts." in n for n in dropped)
    assert default["refusal"] is None and default["skipped_weights"] == 0  # no warning, strict or not
    assert all(t["applied"] for t in all_["tensors"].values())
    # The table: applied, because the serve command passes --lora-target-modules all.
    assert ENGINES["sglang"].one_expert_projection
    assert "--lora-target-modules all" in " ".join(serve_command(ENGINES["sglang"], "b", "a", _TRAITS))


def test_sglang_shared_expert_fusion_zeroes_shared_deltas():
    view = _fixture("sglang", "per_expert", "full")["configs"]["glm5_shared_fused"]
    dropped = [n for n, t in view["tensors"].items() if not t["applied"]]
    assert dropped and all(".shared_experts." in n for n in dropped)
    assert any("disable-shared-experts-fusion" in n for n in ENGINES["sglang"].notes)


def test_sglang_skips_peft_layout_experts():
    view = _fixture("sglang", "peft", "full")["configs"]["default"]
    assert view["skipped_weights"] == 24


def test_mtp_layer_adapters():
    """docs/lora.md, The MTP layer under LoRA: SGLang loads no adapter with MTP-layer tensors, vLLM loads one
    but never applies those tensors, and refuses it when the MTP layer's eh_proj is adapted; neither engine's
    MTP draft model applies an adapter. Each fact of the table against the fixtures (every layout and config)."""
    for layout in ("peft", "per_expert"):
        for variant in ("mtp", "mtp_eh_proj"):
            views = _fixture("sglang", layout, variant)["configs"].values()
            assert all("IndexError in LoRAAdapter._process_weight" in (v["refusal"] or "") for v in views)
            views = _fixture("vllm", layout, variant)["configs"].values()
            assert all(("eh_proj" in (v["refusal"] or "")) == (variant == "mtp_eh_proj") for v in views)
    assert not ENGINES["sglang"].loads_mtp_layer and not ENGINES["sglang"].loads_mtp_eh_proj
    assert ENGINES["vllm"].loads_mtp_layer and not ENGINES["vllm"].loads_mtp_eh_proj
    # vLLM, its layout: applied exactly the tensors of the adapter without the MTP layer, the MTP layer's not at all
    layout = ENGINES["vllm"].layout
    view = _fixture("vllm", layout, "mtp")["configs"]["default"]
    decoder = set(_fixture("vllm", layout, "full")["configs"]["default"]["tensors"])
    mtp = {n: t for n, t in view["tensors"].items() if n not in decoder}
    assert view["refusal"] is None and mtp and len({n.split(".")[4] for n in mtp}) == 1  # one layer
    assert {n for n, t in view["tensors"].items() if t["applied"]} == decoder
    # The draft models: vLLM's take no LoRA, SGLang's draft worker gets no LoRA manager.
    vllm, sglang = _fixture("vllm", layout, "mtp")["mtp"], _fixture("sglang", layout, "mtp")["mtp"]
    assert not any(d["supports_lora"] for d in vllm["draft_models"].values())
    assert "not self.is_draft_worker" in sglang["lora_in_speculative_decoding"]["lora_manager_created_if"]
    assert not ENGINES["vllm"].applies_mtp_layer and not ENGINES["sglang"].applies_mtp_layer
