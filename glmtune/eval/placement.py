"""Where `glmtune eval` runs its models: one process on one device, or sharded over torchrun's ranks.

`Placement.choose` decides once per evaluation (before any model loads); `load(model)` gives the
backend that answers for one model, and `release()` frees it so memory holds one model at a
time. In one process a model is loaded whole on the device (`models.load_model`); sharded, each
rank loads its shards (`sharded.load_sharded_model`) and the ranks agree through a `Lockstep`.
What only one rank should do (hash the models, run the reference tool calls) runs on rank 0
and is shared (`on_main`); a user error there is raised on every rank, so no rank waits for a
collective the others never reach.
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


@dataclass
class Placement:
    device: torch.device
    dtype: torch.dtype | None  # None: each checkpoint's own
    ranks: Any = ONE_PROCESS  # a `Lockstep` when sharded
    layout: ShardedLayout | None = None  # None: one process
    fp8_base: str = "none"  # one process: keep the frozen base of an adapter candidate in FP8

    @classmethod
    def choose(cls, device: str, dtype: torch.dtype | None, sharded: ShardedLayout | None,
               candidate: ModelSource, fp8_base: str = "none") -> "Placement":
        if sharded is not None:
            lockstep, torch_device = join(device)
            return cls(torch_device, dtype, lockstep, sharded.resolved(candidate))
        torch_device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                    "cpu" if device == "auto" else device)
        if torch_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
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
        """Leave the process group this evaluation joined (the ranks first wait for rank 0's write)."""
        if self.layout is not None and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
