"""`CachedDecoding`: a family's hooks for incremental decoding, which `glmtune.generation` drives.

`glmtune.generation.generate` owns what every family shares: left padding, prefill chunks, the
sampling, stop tokens and strings, the lockstep of a sharded model's ranks. What depends on the
architecture is the family's, behind this interface (its spec's `decoding`): which cache a
model keeps per token, the forward over new tokens through that cache, the output head, and the
special token ids of its config. GLM-5's (compressed KV and indexer keys) is
`glmtune/models/glm5/decode.py`.

Knows no family: the methods take the family's own model and return its own cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch-free at import: `glmtune --help` imports model_spec.py, which imports this
    import torch
    from torch import nn

# `gathered(layer)`: a context in which a sharded layer's own weights are whole (the lockstep's)
Gathered = Callable[["nn.Module"], AbstractContextManager]


class DecodeCache(Protocol):
    """A family's decoding cache: buffers for `max_len` positions, of which `length` are filled."""

    length: int
    max_len: int

    def nbytes(self) -> int:
        """Bytes the buffers hold (all `max_len` positions)."""
        ...


class CachedDecoding(ABC):
    """One family's decoding hooks (module docstring). Stateless: one instance per family."""

    @abstractmethod
    def owns(self, model: nn.Module) -> bool:
        """Whether `model` is this family's causal LM (sharded or not)."""

    @abstractmethod
    def supported(self, model: nn.Module) -> bool:
        """Whether the cached forward runs `model` in one process, with no lockstep: a plain model
        whose layers' forwards neither gather nor route (no FSDP2, EP, CP or pipeline stages)."""

    @abstractmethod
    def head(self, model: nn.Module) -> nn.Module:
        """The output projection: final hidden states [..., D] -> logits [..., V]; its weight's
        dtype and device are the cache's."""

    @abstractmethod
    def new_cache(self, model: nn.Module, batch: int, max_len: int) -> DecodeCache:
        """An empty cache for `batch` rows of up to `max_len` positions, in the head's dtype and device."""

    @abstractmethod
    def forward(self, model: nn.Module, ids_BS: torch.Tensor, positions_BS: torch.Tensor, valid_BS: torch.Tensor,
                cache: Any, gathered: Gathered | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, S, D] of the next S positions of every row (rope
        `positions_BS`; `valid_BS` False for left padding), appended to `cache`. `gathered`: the
        lockstep's context for a sharded layer (None: a model in one process)."""

    @abstractmethod
    def eos_token_ids(self, model: nn.Module) -> set[int]:
        """The model config's end-of-sequence ids (empty if it names none)."""

    @abstractmethod
    def pad_token_id(self, model: nn.Module) -> int:
        """The id left padding uses (the config's, else 0: pad positions are masked out anyway)."""
