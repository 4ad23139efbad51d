"""Where `glmtune eval` runs its models: one process on one device, or sharded over torchrun's ranks.

`Placement.choose` decides once per evaluation (before any model loads); `load(model)` gives the
backend that answers for one model, and `release()` frees it so memory holds one model at a
time. In one process a model is loaded whole on the device (`models.load_model`); sharded, each
rank loads its shards (`sharded.load_sharded_model`) and the ranks agree through a `Lockstep`.
What only one rank should do (hash the models, run the reference tool calls) runs on rank 0
and is shared (`on_main`); a user error there is raised on every rank, so no rank waits for a
collective the others never reach.

`check_device` refuses a `--device` this machine cannot use, in one sentence; `glmtune eval` and
`glmtune decide` call it first, before the suite or any model is read (and `choose` again, for the
Python API).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glmtune.distributed.lockstep import ONE_PROCESS
from glmtune.eval.backends import LocalModel
from glmtune.eval.models import ModelSource, load_model
from glmtune.eval.sharded import ShardedLayout, join, load_sharded_model


def check_device(device: str, sharded: bool, command: str) -> None:
    """`--device`: auto, cpu, or a CUDA device this machine has (`cuda`, or `cuda:N` in one process:
    sharded, each rank takes its LOCAL_RANK's GPU); ValueError in one sentence otherwise, so a device
    that cannot be used is refused before anything is read or loaded. `command` (eval, decide)
    names who runs the models in the message."""
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's own parse of the string
        raise ValueError(f"--device {device}: not a device (expected auto, cpu, cuda or cuda:N)") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: {command} runs local models on the CPU or a CUDA GPU (expected auto, "
                         "cpu, cuda or cuda:N)")
    if parsed.type == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here (torch {torch.__version__}); use "
                         "--device cpu, or auto")
    if parsed.index is not None and sharded:
        raise ValueError(f"--device {device} with --nproc-per-node: each rank runs on its own GPU (its LOCAL_RANK); "
                         "pass --device cuda")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1}")


@dataclass
class Placement:
    device: torch.device
    dtype: torch.dtype | None  # None: each checkpoint's own
    ranks: Any = ONE_PROCESS  # a `Lockstep` when sharded
    layout: ShardedLayout | None = None  # None: one process
    fp8_base: str = "none"  # one process: keep the frozen base of an adapter candidate in FP8
    joined: bool = False  # sharded: this evaluation joined the process group (and leaves it at `close`)

    @classmethod
    def choose(cls, device: str, dtype: torch.dtype | None, sharded: ShardedLayout | None,
               candidate: ModelSource, fp8_base: str = "none") -> "Placement":
        if sharded is not None:
            lockstep, torch_device, joined = join(device)
            return cls(torch_device, dtype, lockstep, sharded.resolved(candidate), joined=joined)
        check_device(device, sharded=False, command="eval")
        torch_device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                    "cpu" if device == "auto" else device)
        if fp8_base == "triton" and torch_device.type != "cuda":
            raise ValueError(f"--model.fp8_base triton runs Triton kernels on a CUDA GPU, and this evaluation runs "
                             f"on {torch_device.type}: pass --model.fp8_base dequant")
        return cls(torch_device, dtype, fp8_base=fp8_base)

    @property
    def is_main(self) -> bool:
        return self.ranks.rank == 0

    def on_main(self, compute: Callable[[], Any]) -> Any:
        """`compute()` run on rank 0 only, its value (or its ValueError) on every rank."""
        result: dict[int, Any] = {}
        if self.is_main:
            try:
                result[0] = ("value", compute())
            except ValueError as exc:
                result[0] = ("error", str(exc))
        kind, value = self.ranks.share(result)[0]
        if kind == "error":
            raise ValueError(value)
        return value

    def load(self, model: ModelSource) -> LocalModel:
        spec = model.spec
        if self.layout is None:
            return LocalModel(load_model(model, self.device, self.dtype, self.fp8_base), spec=spec)
        return LocalModel(load_sharded_model(model, self.layout, self.ranks, self.device, self.dtype), self.ranks,
                          spec)

    def release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def with_ranks(self, ops: dict) -> dict:
        """A model's operations entry with, sharded, each rank's peak memory (the entry's own: the largest)."""
        if self.layout is None:
            return ops
        peaks = self.ranks.share({self.ranks.rank: ops["peak_memory_gib"]})
        per_rank = [peaks[r] for r in range(self.ranks.world)]
        known = [p for p in per_rank if p is not None]
        return {**ops, "peak_memory_gib": max(known) if known else None, "peak_memory_gib_per_rank": per_rank,
                "ranks": self.ranks.world, "layout": {"ep": self.layout.ep, "fp8_base": self.layout.fp8_base}}

    def close(self) -> None:
        """Leave the process group if this evaluation joined it (the ranks first wait for rank 0's write);
        one its caller had joined stays theirs."""
        if self.layout is not None and torch.distributed.is_initialized():
            torch.distributed.barrier()
            if self.joined:
                torch.distributed.destroy_process_group()
