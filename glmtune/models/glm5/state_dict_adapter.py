"""The only place HF checkpoint key names appear: HF on-disk keys <-> glmtune keys.

On disk (transformers `save_pretrained`, zai-org releases) routed experts are stored
per expert; in memory they are stacked:

    model.layers.{i}.mlp.experts.{e}.gate_proj.weight [I, D] -> experts.gate_up_proj[e, :I]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight   [I, D] -> experts.gate_up_proj[e, I:]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight [D, I] -> experts.down_proj[e]

MTP layers sit after the decoder layers on disk (`model.layers.{L + j}.*`) and under
`mtp.{j}.*` in memory. Everything else keeps its name. FP8 checkpoints
(float8_e4m3fn weights with `weight_scale_inv` over 128x128 blocks) are
dequantized by `dequantize_fp8_block`. A tied LM head is not stored (transformers writes the
embedding only), and the routers' selection bias is stored in F32 only.

What glmtune/checkpoint/ asks of it is models/common/hf_format.py's `StateDictAdapter`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from glmtune.kernels import fp8_blocks
from glmtune.models.common.hf_format import Target
from glmtune.models.glm5.args import Glm5Args

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_INTERNAL_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_INTERNAL_EXPERTS_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$")
FP8_BLOCK = fp8_blocks.BLOCK
is_fp8 = fp8_blocks.is_fp8
SCALE_SUFFIX = "_scale_inv"
# The router's selection bias is added to fp32 sigmoid scores; a lower precision copy changes
# which experts are picked.
_F32_ONLY_SUFFIX = "e_score_correction_bias"


class Glm5StateDictAdapter:
    def __init__(self, args: Glm5Args) -> None:
        self.args = args
        self.num_layers = args.num_hidden_layers
        self.expert_dim = args.moe_intermediate_size
        self.tied_keys = frozenset({"lm_head.weight"} if args.tie_word_embeddings else ())
        self.layer_counts = {"layers": args.num_hidden_layers, "MTP layers": args.num_nextn_predict_layers}

    def required_dtype(self, hf_key: str) -> str | None:
        """F32 for the routers' selection bias (`_F32_ONLY_SUFFIX`), else None."""
        return "F32" if hf_key.endswith(_F32_ONLY_SUFFIX) else None

    # -- HF -> glmtune ------------------------------------------------------------------
    def from_hf_key(self, hf_key: str) -> Target | None:
        """The target of an HF key, or None when the key is not a model tensor we know."""
        if hf_key.endswith(SCALE_SUFFIX):
            return None
        match = _LAYER_RE.match(hf_key)
        if not match:
            return Target(hf_key) if hf_key in _TOP_LEVEL_KEYS else None
        layer, rest = int(match.group(1)), match.group(2)
        if layer < self.num_layers:
            prefix = f"model.layers.{layer}"
        elif layer < self.num_layers + self.args.num_nextn_predict_layers:
            prefix = f"mtp.{layer - self.num_layers}"
        else:
            return None
        expert = _EXPERT_RE.match(rest)
        if expert is None:
            return Target(f"{prefix}.{rest}")
        index, proj = int(expert.group(1)), expert.group(2)
        if index >= self.args.n_routed_experts:
            return None  # reported as an unexpected tensor by the loader
        if proj == "down_proj":
            return Target(f"{prefix}.mlp.experts.down_proj", index)
        rows = (0, self.expert_dim) if proj == "gate_proj" else (self.expert_dim, 2 * self.expert_dim)
        return Target(f"{prefix}.mlp.experts.gate_up_proj", index, rows)

    # -- glmtune -> HF ------------------------------------------------------------------
    def hf_prefix(self, internal_key: str) -> str:
        match = _INTERNAL_MTP_RE.match(internal_key)
        if match:
            return f"model.layers.{self.num_layers + int(match.group(1))}.{match.group(2)}"
        return internal_key

    def internal_prefix(self, hf_name: str) -> str:
        """The in-memory name of an HF module name or key prefix, `hf_prefix`'s inverse: an MTP
        layer's `model.layers.{L + j}.rest` -> `mtp.{j}.rest`; other names are unchanged."""
        match = _LAYER_RE.match(hf_name)
        if match and 0 <= int(match.group(1)) - self.num_layers < self.args.num_nextn_predict_layers:
            return f"mtp.{int(match.group(1)) - self.num_layers}.{match.group(2)}"
        return hf_name

    def to_hf(self, internal_key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """HF (key, tensor) pairs for one internal tensor; stacked experts are split."""
        key = self.hf_prefix(internal_key)
        experts = _INTERNAL_EXPERTS_RE.match(key)
        if experts is None:
            yield key, tensor
            return
        base, kind, scale = experts.groups()
        # A frozen FP8 base's block scales split like their weights, in 128-row blocks.
        suffix, split = ("weight" + SCALE_SUFFIX, self.expert_dim // FP8_BLOCK) if scale else ("weight", self.expert_dim)
        for index in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{base}.{index}.down_proj.{suffix}", tensor[index]
            else:
                yield f"{base}.{index}.gate_proj.{suffix}", tensor[index, :split]
                yield f"{base}.{index}.up_proj.{suffix}", tensor[index, split:]

    def hf_shapes(self, internal_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Expected HF key -> shape for a model whose internal tensors have these shapes."""
        out: dict[str, tuple[int, ...]] = {}
        for key, shape in internal_shapes.items():
            meta = torch.empty(shape, device="meta")
            for hf_key, part in self.to_hf(key, meta):
                out[hf_key] = tuple(part.shape)
        return out


_TOP_LEVEL_KEYS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


check_fp8_scale = fp8_blocks.check_scale


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w[i, j] * scale_inv[i // 128, j // 128] in fp32, cast to `dtype` (DeepSeek/GLM FP8 layout)."""
    return fp8_blocks.dequantize(weight, scale_inv, dtype)


def dequantize_fp8_region(weight: torch.Tensor, scale_inv: torch.Tensor, start: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """The rows/cols of an FP8 weight that begin at `start` (`fp8_blocks.dequantize_region`)."""
    return fp8_blocks.dequantize_region(weight, scale_inv, start, dtype)
