"""Cross-field validation: mesh degrees vs world size and model, pipeline split, batch and range checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glmtune.config import (
    JobConfig,
    load_config,
    resolve_world_size,
    validate_config,
    validate_parallel,
)
from glmtune.config.validate import fp32_master_weights, grad_accum_steps, planned_saves
from glmtune.models.registry import model_dims


def glm5_job(*overrides: str) -> JobConfig:
    """NVIDIA's GLM-5 4K topology, stated inline so these tests do not depend on recipe files."""
    base = [
        "--parallel.nodes=32", "--parallel.gpus_per_node=8", "--parallel.pp=4", "--parallel.ep=64",
        "--parallel.pp_schedule=Interleaved1F1B", "--parallel.pp_microbatches=4",
        "--train.global_batch_size=256", "--train.micro_batch_size=4", "--data.train=[x.jsonl]",
    ]
    return load_config(None, base + list(overrides))


def test_glm5_topology_resolves():
    degrees = validate_parallel(glm5_job(), num_experts=256, num_layers=78)
    assert (degrees.world_size, degrees.dp_shard, degrees.pp, degrees.ep, degrees.efsdp) == (256, 64, 4, 64, 1)
    assert grad_accum_steps(glm5_job(), degrees) == 1


def test_tensor_parallelism_is_refused_and_pipeline_and_context_run():
    """The layout is valid (validate_parallel); a run needs tp at 1 (validate_config); pp and cp run."""
    assert validate_config(glm5_job(), num_experts=256, num_layers=78).pp == 4
    job = glm5_job("--parallel.cp=8", "--parallel.tp=2", "--parallel.nodes=128")
    assert validate_parallel(job, 256, 78).dp_shard == 16
    with pytest.raises(ValueError) as exc:
        validate_config(job, 256, 78)
    assert str(exc.value) == "parallel.tp is 2, but tensor parallelism is not built in this version yet; " \
                             "set parallel.tp: 1"
    assert validate_config(glm5_job("--parallel.cp=8", "--parallel.nodes=64"), 256, 78).cp == 8
    # ep and dp_replicate need no new degree: EP and HSDP are built on the FSDP2 mesh.
    job = glm5_job("--parallel.pp=1", "--parallel.pp_schedule=1F1B", "--parallel.pp_stages_per_rank=1",
                   "--parallel.pp_microbatches=null", "--parallel.dp_replicate=2", "--train.micro_batch_size=1")
    degrees = validate_config(job, 256, 78)
    assert (degrees.dp_replicate, degrees.dp_shard, degrees.ep, degrees.efsdp) == (2, 128, 64, 2)


@pytest.mark.parametrize(("extra", "message"), [
    (["--parallel.pp=1", "--parallel.pp_stages_per_rank=1", "--parallel.pp_microbatches=null",
      "--train.micro_batch_size=1"],
     "parallel.pp_schedule is set but parallel.pp is 1 (no pipeline); remove it or set parallel.pp"),
    (["--parallel.pp_layer_split=[20,20,38]"],
     "parallel.pp_layer_split has 3 entries, but the pipeline has parallel.pp x parallel.pp_stages_per_rank = "
     "4 x 1 = 4 stages"),
    (["--parallel.pp_stages_per_rank=1", "--parallel.pp_schedule=1F1B", "--parallel.pp_layer_split=[20,20,20,20]"],
     "parallel.pp_layer_split [20, 20, 20, 20] must give every stage at least one layer and sum to the model's 78 "
     "layers (it sums to 80)"),
    (["--parallel.cp=8", "--parallel.nodes=64", "--data.packed_sequence_size=32760"],
     "data.packed_sequence_size (32760) must be divisible by 2 x parallel.cp (16): parallel.cp_balance head_tail "
     "cuts each packed row into 2 x cp chunks and gives each rank a first and a last one"),
    (["--parallel.pp=1", "--parallel.pp_schedule=1F1B", "--parallel.pp_microbatches=null", "--parallel.ep=64",
      "--train.micro_batch_size=1", "--parallel.cp_balance=contiguous"],
     "parallel.cp_balance is set but parallel.cp is 1 (no context parallelism); remove it or set parallel.cp"),
    (["--train.generate_samples=4"],
     "train.generate_samples (4) answers prompts greedily with the whole model in each process, which "
     "parallel.pp: 4 split; set train.generate_samples: 0 (score the run with the exported model instead)"),
])
def test_pipeline_settings_that_cannot_take_effect_are_refused(extra, message):
    with pytest.raises(ValueError) as exc:
        validate_config(glm5_job(*extra), 256, 78)
    assert str(exc.value) == message


def test_more_pipeline_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match=r"parallel.pp x parallel.pp_stages_per_rank \(8 x 1 = 8\) exceeds the model's 4"):
        validate_parallel(load_config(None, ["--parallel.pp=8", "--parallel.pp_microbatches=8",
                                             "--train.micro_batch_size=8"]), 8, 4, world_size=8)


def test_ep_must_divide_experts_and_dp_shard_times_cp():
    with pytest.raises(ValueError, match=r"parallel.ep \(48\) must divide the model's 256 routed experts"):
        validate_parallel(glm5_job("--parallel.ep=48"), 256, 78)
    with pytest.raises(ValueError, match=r"parallel.ep \(128\) must divide parallel.dp_shard x parallel.cp \(64 x 1"):
        validate_parallel(glm5_job("--parallel.ep=128"), 256, 78)
    # cp ranks count too: dp_shard 16 x cp 8 = 128 ranks host ep 128.
    job = glm5_job("--parallel.ep=128", "--parallel.cp=8", "--parallel.nodes=64")
    assert validate_parallel(job, 256, 78).dp_shard == 16


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ValueError, match=r"parallel.dp_replicate x dp_shard x cp x tp x pp = 1 x 32 x 1 x 1 x 4 = 128"):
        validate_parallel(glm5_job("--parallel.dp_shard=32"), 256, 78)
    with pytest.raises(ValueError, match=r"world size 256 is not divisible by parallel.dp_replicate x cp x tp x pp"):
        validate_parallel(glm5_job("--parallel.pp=3"), 256, 78)


def test_world_size_sources_must_agree():
    with pytest.raises(ValueError, match=r"the launcher's world size \(8\) disagrees with parallel.nodes x"):
        validate_parallel(glm5_job(), 256, 78, world_size=8)
    with pytest.raises(ValueError, match="parallel.nodes and parallel.gpus_per_node must be set together"):
        validate_parallel(load_config(None, ["--parallel.nodes=2"]), 8, 4)
    job = load_config(None, ["--parallel.dp_shard=2", "--parallel.tp=2"])
    assert resolve_world_size(job.parallel) == 4  # explicit degrees, no launcher
    assert resolve_world_size(JobConfig().parallel) == 1  # nothing known: one process


def test_pipeline_schedule_rules():
    with pytest.raises(ValueError, match="1F1B needs at least as many microbatches as stages"):
        validate_parallel(glm5_job("--parallel.pp_schedule=1F1B", "--parallel.pp_microbatches=2"), 256, 78)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        validate_parallel(glm5_job("--parallel.pp_schedule=GPipe", "--parallel.pp_stages_per_rank=2"), 256, 78)
    with pytest.raises(ValueError, match="ZBVZeroBubble needs parallel.pp_stages_per_rank: 2"):
        validate_parallel(glm5_job("--parallel.pp_schedule=ZBVZeroBubble"), 256, 78)
    with pytest.raises(ValueError, match=r"parallel.pp_microbatches \(3\) must divide train.micro_batch_size \(4\)"):
        validate_parallel(glm5_job("--parallel.pp_microbatches=3"), 256, 78)
    with pytest.raises(ValueError, match=r"pp_microbatches \(9\) to be a multiple of 2"):
        validate_parallel(glm5_job("--parallel.pp_microbatches=9", "--train.micro_batch_size=9"), 256, 78)


def test_cp_needs_divisible_packed_rows():
    job = ["--parallel.cp=8", "--parallel.nodes=64", "--data.packed_sequence_size=4100"]
    with pytest.raises(ValueError, match=r"data.packed_sequence_size \(4100\) must be divisible by parallel.cp \(8\): "
                                         "parallel.cp_balance contiguous cuts"):
        validate_parallel(glm5_job(*job, "--parallel.cp_balance=contiguous"), 256, 78)
    assert validate_parallel(glm5_job(*job[:2], "--data.packed_sequence_size=4112",
                                      "--parallel.cp_balance=contiguous"), 256, 78).cp == 8


def test_batch_divisibility_names_keys():
    with pytest.raises(ValueError, match=r"train.global_batch_size \(100\) must be divisible by train.micro_batch_size"):
        validate_config(glm5_job("--train.global_batch_size=100"), 256, 78)


def test_range_checks_are_reported_together():
    job = load_config(None, ["--data.synthetic.rows=3", "--optim.lr=0", "--optim.warmup_steps=500",
                             "--train.max_steps=100", "--peft.method=lora", "--peft.target_modules=[]",
                             "--model.attention_score_buffer_mib=-1"])
    with pytest.raises(ValueError) as exc:
        validate_config(job, 8, 4)
    message = str(exc.value)
    assert message.startswith("4 config errors")
    for needle in ("optim.lr must be > 0", "optim.warmup_steps (500) must be between 0 and train.max_steps (100)",
                   "peft.target_modules is empty", "model.attention_score_buffer_mib must be >= 0"):
        assert needle in message


def test_missing_data_and_bad_split():
    with pytest.raises(ValueError, match="no training data"):
        validate_config(JobConfig(), 8, 4)
    job = load_config(None, ["--data.train=[a]", "--data.split={train: 0.5, validation: 0.2}"])
    with pytest.raises(ValueError, match="data.split ratios must sum to 1"):
        validate_config(job, 8, 4)


def test_model_dims_from_presets_directories_and_overrides(tmp_path):
    assert (model_dims(JobConfig().model).num_experts, model_dims(JobConfig().model).num_layers) == (8, 4)
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 64, "num_hidden_layers": 12}))
    cfg = load_config(None, [f"--model.name_or_path={tmp_path}", "--model.overrides.num_hidden_layers=3"])
    dims = model_dims(cfg.model)
    assert (dims.num_experts, dims.num_layers) == (64, 3)
    placeholder = load_config(None, ["--model.name_or_path=/path/to/GLM-5", "--model.validate_as=glm5"])
    assert (model_dims(placeholder.model).num_experts, model_dims(placeholder.model).num_layers) == (256, 78)
    with pytest.raises(ValueError, match="set model.validate_as"):
        model_dims(load_config(None, ["--model.name_or_path=/path/to/GLM-5"]).model)


def test_precision_settings_a_run_cannot_honour_are_refused_by_name():
    """The refusals of `resolve_precision` (glmtune train), in the checks config validate runs too."""
    tiny = ["--model.dtype=bfloat16", "--data.train=[x.jsonl]"]
    lora = [*tiny, "--peft.method=lora"]
    with pytest.raises(ValueError, match=r"^train.master_weights: fp32 with peft.method: lora: .*use auto or none$"):
        validate_config(load_config(None, [*lora, "--train.master_weights=fp32"]), 8, 4)
    with pytest.raises(ValueError) as exc:  # reported with the other errors, not one at a time
        validate_config(load_config(None, [*lora, "--train.master_weights=fp32", "--optim.lr=0"]), 8, 4)
    assert str(exc.value).startswith("2 config errors:")
    for choice in ("auto", "none"):
        validate_config(load_config(None, [*lora, f"--train.master_weights={choice}"]), 8, 4)
    validate_config(load_config(None, [*tiny, "--train.master_weights=fp32"]), 8, 4)


@pytest.mark.parametrize("overrides, fp32", [
    (["--model.dtype=bfloat16"], True),  # auto: full fine-tuning in bf16 gets fp32 masters
    (["--model.dtype=bfloat16", "--peft.method=lora"], False),  # adapters are fp32 already
    (["--model.dtype=float32"], False),  # nothing to be master of: fp32 throughout
    (["--model.dtype=bfloat16", "--train.master_weights=none"], False),
    (["--model.dtype=float32", "--train.master_weights=fp32"], True),
])
def test_fp32_master_weights_decides_auto(overrides, fp32):
    assert fp32_master_weights(load_config(None, overrides)) is fp32


def test_config_checks_import_no_torch():
    """`glmtune config validate` stays fast: the config layer, precision rules included, needs no torch."""
    code = "import sys, glmtune.config.validate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_ep_dispatcher_without_expert_parallelism_is_refused():
    from glmtune.config import load_config
    from glmtune.config.validate import check_ranges

    cfg = load_config("tiny/sft_support_json", ["--parallel.ep_dispatcher", "all_gather"])
    assert any(e.startswith("parallel.ep_dispatcher: all_gather moves tokens") for e in check_ranges(cfg))
    assert not any("ep_dispatcher" in e for e in check_ranges(load_config("tiny/sft_support_json")))


def test_lora_refuses_a_router_bias_update_no_adapter_can_carry():
    from glmtune.config.validate import check_ranges

    cfg = load_config("tiny/lora_support_json", ["--train.router_bias_update", "sign"])
    assert any(e.startswith("train.router_bias_update: sign with peft.method: lora") for e in check_ranges(cfg))
    assert not any("router_bias" in e for e in check_ranges(load_config("tiny/lora_support_json")))
    # Full fine-tuning trains the biases into the exported checkpoint: allowed.
    full = load_config("tiny/sft_support_json", ["--train.router_bias_update", "sign"])
    assert not any("router_bias" in e for e in check_ranges(full))


def test_lora_settings_without_lora_are_refused_by_name():
    from glmtune.config.validate import check_ranges

    cfg = load_config("tiny/sft_support_json", ["--peft.rank", "16", "--peft.adapter_compute", "fp32"])
    errors = check_ranges(cfg)
    assert any(e.startswith("peft.rank is set but peft.method is none") for e in errors)
    assert any(e.startswith("peft.adapter_compute is set but peft.method is none") for e in errors)
    assert not any(e.startswith("peft.") for e in check_ranges(load_config("tiny/sft_support_json")))


def test_lora_takes_the_mtp_loss_and_refuses_trainable_indexers():
    from glmtune.config.validate import auxiliary_loss_errors

    # The MTP layer takes adapters under LoRA (glmtune/peft/apply.py): no refusal.
    mtp = load_config("tiny/lora_support_json", ["--train.mtp_loss_weight", "0.3"])
    assert not any("mtp_loss_weight" in e for e in auxiliary_loss_errors(mtp))
    # The indexers learn as full weights: refused with LoRA, by name; accepted with full fine-tuning.
    indexer = ["--model.indexer_trainable", "true", "--train.indexer_loss_weight", "0.01"]
    errors = auxiliary_loss_errors(load_config("tiny/lora_support_json", indexer))
    assert [e for e in errors if "indexer" in e] == [
        "model.indexer_trainable with peft.method: lora: the indexers train as full weights, which a PEFT adapter "
        "cannot carry; use full fine-tuning (peft.method: none)"]
    assert not any("indexer" in e for e in auxiliary_loss_errors(load_config("tiny/sft_support_json", indexer)))
    dpo = auxiliary_loss_errors(load_config("tiny/lora_support_json", ["--train.mtp_loss_weight", "0.3",
                                                             "--train.objective", "dpo"]))
    assert any(e.startswith("train.mtp_loss_weight with train.objective: dpo") for e in dpo)


@pytest.mark.parametrize("every, at_end, steps, saves", [
    (0, True, 100, 1), (0, False, 100, 0), (50, True, 100, 2), (50, False, 100, 2), (30, True, 100, 4),
    (30, False, 100, 3)])
def test_planned_saves_count_the_periodic_ones_and_the_one_at_the_end(every, at_end, steps, saves):
    cfg = load_config(None, ["--checkpoint.every_steps", str(every), "--checkpoint.save_at_end", str(at_end).lower()])
    assert planned_saves(cfg, steps) == saves
