"""Opt-in (`make test-engines`): re-derive tests/peft/engine_fixtures/ with the installed vLLM and
SGLang and compare. Trains the variants with the project's venv (GLMTUNE_PYTHON) unless
GLMTUNE_ENGINE_RUNS points at runs already made (one folder per variants.VARIANTS key; conftest.py)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.lora.lora_model", reason="vLLM is not installed here: run `make test-engines`")
if importlib.util.find_spec("sglang") is None:  # its sources are read here (it is imported in sglang_startup.py)
    pytest.skip("SGLang is not installed here: run `make test-engines`", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import capture  # noqa: E402


def test_engines_match_fixtures(runs_root):
    for name, derived in capture.capture(runs_root).items():
        saved = json.loads((capture.FIXTURES / name).read_text())
        assert json.loads(json.dumps(derived, sort_keys=True)) == saved, name


def _saved(engine: str, layout: str, variant: str) -> dict:
    return json.loads((capture.FIXTURES / f"{engine}-{layout}-{variant}.json").read_text())


def test_mtp_adapters_in_the_engines():
    """docs/lora.md, The MTP layer under LoRA: neither engine adapts its MTP draft; vLLM loads an adapter
    with MTP-layer tensors and leaves them unused, unless it adapts eh_proj (refused); SGLang refuses it."""
    for layout in capture.LAYOUTS:
        for variant in ("mtp", "mtp_eh_proj"):
            for config, view in _saved("sglang", layout, variant)["configs"].items():
                assert view["refusal"].startswith("adapter not loaded: IndexError in LoRAAdapter._process_weight"), \
                    config
            for config, view in _saved("vllm", layout, variant)["configs"].items():
                if variant == "mtp_eh_proj":
                    assert "from_local_checkpoint" in view["refusal"] and "layers.4.eh_proj" in view["refusal"], config
                else:
                    mtp = {n: t for n, t in view["tensors"].items() if ".layers.4." in n}
                    assert mtp and not any(t["applied"] for t in mtp.values()), config
        vllm, sglang = _saved("vllm", layout, "mtp")["mtp"], _saved("sglang", layout, "mtp")["mtp"]
        assert not any(d["supports_lora"] or d["packed_modules_mapping"] for d in vllm["draft_models"].values())
        assert vllm["lora_in_speculative_decoding"]["load_model_calls"][:2] == ["self.load_lora_model",
                                                                               "self.speculator.load_model"]
        assert not vllm["lora_in_speculative_decoding"]["load_eagle_model_uses_lora"]
        assert "not self.is_draft_worker" in sglang["lora_in_speculative_decoding"]["lora_manager_created_if"]
        assert sglang["adapter_layers"]["count"] == "base_hf_config.num_hidden_layers"
    # with the default targets and the per-expert layout, vLLM applies exactly the decoder layers' tensors
    view = _saved("vllm", "per_expert", "mtp")["configs"]["default"]
    assert view["refusal"] is None
    assert {n for n, t in view["tensors"].items() if t["applied"]} == \
        set(_saved("vllm", "per_expert", "full")["configs"]["default"]["tensors"])
