"""Decisions rank 0 makes for every rank: checks of shared files, refusals, run ids.

Checks against the filesystem (is the run directory free, is there disk space) run
once, on rank 0; every rank must then act on the same answer, and a refusal must stop
every rank with the same sentence instead of leaving the others waiting in a
collective until the timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def decide_on_rank0(decide: Callable[[], T]) -> T:
    """Run `decide` on rank 0 and return its result on every rank.

    A `ValueError` raised by `decide` (a user error) is raised on every rank with the
    same message; any other exception propagates on rank 0 with its traceback and
    stops the other ranks with a RuntimeError that names it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return decide()
    box: list = [None, None, None]  # result, user error, other failure
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except ValueError as exc:
            box[1] = str(exc)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others are told
            failure, box[2] = exc, repr(exc)
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[1] is not None:
        raise ValueError(box[1])
    if box[2] is not None:
        raise RuntimeError(f"rank 0 failed: {box[2]}")
    return box[0]
