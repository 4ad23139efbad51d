"""What the hf family refuses at config time (`HF_FAMILY.limits`): expert, pipeline and context
parallelism and every GLM-5-only setting it would otherwise ignore, each one sentence naming its
key, from `glmtune config validate`'s checks and from `glmtune train` before anything is written."""

from __future__ import annotations

import pytest

from glmtune.cli import main
from glmtune.config import JobConfig, load_config, validate_config
from glmtune.models import catalog
from glmtune.models.hf.family import HF_FAMILY

RECIPE = "recipes/tiny/sft_support_json.yaml"
LAYOUT = r" is not available for the hf family \(transformers' modules are not laid out for expert, pipeline or "


def _validate(qwen3_dir, *options: str):
    cfg = load_config(RECIPE, [f"--model.name_or_path={qwen3_dir}", *options])
    dims = catalog.model_dims(cfg.model)  # what `glmtune config validate` reads: config.json alone
    return validate_config(cfg, dims.num_experts, dims.num_layers, model_refusals=dims.refusals)


def test_every_limit_names_a_setting_and_honours_its_default():
    defaults = JobConfig()
    for key, honoured, _ in HF_FAMILY.limits:
        section, field = key.split(".")
        assert getattr(getattr(defaults, section), field) in honoured, key


@pytest.mark.parametrize(("options", "message"), [
    (["--parallel.ep=2", "--parallel.world_size=2"], "^parallel.ep: 2" + LAYOUT),
    (["--parallel.pp=2", "--parallel.world_size=2"], "^parallel.pp: 2" + LAYOUT),
    (["--parallel.cp=2", "--parallel.world_size=2"], "^parallel.cp: 2" + LAYOUT),
    (["--parallel.activation_checkpointing=selective"],
     "^parallel.activation_checkpointing: selective is not available for the hf family yet .*choose none or full$"),
    (["--train.mtp_loss_weight=0.3"], "^train.mtp_loss_weight: 0.3 is GLM-5's multi-token-prediction loss, which "
                                      "the hf family does not have; remove it or train a GLM-5 checkpoint$"),
    (["--train.indexer_loss_weight=0.1", "--model.indexer_trainable=true"],
     r"^2 config errors:\n  train.indexer_loss_weight: 0.1 is GLM-5's DSA indexer loss.*\n  "
     r"model.indexer_trainable: True is GLM-5's DSA indexer training"),
    (["--train.router_bias_update=sign"], "^train.router_bias_update: sign is GLM-5's router correction-bias update"),
    (["--model.fp8_base=dequant", "--peft.method=lora"], "model.fp8_base: dequant is GLM-5's frozen FP8 base"),
    (["--model.attention_backend=triton"], "^model.attention_backend: triton chooses how GLM-5's modules compute"),
    (["--model.moe_backend=loop"], "^model.moe_backend: loop chooses how GLM-5's modules compute"),
    (["--peft.method=lora", "--peft.adapter_kernel=torch"], "peft.adapter_kernel: torch chooses how GLM-5's"),
])
def test_settings_the_family_would_ignore_are_refused_by_key(qwen3_dir, options, message):
    with pytest.raises(ValueError, match=message):
        _validate(qwen3_dir, *options)


def test_limits_come_first_and_alone(qwen3_dir):
    """pp 2 with one row per micro batch is also a bad 1F1B schedule: only the family's refusal is said."""
    with pytest.raises(ValueError) as exc:
        _validate(qwen3_dir, "--parallel.pp=2", "--parallel.world_size=2", "--train.micro_batch_size=1",
                  "--train.global_batch_size=1")
    assert str(exc.value).startswith("parallel.pp: 2 is not available for the hf family"), exc.value
    assert "\n" not in str(exc.value)


def test_the_same_settings_pass_for_glm5():
    """The limits are the hf family's: GLM-5's tiny preset takes them."""
    for options in (["--parallel.ep=2", "--parallel.world_size=2"], ["--train.mtp_loss_weight=0.3"],
                    ["--model.attention_backend=sdpa"]):
        cfg = load_config(RECIPE, options)
        dims = catalog.model_dims(cfg.model)
        validate_config(cfg, dims.num_experts, dims.num_layers, model_refusals=dims.refusals)


@pytest.mark.parametrize("launch", [[], ["--nproc-per-node", "2"]], ids=["one-process", "torchrun"])
def test_train_refuses_before_writing(qwen3_dir, tmp_path, capsys, launch):
    run_dir = tmp_path / "run"
    assert main(["train", RECIPE, "--model.name_or_path", str(qwen3_dir), "--parallel.cp", "2",
                 "--logging.run_dir", str(run_dir), *launch]) == 2
    err = capsys.readouterr().err
    assert "glmtune train: error: parallel.cp: 2 is not available for the hf family" in err, err
    assert not run_dir.exists()
