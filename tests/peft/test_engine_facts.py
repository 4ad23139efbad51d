"""glmtune's per-engine facts (`glmtune/peft/engines.py`) against what the engines' own loader code
did with our adapters (fixtures captured by `make test-engines`, tests/engines/capture.py)."""

import json
from pathlib import Path

import pytest

from glmtune.peft.engines import ENGINES, SGLANG_TARGET_MODULES, AdapterTraits, serve_command

# The experts_down_only variant: attention and the routed experts' down_proj only.
_TRAITS = AdapterTraits(rank=8, alpha=16.0, rslora=False, kv_b=True, shared_experts=False,
                        expert_projections=frozenset({"down_proj"}),
                        modules=frozenset({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                           "down_proj"}))

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
    default, both = fix["configs"]["default"], fix["configs"]["both_expert_projections"]
    dropped = [n for n, t in default["tensors"].items() if not t["applied"]]
    assert dropped and all(".mlp.experts." in n for n in dropped)
    assert default["refusal"] is None and default["skipped_weights"] == 0  # no warning, strict or not
    assert _exact(fix, "both_expert_projections") and both["skipped_weights"] == 0
    # The table: applied, because the serve command names both expert projections (and nothing else beyond
    # the adapter's own modules).
    assert ENGINES["sglang"].one_expert_projection
    command = serve_command(ENGINES["sglang"], "b", "a", _TRAITS)
    names = command[command.index("--lora-target-modules") + 1:]
    assert names == ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj",
                     "up_proj", "--disable-shared-experts-fusion"]
    assert set(names[:-1]) == set(fix["adapter"]["target_modules"]) | {"gate_proj", "up_proj"}


def _startup() -> dict:
    return json.loads((FIXTURES / "sglang-startup.json").read_text())


def test_sglang_accepts_the_names_the_command_passes():
    """SGLANG_TARGET_MODULES is SGLang's --lora-target-modules choices (read from its installed source)."""
    startup = _startup()
    assert startup["engine_version"] == ENGINES["sglang"].checked
    assert set(SGLANG_TARGET_MODULES) == set(startup["lora_target_modules_choices"])


def test_sglang_started_with_each_command_and_refused_the_earlier_ones():
    """make test-engines ran SGLang's own start-up (tests/engines/sglang_startup.py) on GLM-5 as on an H200 with
    the command glmtune printed for each variant: past every check, no fused shared expert under MoE LoRA; and
    `--lora-target-modules all` refused (the fused DSA indexer's wq_b), shared experts fused give MoE layers
    257 expert slots against 256-expert LoRA buffers, which the MoE LoRA runner refuses."""
    startup = _startup()
    for variant, started in startup["commands"].items():
        assert started["started"] and started["indexer_fused"], variant
        assert started["moe_expert_slots"] == [started["lora_buffer_experts"]] == [256], variant
        assert started["moe_lora_runner"].startswith("admitted") and "all" not in started["lora_flags"], variant
    controls = startup["controls"]
    assert "LoRA targets the DSA indexer" in controls["full, --lora-target-modules all"]["error"]
    fused = controls["experts_down_only, shared experts fused"]
    assert fused["moe_expert_slots"] == [257] and "without fused shared experts" in fused["moe_lora_runner"]


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
