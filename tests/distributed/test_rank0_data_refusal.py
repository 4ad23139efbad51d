"""A refusal rank 0 makes while preparing the run's data reaches every rank at once.

Under torchrun rank 0 prepares the data (contract check, split, tokenization cache) and the
other ranks then read what it wrote. A data file that violates the contract is refused on rank
0 with one sentence naming file:line; the other ranks must stop with that sentence too (the
CLI prints it once, on rank 0, and every rank exits 2). They waited at a barrier instead: until
the collective timeout (30 minutes here, as gloo's default) while rank 0's process lived on, and
with gloo, once it was gone, failing there with a "Connection closed by peer" traceback.

Two ranks run `glmtune train` through the CLI's own entry point in processes forked from the
gloo fork server, joined in one gloo group with torchrun's environment (as
tests/distributed/forked_runs.py runs them); the test waits for both to exit, with a deadline
far above what the refusal takes and far below the collective timeout.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.forked_cli import _output_to
from tests.distributed.gloo_helpers import start_forkserver_ranks
from tests.train.run_helpers import train_command

DEADLINE_S = 150.0  # both ranks refuse in seconds, far below the collective timeout
BAD_ROW = {"messages": [{"role": "wizard", "content": "hi"}]}


def _train_rank(rank: int, world_size: int, init_file: str, argv: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=30))
    from glmtune.cli import main

    try:
        with _output_to(f"{out_dir}/rank{rank}.out"):
            code = main(argv)
        Path(out_dir, f"rank{rank}.code").write_text(str(code))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_data_contract_refusal_on_rank0_stops_every_rank_at_once(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(BAD_ROW) + "\n")
    argv = train_command(tmp_path / "run", tmp_path / "cache", "--data.train", json.dumps([str(data)]))[3:]
    context = start_forkserver_ranks(_train_rank, (2, str(tmp_path / "rendezvous"), argv, str(tmp_path)), 2)
    began = time.monotonic()
    while not context.join(timeout=1.0):
        if time.monotonic() - began > DEADLINE_S:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            ended = sorted(p.name for p in tmp_path.glob("rank*.code"))
            raise AssertionError(f"a rank still waits after {DEADLINE_S:.0f} s (ended: {ended}); rank 0 said:\n"
                                 + (tmp_path / "rank0.out").read_text()[-2000:])
    for rank in (0, 1):  # the refusal on every rank: a user error (exit 2), no traceback
        out = (tmp_path / f"rank{rank}.out").read_text()
        assert (tmp_path / f"rank{rank}.code").read_text() == "2", out
        assert "Traceback" not in out, out
    error = [line for line in (tmp_path / "rank0.out").read_text().splitlines() if "error:" in line]
    assert len(error) == 1 and f"{data}:1: messages[0].role: unknown role 'wizard'" in error[0], error
    assert "error:" not in (tmp_path / "rank1.out").read_text()  # said once, by rank 0
