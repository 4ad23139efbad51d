"""`HfFormat`: how a family's models are stored as HF directories, for checkpoint/'s readers and writers.

glmtune/checkpoint/ reads, verifies and writes HF directories (config.json and safetensors) for any
family: the index and the shard files, the safetensors headers, the FP8 block-scale layout
(checkpoint/fp8_layout.py), the read plan and the shard plan are the same for every family. What
only the family knows comes through this interface, which its spec hands over (`ModelSpec.hf_format`):

  read_config   config.json -> the family's args, with no size bound of its own: a directory's
                weights are what its sizes are checked against (checkpoint/hf_verify.py)
  adapter       args -> the family's `StateDictAdapter`, the only place HF key names live
  build_meta    (args, dtype) -> the model on the meta device: the names, shapes and dtypes of the
                tensors a checkpoint of `args` holds, without memory
  hf_config     args -> the config.json a writer puts beside the weights
  model_dtype   a built model -> the dtype it computes in (config.json's `dtype`)

Knows no family, and imports no torch at import time (`glmtune --help` imports model_spec.py,
which names this type).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch-free at import (module docstring)
    import torch
    from torch import nn


@dataclass(frozen=True)
class Target:
    """Where one HF tensor lands in the model: the whole state-dict tensor `key`, or, for a stacked
    expert tensor, `key[expert, rows[0]:rows[1]]` (rows None: the expert's whole slab)."""

    key: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


class StateDictAdapter(Protocol):
    """A family's HF names for one architecture (its args): what checkpoint/ asks of them."""

    # State-dict keys whose tensor a checkpoint does not hold because it is another's (a tied LM head).
    tied_keys: frozenset[str]
    # The kinds of layers stored with tensors of their own, and how many config.json gives of each
    # ({"layers": 78, "MTP layers": 1}): a checkpoint with fewer tensors than layers is not the config's.
    layer_counts: dict[str, int]

    def from_hf_key(self, hf_key: str) -> Target | None:
        """Where an HF tensor lands, or None when the model has no place for it."""

    def to_hf(self, internal_key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, view of `tensor`) of each checkpoint tensor a state-dict tensor is stored as."""

    def hf_prefix(self, internal_key: str) -> str:
        """A module name or key prefix as it is named on disk."""

    def internal_prefix(self, hf_name: str) -> str:
        """`hf_prefix`'s inverse."""

    def required_dtype(self, hf_key: str) -> str | None:
        """The one safetensors dtype the tensor may be stored in (None: any weight dtype)."""


@dataclass(frozen=True)
class HfFormat:
    """One family's answers for its HF directories (module docstring)."""

    read_config: Callable[[str | Path], Any]
    adapter: Callable[[Any], StateDictAdapter]
    build_meta: Callable[[Any, torch.dtype], nn.Module]
    hf_config: Callable[[Any], dict[str, Any]]
    model_dtype: Callable[[nn.Module], torch.dtype]
