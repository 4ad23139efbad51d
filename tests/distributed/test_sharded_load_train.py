"""`glmtune train` from an HF checkpoint under torchrun never holds the whole model on one
rank: it builds on the meta device, parallelizes, and each rank reads only its shards
(`load_sharded`). The run equals the one-process run step by step, "before" samples
included (generated on the sharded model), and exports the same checkpoint.

The two runs (one process; ep 2 on 2 ranks) are the ones the first test of
tests/distributed/test_expert_parallel_train.py compares, made once per session."""

from __future__ import annotations

import torch

from glmtune import load_pretrained
from tests.distributed.test_expert_parallel_train import _assert_same, _records, from_hf_checkpoint, tiny_hf_checkpoint
from tests.train.run_helpers import shared_run


def test_ep2_from_an_hf_checkpoint_reads_only_its_shards_and_trains_like_one_process(shared_results):
    base = tiny_hf_checkpoint(shared_results)
    flags = from_hf_checkpoint(base)
    single = shared_run(shared_results, *flags)
    done = shared_run(shared_results, *flags, "--parallel.ep", "2", nproc=2)
    out = " ".join(done.stdout.split())
    assert f"loaded {base}, rank 0: read" in out  # about half the bytes: its experts, its FSDP shard
    _assert_same(_records(done.run_dir), _records(single.run_dir))
    exported = load_pretrained(done.run_dir / "hf", dtype=torch.float32).state_dict()
    reference = load_pretrained(single.run_dir / "hf", dtype=torch.float32).state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=1e-5, msg=name)  # Adam: see EP test
