"""fp32 master weights held by the optimizer (`train.master_weights: auto` over bf16) under the
gloo layouts (CPU), against one process: per-step losses and gradient norms, and a checkpoint
resumed on another layout.

bf16 compute and bf16 gradients make "equal" a bf16 tolerance here (the fp32 layouts' tests ask
relative 1e-5): one process adds its accumulated micro-batches' bf16 gradients one at a time,
FSDP2 sums the ranks' in fp32 and rounds once, so the order of the roundings differs with the
layout (FSDP 2 with two micro-batches is the exact case: tests/distributed/test_mixed_precision.py).
The checkpoint holds the fp32 masters (in the parameters' place) and the fp32 moments, so DCP
reshards them like fp32 parameters: a step-2 checkpoint of EP 2 (each rank holding half the
experts) resumed at FSDP 2 without EP (each rank a shard of every expert) continues as the
one-process run does.
"""

from __future__ import annotations

import shutil

import pytest

from tests.distributed.forked_runs import train_in_forks
from tests.train.run_helpers import FOUR_STEPS, assert_same_steps, printed, shared_run, step_records

MASTERS = [*FOUR_STEPS, "--model.dtype", "bfloat16", "--train.master_weights", "fp32"]
# bf16's relative spacing is 2^-8 = 0.0039: losses within a quarter of it, gradient norms within one
# (measured at most 2e-4 on losses and 2.3e-3 on a norm: EP 2's expert products add in another order)
LOSS_REL, NORM_REL = 1e-3, 4e-3


def _assert_bf16_close(run_dir, reference_dir) -> None:
    assert_same_steps(step_records(run_dir, ("loss",)), step_records(reference_dir, ("loss",)), rel=LOSS_REL)
    assert_same_steps(step_records(run_dir, ("grad_norm",)), step_records(reference_dir, ("grad_norm",)),
                      rel=NORM_REL)

LAYOUTS = {  # name: (ranks, flags)
    "hsdp-2x2": (4, ["--parallel.dp_replicate", "2", "--train.micro_batch_size", "1"]),
    "ep-2": (2, ["--parallel.ep", "2"]),
    "pp-2": (2, ["--parallel.pp", "2"]),
}


@pytest.fixture(scope="module")
def single(shared_results):
    done = shared_run(shared_results, *MASTERS)
    assert "fp32 master weights in the optimizer" in " ".join(done.stdout.split())
    return done


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process(name, single, shared_results):
    nproc, flags = LAYOUTS[name]
    done = shared_run(shared_results, *MASTERS, *flags, nproc=nproc)
    assert f"fp32 master weights in the optimizer; world {nproc}" in " ".join(done.stdout.split())
    _assert_bf16_close(done.run_dir, single.run_dir)


def test_ep2_checkpoint_resumes_at_fsdp2(single, shared_results, tmp_path):
    nproc, flags = LAYOUTS["ep-2"]
    ep = shared_run(shared_results, *MASTERS, *flags, nproc=nproc)
    layout = tmp_path / "resume-at-fsdp2"
    shutil.copytree(ep.run_dir, layout)
    shutil.rmtree(layout / "checkpoints" / "step-00000004")
    # on 2 gloo ranks forked with their imports done (tests/distributed/forked_runs.py), as torchrun starts them
    train_in_forks({layout: [*MASTERS, "--parallel.ep", "1", "--checkpoint.resume", "auto"]}, ep.cache_dir, nproc=2)
    out = (tmp_path / "resume-at-fsdp2.out").read_text()
    assert printed(out, "resumed from") and printed(out, "step-00000002")
    _assert_bf16_close(layout, single.run_dir)
