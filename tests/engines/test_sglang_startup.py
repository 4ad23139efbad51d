"""Opt-in (`make test-engines`): SGLang's own start-up (tests/engines/sglang_startup.py) with the command
`glmtune export --engine sglang` prints for each variant SGLang serves, on GLM-5 (its indexer_rope_interleave:
the DSA indexer fused, as on NVIDIA GPUs) on an H200: the server gets past every check of the adapter and
its target modules, and no MoE layer has more expert slots than its LoRA buffers have experts. The controls
(what glmtune printed before: `--lora-target-modules all`; shared experts left fused) must fail, or the
harness could not tell. The result is tests/peft/engine_fixtures/sglang-startup.json, which the default
suite reads (tests/peft/test_engine_facts.py, test_engines.py)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here: run `make test-engines`", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import capture  # noqa: E402
from variants import SGLANG_SERVED  # noqa: E402


@pytest.fixture(scope="module")
def startup(runs_root) -> dict:
    return capture.capture_startup(runs_root)


def _problems(started: dict, choices: set[str]) -> list[str]:
    flags = started["lora_flags"]
    names = set(flags[flags.index("--lora-target-modules") + 1:]) - {capture.UNFUSED}
    out = [f"--lora-target-modules {sorted(names - choices)}"] if names - choices or "all" in names else []
    out += [] if started["started"] else [started["error"]]
    slots, experts = started["moe_expert_slots"], started["lora_buffer_experts"]
    out += [] if slots == [experts] else [f"{slots} expert slots against {experts}-expert LoRA buffers"]
    return out + ([] if started["moe_lora_runner"].startswith("admitted") else [started["moe_lora_runner"]])


def test_sglang_starts_with_the_commands_glmtune_prints(startup):
    assert set(startup["commands"]) == set(SGLANG_SERVED)
    assert all(started["indexer_fused"] for started in startup["commands"].values())  # GLM-5 as on NVIDIA GPUs
    choices = set(startup["lora_target_modules_choices"])
    problems = {variant: _problems(started, choices) for variant, started in startup["commands"].items()}
    assert {variant: found for variant, found in problems.items() if found} == {}
    assert all(started["moe_expert_slots"] == [256] for started in startup["commands"].values())


def test_the_controls_fail_as_glmtunes_earlier_commands_did(startup):
    all_ = startup["controls"]["full, --lora-target-modules all"]
    assert not all_["started"] and "LoRA targets the DSA indexer (['indexer.wq_b'])" in all_["error"]
    fused = startup["controls"]["experts_down_only, shared experts fused"]
    assert fused["moe_expert_slots"] == [257] and fused["lora_buffer_experts"] == 256
    assert "without fused shared experts" in fused["moe_lora_runner"]


def test_the_startup_fixture_is_current(startup):
    saved = json.loads((capture.FIXTURES / capture.STARTUP_FIXTURE).read_text())
    assert json.loads(json.dumps(startup, sort_keys=True)) == saved
