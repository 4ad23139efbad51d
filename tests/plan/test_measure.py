"""`glmtune plan --measure`'s replica of one rank against the real ranks of gloo runs of the
same layouts (tests/plan/measure_worker.py runs `measure_in_world` on each real gloo rank): rank
by rank the same parameter, gradient and AdamW bytes, and the same bytes received by FSDP2's
all-gathers and reduce-scatters (and the gathers of the trainer's statistics); with data
parallelism alone, where the stand-ins are exact, the same loss for every micro-batch of the
first step, bit for bit (on rank 0: see the test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.config import load_config
from glmtune.plan.measure import measure_rank
from glmtune.plan.planner import degrees_for
from tests.distributed.gloo_helpers import run_gloo
from tests.plan.measure_worker import measure_one_rank

SHORT = ["--data.packed_sequence_size", "256", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]
LAYOUTS = {
    # dense FSDP2 over 2 ranks (experts sharded with the rest), 2 micro-batches a step: exact
    "fsdp2": (2, "tiny/sft_support_json", ["--train.micro_batch_size", "1", "--train.global_batch_size", "4"]),
    # pipeline (1F1B, 2 microbatches) x FSDP2 x EP 2, LoRA on the frozen base
    "pp2-fsdp2-ep2-lora": (4, "tiny/lora_support_json", [
        "--parallel.pp", "2", "--parallel.ep", "2", "--parallel.pp_microbatches", "2",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4"]),
    # context parallelism 2 x pipeline 2 x FSDP2 2, experts over ep 2
    "cp2-pp2-fsdp2-ep2": (8, "tiny/sft_support_json", [
        "--parallel.cp", "2", "--parallel.pp", "2", "--parallel.ep", "2", "--parallel.pp_microbatches", "2",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4"]),
}
EXACT = {"fsdp2"}


def _real_ranks(name: str, tmp_path: Path) -> list[dict]:
    nproc, recipe, layout = LAYOUTS[name]
    run_gloo(measure_one_rank, nproc, tmp_path, str(tmp_path), recipe, [*SHORT, *layout], timeout_s=600)
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_replica_of_each_rank_holds_and_moves_what_the_real_rank_does(name, tmp_path):
    nproc, recipe, layout = LAYOUTS[name]
    real = _real_ranks(name, tmp_path)
    cfg = load_config(recipe, [*SHORT, *layout])
    degrees = degrees_for(cfg, nproc)
    for rank in range(nproc):
        replica = measure_rank(cfg, degrees, rank, steps=1, warmup=0)
        assert replica.held == real[rank]["held"], f"{name} rank {rank}"
        moved = {}
        for group in replica.comm_bytes.values():
            for op in ("all_gather", "reduce_scatter"):
                moved[op] = moved.get(op, 0) + group["bytes"].get(op, 0)
        assert moved == {op: real[rank]["collectives"].get(op, 0) for op in moved}, f"{name} rank {rank}"
        if name in EXACT and rank == 0:  # exact on the rank whose shard of every tensor is the first, largest
            # piece (torch.chunk): N copies of it, cut to size, are the tensor the real ranks gather. A rank with
            # a shorter piece gathers its padding into the copies.
            assert replica.first_micro_losses == real[rank]["first_micro_losses"], f"{name} rank {rank}"
            assert len(replica.first_micro_losses) == 2


def test_the_command_prints_the_rank_beside_the_plan_and_its_line_is_a_speed_source(capsys, tmp_path):
    assert main(["plan", "tiny/sft_support_json", "--measure", "--gpus", "2", "--rank", "1", "--steps", "1",
                 "--warmup-steps", "0", "--json", *SHORT]) == 0
    line = capsys.readouterr().out
    report = json.loads(line)
    assert report["rank"] == 1 and report["impl"] == "glmtune plan --measure"
    assert report["memory"]["held"] == report["memory"]["planned_held"]
    assert report["time"]["steps_timed"] == 1 and report["tokens_per_s_per_gpu"] > 0
    (tmp_path / "rank.json").write_text(line)
    assert main(["plan", "tiny/sft_support_json", "--throughput", str(tmp_path / "rank.json"), "--gpu", "h200-141g",
                 "--json", *SHORT]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert str(tmp_path / "rank.json") in planned["throughput"]["source"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--rank", "1"], "--rank is an option of --measure"),
    (["--measure", "--gpu", "h100-80g"], "--gpu is not used by --measure"),
    (["--measure", "--gpus", "2", "--rank", "2"], "ranks 0..1"),
    (["--measure", "--steps", "0"], "--steps must be"),
])
def test_refusals_before_anything_runs(argv, message, capsys):
    assert main(["plan", "tiny/sft_support_json", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_preference_recipe_is_measured_with_its_objective(capsys):
    """--measure of a DPO recipe runs the preference objective (rows of two documents, a chosen and a
    rejected answer; the LoRA reference forward) and holds the bytes the plan gives it."""
    assert main(["plan", "tiny/dpo_support_json", "--measure", "--gpus", "2", "--rank", "0", "--steps", "1",
                 "--warmup-steps", "0", "--json", "--model.name_or_path", "tiny", "--train.max_steps", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory"]["held"] == report["memory"]["planned_held"]
    assert report["time"]["steps_timed"] == 1 and len(report["time"]["losses"]) == 1
    assert 0 < report["time"]["losses"][0] < 5  # a pair loss (random adapters: the policy is not its reference)


def test_fp32_masters_are_held_as_planned(capsys):
    """A bf16 full fine-tune (train.master_weights auto: the optimizer's fp32 masters and moments,
    12 bytes per trainable bf16 parameter) holds the state bytes the plan gives its rank."""
    assert main(["plan", "tiny/sft_support_json", "--measure", "--gpus", "2", "--rank", "1", "--steps", "1",
                 "--warmup-steps", "0", "--json", "--model.dtype", "bfloat16", *SHORT]) == 0
    report = json.loads(capsys.readouterr().out)
    held = report["memory"]["held"]
    assert held == report["memory"]["planned_held"] and held["optimizer"] > 5 * held["grads"]


def test_a_pipelined_rank_runs_the_auxiliary_losses_it_is_given(capsys):
    """Under pipeline parallelism the measured rank's stages are built with the recipe's auxiliary
    losses (the trainer's pipeline options): the MTP loss and the indexer KL run and are reported."""
    assert main(["plan", "tiny/sft_support_json", "--measure", "--gpus", "2", "--rank", "1", "--steps", "1",
                 "--warmup-steps", "0", "--json", "--parallel.pp", "2", "--parallel.pp_microbatches", "2",
                 "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.mtp_loss_weight", "0.3",
                 "--model.indexer_trainable", "true", "--train.indexer_loss_weight", "0.01",
                 "--model.overrides.index_topk", "64", *SHORT]) == 0
    report = json.loads(capsys.readouterr().out)
    (aux,) = report["time"]["auxiliary_losses"]
    assert aux["mtp_loss"] > 0 and aux["indexer_kl"] > 0, aux
