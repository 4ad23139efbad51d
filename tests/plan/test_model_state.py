"""The plan's per-rank parameter, gradient and AdamW bytes against what the ranks of real
multi-process runs hold (gloo, CPU, the tiny model), exactly; and the guide's floor for GLM-5."""

from __future__ import annotations

import json

import pytest
import torch

from glmtune.config import load_config
from glmtune.models.registry import model_spec
from glmtune.plan.floor import floor_table
from glmtune.plan.model_state import build_meta_model, rank_state, whole_model_state
from glmtune.plan.planner import degrees_for
from tests.distributed.gloo_helpers import run_gloo
from tests.plan.shard_bytes_worker import record_one_rank

SHORT = ["--train.max_steps", "1", "--optim.warmup_steps", "0", "--data.synthetic.rows", "120", "--data.packed_sequence_size", "256",
         "--train.val_every", "0", "--train.generate_samples", "0", "--checkpoint.export_hf", "false",
         "--logging.progress", "false", "--logging.tensorboard", "false", "--train.log_every", "1"]

LAYOUTS = {
    # pipeline placement, experts split over ep and sharded, dense FSDP chunks (odd dims included)
    "pp2-fsdp2-ep2": (4, "tiny/sft_support_json", [
        "--parallel.pp", "2", "--parallel.ep", "2", "--parallel.pp_microbatches", "2",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4"]),
    # LoRA: frozen base shards, fp32 adapters; experts FSDP-sharded with the dense mesh (ep 1)
    "fsdp2-lora": (2, "tiny/lora_support_json", ["--train.micro_batch_size", "2", "--train.global_batch_size", "4"]),
    # fp32 master weights held by the optimizer for bf16 parameters, sharded with them (experts over ep)
    "fsdp2-ep2-fp32-masters": (2, "tiny/sft_support_json", [
        "--model.dtype", "bfloat16", "--train.master_weights", "fp32", "--parallel.ep", "2",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_per_rank_bytes_equal_what_the_ranks_hold(name, tmp_path):
    nproc, recipe, layout = LAYOUTS[name]
    overrides = [*SHORT, *layout, "--logging.run_dir", str(tmp_path / "run"),
                 "--data.cache_dir", str(tmp_path / "cache")]
    run_gloo(record_one_rank, nproc, tmp_path, str(tmp_path), recipe, overrides, timeout_s=600)
    cfg = load_config(recipe, overrides)
    degrees = degrees_for(cfg, nproc)
    model = build_meta_model(cfg)
    for rank in range(nproc):
        measured = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        planned = rank_state(model, cfg, degrees, rank)
        assert {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer} == measured, \
            f"{name} rank {rank}"


def test_the_guides_floor_for_glm5():
    cfg = load_config("recipes/glm5/sft_4k.yaml")
    model = build_meta_model(cfg)
    rows = {row.what: row.bytes / 1e12 for row in floor_table(model)}
    # The guide: 753B x 2 bytes = 1.51 TB weights, 1.51 TB gradients, 6.02 TB Adam, 3.01 TB fp32 masters.
    assert round(rows["bf16 weights"], 2) == 1.51 and round(rows["gradients (bf16)"], 2) == 1.51
    assert 6.0 < rows["Adam moments (fp32)"] < 6.05 and 3.0 < rows["fp32 master weights"] < 3.03
    assert 9.0 < rows["full fine-tuning, without fp32 masters"] < 9.1
    assert 12.0 < rows["full fine-tuning, with fp32 masters"] < 12.1
    # The recipe trains bf16 parameters with fp32 masters and moments in the optimizer: 16 bytes a
    # trainable bf16 parameter; the routers (fp32, their own masters) 16 too.
    state = whole_model_state(model, model_spec(cfg.model), masters=True)
    trainable = state.trainable_params
    routers = sum(p.numel() for p in model.parameters() if p.requires_grad and p.dtype == torch.float32)
    assert routers and state.grads == 2 * (trainable - routers) + 4 * routers
    assert state.optimizer == 12 * (trainable - routers) + 8 * routers
