"""Every shipped recipe loads, validates against its model, and documents itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from glmtune.config import (
    RECIPES_DIR,
    config_to_dict,
    dump_config,
    load_config,
    validate_config,
    validate_parallel,
)
from glmtune.config.validate import fp32_master_weights, grad_accum_steps, precision_errors
from glmtune.models.registry import model_dims

# Training recipes; `eval_*.yaml` beside them are evaluation suites (`glmtune eval`, tests/eval/test_suite.py).
RECIPES = sorted(p for p in RECIPES_DIR.glob("**/*.yaml") if not p.name.startswith("eval_"))


def test_recipes_exist():
    names = {str(p.relative_to(RECIPES_DIR)) for p in RECIPES}
    expected = {"tiny/sft_support_json.yaml", "tiny/lora_support_json.yaml"}
    for family in ("glm5", "glm5.2", "glm5.3"):
        expected |= {f"{family}/sft_4k.yaml", f"{family}/sft_32k_cp8.yaml", f"{family}/lora_4k.yaml",
                     f"{family}/lora_fp8_1node.yaml"}
    assert expected <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(RECIPES_DIR)))
def test_recipe_loads_and_validates(path: Path, tmp_path: Path):
    lines = path.read_text().splitlines()
    header = "\n".join(line for line in lines[: next(i for i, l in enumerate(lines) if not l.startswith("#"))])
    assert header.startswith("# "), "each recipe starts with a header comment saying what it is"
    assert "glmtune train" in header or "glmtune config" in header, "the header says how to run it"
    cfg = load_config(path)
    dims = model_dims(cfg.model)
    # Every layout fits its own world size and model, and runs at it (pp and cp included).
    degrees = validate_parallel(cfg, dims.num_experts, dims.num_layers)
    assert grad_accum_steps(cfg, degrees) >= 1
    assert validate_config(cfg, dims.num_experts, dims.num_layers) == degrees
    out = tmp_path / "config.yaml"
    dump_config(cfg, out)
    assert load_config(out) == cfg


@pytest.mark.parametrize("family", ["glm5", "glm5.2", "glm5.3"])
def test_glm_recipes_mirror_nvidia_topology(family: str):
    sft = load_config(RECIPES_DIR / family / "sft_4k.yaml")
    p = sft.parallel
    assert (p.nodes, p.gpus_per_node, p.pp, p.ep, p.cp, p.tp) == (32, 8, 4, 64, 1, 1)
    assert p.activation_checkpointing == "full" and sft.data.packed_sequence_size == 4096
    assert sft.model.name_or_path.startswith("/path/to/") and sft.model.validate_as == family
    long = load_config(RECIPES_DIR / family / "sft_32k_cp8.yaml")
    assert (long.parallel.cp, long.data.packed_sequence_size) == (8, 32768)
    lora = load_config(RECIPES_DIR / family / "lora_4k.yaml")
    assert lora.peft.method == "lora" and lora.peft.target_modules is None  # the family's default targets
    one_node = load_config(RECIPES_DIR / family / "lora_fp8_1node.yaml")  # the frozen FP8 base on 8 GPUs
    assert (one_node.parallel.nodes, one_node.parallel.gpus_per_node, one_node.parallel.ep) == (1, 8, 8)
    assert one_node.model.fp8_base == "dequant" and one_node.model.validate_as == family
    # Inherited recipes differ from the base only where they say so.
    diff = {k for k, v in config_to_dict(long).items() if v != config_to_dict(sft)[k]}
    assert diff <= {"name", "description", "data", "train", "parallel", "logging", "checkpoint", "model"}
    model_diff = {k for k, v in config_to_dict(long)["model"].items() if v != config_to_dict(sft)["model"][k]}
    assert model_diff == {"attention_backend"} and long.model.attention_backend == "absorbed_triton"  # 32K: sparse


def test_tiny_default_is_cpu_float32_synthetic():
    cfg = load_config(RECIPES_DIR / "tiny" / "sft_support_json.yaml")
    assert (cfg.model.name_or_path, cfg.model.dtype, cfg.train.device) == ("tiny", "float32", "cpu")
    assert cfg.data.synthetic is not None and not cfg.data.train and cfg.data.packed_sequence_size == 512
    lora = load_config(RECIPES_DIR / "tiny" / "lora_support_json.yaml")
    assert lora.peft.method == "lora" and lora.data == cfg.data
    assert lora.train.max_steps == 150 and dataclasses.replace(lora.train, max_steps=cfg.train.max_steps) == cfg.train


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("glm5*/*.yaml")),
                         ids=lambda p: str(p.relative_to(RECIPES_DIR)))
def test_glm_recipes_say_which_precision_they_train_with(path: Path):
    """bf16 compute everywhere; fp32 master weights for full SFT, a bf16 (or FP8) base under fp32 LoRA adapters."""
    cfg = load_config(path)
    assert cfg.model.dtype == "bfloat16" and precision_errors(cfg) == []
    full = cfg.peft.method == "none"
    assert fp32_master_weights(cfg) is full
    header = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    base = "frozen FP8 base" if cfg.model.fp8_base != "none" else "bf16 frozen base"
    assert ("fp32 master weights, bf16 compute" if full else f"{base}, fp32 adapters") in header
