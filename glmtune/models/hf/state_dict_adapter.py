"""The `hf` family's state-dict adapter: the model is transformers' own, so its names are the HF names.

For a dense model the adapter is the identity on names and tensors. transformers 5 fuses a MoE
layer's per-expert checkpoint tensors into stacked parameters as it loads (and splits them as it
saves): that mapping is transformers' (its weight conversions), and this adapter does not
reproduce it yet, so it refuses a MoE model rather than hand out names no checkpoint holds.

What glmtune/checkpoint/ asks of it (models/common/hf_format.py's `StateDictAdapter`): a tied LM
head is not stored (transformers writes the embedding only), the decoder layers are the only
layers with tensors of their own, and no tensor must be stored in one dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from glmtune.models.common.hf_format import Target
from glmtune.models.hf.args import HfArgs


class HfStateDictAdapter:
    """Identity on HF names (module docstring)."""

    def __init__(self, args: HfArgs) -> None:
        if args.num_experts:
            raise ValueError(f"{args.architecture}: the hf family's state-dict adapter does not map MoE experts "
                             "yet (transformers fuses them on load); load and save go through transformers")
        self.args = args
        self.tied_keys = frozenset({"lm_head.weight"} if args.tie_word_embeddings else ())
        self.layer_counts = {"layers": args.num_hidden_layers}

    def from_hf_key(self, hf_key: str) -> Target:
        return Target(hf_key)  # a key the model has no place for is the reader's to refuse

    def required_dtype(self, hf_key: str) -> str | None:
        return None

    def hf_prefix(self, internal_key: str) -> str:
        return internal_key

    def internal_prefix(self, hf_name: str) -> str:
        return hf_name

    def to_hf(self, internal_key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield internal_key, tensor

    def hf_shapes(self, internal_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return dict(internal_shapes)
