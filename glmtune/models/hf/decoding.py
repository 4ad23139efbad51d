"""The `hf` family's cached decoding: `HF_DECODING`, the hooks the spec gives `glmtune.generation`.

A transformers causal LM decodes incrementally with transformers' own cache (`DynamicCache`
built from the model's config, so sliding-window and hybrid layers keep what transformers
keeps) and its own decoder forward: the new tokens go in with their rope positions and the
2-D attention mask of every cached position plus the new ones (0 for left padding), exactly
the inputs transformers' `generate` gives the model at each step (it derives the same
positions from the mask). transformers builds the causal and padding mask from them, in the
form the model's attention implementation takes. So greedy decoding here is transformers'
greedy `generate`, token for token (tests/models/hf/test_hf_decoding.py).

The hidden states come from the decoder (`get_decoder()`, final norm applied), the logits from
the output embeddings (`get_output_embeddings()`), which the generation loop applies to the last
position only. A sharded model (FSDP2) is run by its layers' own forward hooks, which gather
each layer's weights; the loop gathers the root's (embedding, final norm, head) around the
whole call, so the lockstep's `gathered` is not needed here.

Legend: B batch, S new tokens, T cached positions.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import DynamicCache, PreTrainedModel

from glmtune.models.common.decoding import CachedDecoding, Gathered


class HfDecodeCache:
    """transformers' `DynamicCache` of one batch, and which of its positions are real tokens."""

    def __init__(self, model: PreTrainedModel, batch: int, max_len: int, device: torch.device) -> None:
        self.kv = DynamicCache(config=model.config)
        self.valid_BT = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # transformers' 2-D mask
        self.length = 0
        self.max_len = max_len

    def nbytes(self) -> int:
        """Bytes the keys, values and mask hold now (the cache grows as positions are filled)."""
        tensors = [self.valid_BT]
        for layer in self.kv.layers:
            tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def _special_ids(model: PreTrainedModel, name: str) -> list[int]:
    """Every id the model's config and generation config give for `name` ("eos_token_id", ...)."""
    ids: list[int] = []
    for config in (model.config, getattr(model, "generation_config", None)):
        value = getattr(config, name, None) if config is not None else None
        ids += [] if value is None else [value] if isinstance(value, int) else list(value)
    return ids


class HfDecoding(CachedDecoding):
    """The hf family's decoding hooks (module docstring)."""

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, PreTrainedModel) and hasattr(model, "get_decoder")

    def supported(self, model: nn.Module) -> bool:
        """A plain transformers model in one process: FSDP2-sharded parameters (DTensors) need the
        lockstep of their ranks (`glmtune.train.generate.greedy_generate` runs those)."""
        if not self.owns(model) or isinstance(model, FSDPModule):
            return False
        return not any(isinstance(p, DTensor) for p in model.parameters())

    def head(self, model: PreTrainedModel) -> nn.Module:
        return model.get_output_embeddings()

    def new_cache(self, model: PreTrainedModel, batch: int, max_len: int) -> HfDecodeCache:
        return HfDecodeCache(model, batch, max_len, self.head(model).weight.device)

    @torch.no_grad()
    def forward(self, model: PreTrainedModel, ids_BS: torch.Tensor, positions_BS: torch.Tensor,
                valid_BS: torch.Tensor, cache: HfDecodeCache, gathered: Gathered | None = None) -> torch.Tensor:
        start, end = cache.length, cache.length + ids_BS.shape[1]
        if end > cache.max_len:
            raise ValueError(f"cache holds {cache.max_len} positions; {end} asked for")
        cache.valid_BT[:, start:end] = valid_BS
        out = model.get_decoder()(input_ids=ids_BS, attention_mask=cache.valid_BT[:, :end],
                                  position_ids=positions_BS, cache=cache.kv, use_cache=True)
        cache.length = end
        return out.last_hidden_state

    def eos_token_ids(self, model: PreTrainedModel) -> set[int]:
        """The config's and the generation config's end-of-sequence ids (transformers' `generate`
        stops at the generation config's)."""
        return set(_special_ids(model, "eos_token_id"))

    def pad_token_id(self, model: PreTrainedModel) -> int:
        pads = _special_ids(model, "pad_token_id")
        return pads[0] if pads else 0


HF_DECODING = HfDecoding()
