"""`glmtune train` with expert parallelism (forked gloo ranks on CPU, as torchrun starts them), against one process.

Per-step losses and gradient norms equal the single-process run with the same global
batch (relative 1e-5, fp32); the HF export of an EP run (from an HF checkpoint: the run
tests/distributed/test_sharded_load_train.py reads too) is the single-process model; a
checkpoint saved at dp_shard 4 x ep 2 resumes at ep 1 and at ep 4 with the same next
losses (DCP reshards the experts); LoRA on expert-parallel experts, loaded shard by
shard from an HF checkpoint, trains the same.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glmtune import load_pretrained, save_pretrained
from glmtune.models.glm5 import build_model, get_preset
from tests.distributed.forked_runs import train_in_forks
from tests.train.run_helpers import BATCH_8_WITH_EXPORT, FOUR_STEPS, printed, shared_run


def _records(run_dir: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows}


def _assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for step, (loss, norm) in expected.items():
        assert actual[step][0] == pytest.approx(loss, rel=1e-5), step
        assert actual[step][1] == pytest.approx(norm, rel=1e-5), step


TOKENIZER = "glmtune/data/assets/tiny_tokenizer"


def tiny_hf_checkpoint(shared_results) -> Path:
    """The tiny model (seed 0) saved as an HF checkpoint of 1 MB shards, once per session (read only)."""
    def build(root: Path) -> None:
        save_pretrained(build_model(get_preset("tiny"), seed=0), root / "tiny", max_shard_size="1MB")

    return shared_results.get("tiny-hf-1mb", build) / "tiny"


def from_hf_checkpoint(base: Path) -> list[str]:
    """Three steps from `base`, the HF export, and one held-out prompt answered before and after training
    (under torchrun on the sharded model; prompts are decoded one at a time, so one covers the path)."""
    return ["--train.max_steps", "3", "--checkpoint.every_steps", "3", "--model.name_or_path", str(base),
            "--data.tokenizer", TOKENIZER, "--train.generate_samples", "1", "--checkpoint.export_hf", "true"]


def test_ep2_matches_one_process_and_exports_the_same_model(shared_results):
    flags = from_hf_checkpoint(tiny_hf_checkpoint(shared_results))
    single = shared_run(shared_results, *flags)
    ep = shared_run(shared_results, *flags, "--parallel.ep", "2", nproc=2)  # test_sharded_load_train.py's run
    assert "ep 2" in ep.stdout
    _assert_same(_records(ep.run_dir), _records(single.run_dir))
    exported = load_pretrained(ep.run_dir / "hf", dtype=torch.float32).state_dict()
    reference = load_pretrained(single.run_dir / "hf", dtype=torch.float32).state_dict()
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        # Adam normalizes: reduction-order noise (1e-7) in a tiny gradient moves a weight by ~1e-6
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_ep2_with_expert_fsdp_resumes_at_other_expert_layouts(tmp_path, shared_results):
    """The ep 2 run, then its step-2 checkpoint resumed at ep 1 and at ep 4 one after another, each
    on 4 gloo ranks forked with their imports done (tests/distributed/forked_runs.py)."""
    single = shared_run(shared_results, *BATCH_8_WITH_EXPORT)  # its HF export is not read here
    expected, cache = _records(single.run_dir), single.cache_dir
    batch = ["--train.global_batch_size", "8"]  # 4 ranks x micro-batch 2
    train_in_forks({tmp_path / "ep2": [*FOUR_STEPS, *batch, "--parallel.ep", "2"]}, cache, nproc=4)
    out = (tmp_path / "ep2.out").read_text()
    assert "dp_shard 4" in out and "ep 2 (expert FSDP 2)" in out
    _assert_same(_records(tmp_path / "ep2"), expected)
    resumes = {}
    for ep in ("1", "4"):  # the step-2 checkpoint of the ep 2 run, resharded onto another layout
        layout = tmp_path / f"resume-ep{ep}"
        shutil.copytree(tmp_path / "ep2", layout)
        shutil.rmtree(layout / "checkpoints" / "step-00000004")
        resumes[layout] = [*FOUR_STEPS, *batch, "--parallel.ep", ep, "--checkpoint.resume", "auto"]
    train_in_forks(resumes, cache, nproc=4)
    for layout in resumes:
        out = (layout.parent / f"{layout.name}.out").read_text()
        assert printed(out, "resumed from") and printed(out, "step-00000002")
        _assert_same(_records(layout), expected)


def test_lora_on_expert_parallel_experts_matches_one_process(tmp_path, shared_results):
    """From an HF checkpoint: on 2 ranks (forked, as torchrun starts them) the base is built on meta
    and each rank reads only its shards, then the adapters get the values the one-process run draws."""
    base = tiny_hf_checkpoint(shared_results)
    cache = tmp_path / "cache"
    recipe = "tiny/lora_support_json"
    steps = ["--train.max_steps", "3", "--checkpoint.every_steps", "3", "--model.name_or_path", str(base),
             "--data.tokenizer", TOKENIZER]
    train_in_forks({tmp_path / "single": steps}, cache, recipe=recipe)
    train_in_forks({tmp_path / "ep2": [*steps, "--parallel.ep", "2"]}, cache, nproc=2, recipe=recipe)
    assert f"loaded {base}, rank 0: read" in " ".join((tmp_path / "ep2.out").read_text().split())
    _assert_same(_records(tmp_path / "ep2"), _records(tmp_path / "single"))
    for layout in ("adapter", "adapter_per_expert"):  # every expert's adapter, gathered from both ranks
        ours = load_file(tmp_path / "ep2" / layout / "adapter_model.safetensors")
        theirs = load_file(tmp_path / "single" / layout / "adapter_model.safetensors")
        assert ours.keys() == theirs.keys(), layout
        for name, tensor in theirs.items():
            # As above: Adam turns reduction-order noise in a near-zero gradient into ~1e-6 moves
            # (measured 4.5e-6 on one routed expert's B, whose entries reach 5e-3).
            torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_overlap_chunks_train_as_one_process_at_ep2_and_pp2_ep2(tmp_path, shared_results):
    """`parallel.ep_overlap_chunks: 2` (each MoE layer's tokens in 2 chunks whose all-to-alls overlap
    the other chunk's experts) trains as one process at EP 2 and at PP 2 x EP 2, on forked gloo ranks."""
    single = shared_run(shared_results, *BATCH_8_WITH_EXPORT)
    expected, cache = _records(single.run_dir), single.cache_dir
    chunks = [*FOUR_STEPS, "--train.global_batch_size", "8", "--parallel.ep_overlap_chunks", "2"]
    train_in_forks({tmp_path / "ep2": [*chunks, "--parallel.ep", "2"]}, cache, nproc=2)
    train_in_forks({tmp_path / "pp2-ep2": [*chunks, "--parallel.pp", "2", "--parallel.ep", "2"]}, cache, nproc=4)
    for layout in ("ep2", "pp2-ep2"):
        _assert_same(_records(tmp_path / layout), expected)


def test_selective_checkpointing_at_ep2_trains_as_one_process(tmp_path, shared_results):
    """Selective activation checkpointing of expert-parallel layers (whose experts are their own FSDP
    unit) trains as one process; it failed in backward on FSDP2's profiler ranges before (parallelize.py)."""
    single = shared_run(shared_results, *BATCH_8_WITH_EXPORT)
    flags = [*FOUR_STEPS, "--train.global_batch_size", "8", "--parallel.ep", "2",
             "--parallel.activation_checkpointing", "selective"]
    train_in_forks({tmp_path / "ep2-selective": flags}, single.cache_dir, nproc=2)
    _assert_same(_records(tmp_path / "ep2-selective"), _records(single.run_dir))


def test_kept_exchanges_train_as_one_process_at_pp2_ep2(tmp_path, shared_results):
    """`parallel.ep_keep_exchanges: both` (full recomputation takes the expert all-to-alls' rows from the
    forward, glmtune/distributed/exchange_keeper.py) trains as one process under the pipeline's schedule, with
    2 chunks, on forked gloo ranks."""
    single = shared_run(shared_results, *BATCH_8_WITH_EXPORT)
    flags = [*FOUR_STEPS, "--train.global_batch_size", "8", "--parallel.pp", "2", "--parallel.ep", "2",
             "--parallel.ep_overlap_chunks", "2", "--parallel.activation_checkpointing", "full",
             "--parallel.ep_keep_exchanges", "both"]
    train_in_forks({tmp_path / "pp2-ep2-kept": flags}, single.cache_dir, nproc=4)
    _assert_same(_records(tmp_path / "pp2-ep2-kept"), _records(single.run_dir))


def test_paired_overlap_trains_as_dualpipev_and_one_process_at_pp2_ep2(tmp_path, shared_results):
    """`parallel.pp_ep_overlap` (DualPipeV's paired forward and backward taking turns at the expert
    all-to-alls, glmtune/distributed/paired_overlap.py) gives DualPipeV's losses and gradient norms bit for
    bit, and one process's, at PP 2 x EP 2 on forked gloo ranks. Every layer is a MoE layer (one per stage),
    so both sides of every pair hand over; full checkpointing makes the backward's recomputation hand over too."""
    every_moe = [*FOUR_STEPS, "--train.global_batch_size", "8", "--train.micro_batch_size", "4",
                 "--model.overrides.first_k_dense_replace", "0"]
    single = shared_run(shared_results, *every_moe)
    dualpipe = [*every_moe, "--parallel.pp", "2", "--parallel.ep", "2", "--parallel.pp_schedule", "DualPipeV",
                "--parallel.pp_stages_per_rank", "2", "--parallel.activation_checkpointing", "full"]
    train_in_forks({tmp_path / "dualpipev": dualpipe,
                    tmp_path / "paired": [*dualpipe, "--parallel.pp_ep_overlap", "true"]},
                   single.cache_dir, nproc=4)
    paired = _records(tmp_path / "paired")
    assert paired == _records(tmp_path / "dualpipev")
    _assert_same(paired, _records(single.run_dir))
