"""The `hf` family's state-dict adapter: the model is transformers' own, so its names are the HF names,
but for a MoE model's experts.

transformers 5 keeps a MoE layer's experts as stacked 3-D parameters in memory and stores them per
expert on disk: as it loads it merges the per-expert tensors, and as it saves it splits them again,
following its own table of weight conversions (`transformers.conversion_mapping`, by class name,
else by `model_type`). For Qwen2/3-MoE, OLMoE, GLM-4.5, DeepSeek-V3 and the other Qwen2-MoE-style
layers that table says:

    mlp.experts.{e}.gate_proj.weight [I, D] -> mlp.experts.gate_up_proj[e, :I]
    mlp.experts.{e}.up_proj.weight   [I, D] -> mlp.experts.gate_up_proj[e, I:]
    mlp.experts.{e}.down_proj.weight [D, I] -> mlp.experts.down_proj[e]

(MergeModulelist along the experts, then Concatenate along dim 1 of the named sources in order).
This adapter reads transformers' table for the model and maps exactly those converters; an entry
of any other kind (a renaming, a transpose, a chunk by a config attribute, ...) is refused by
name, rather than names handed out that no checkpoint holds. Every other tensor keeps its name.

What glmtune/checkpoint/ asks of it (models/common/hf_format.py's `StateDictAdapter`): a tied LM
head is not stored (transformers writes the embedding only), the decoder layers are the only
layers with tensors of their own, and no tensor must be stored in one dtype. Module names and key
prefixes are the same on disk and in memory (`hf_prefix`): only whole stacked tensors are split.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

from glmtune.models.common.hf_format import Target
from glmtune.models.hf.args import HfArgs

# A pattern this adapter maps: names of letters, digits, '_' and '.', with '*' for the expert index.
_PLAIN_PATTERN = re.compile(r"[\w.*]+")


@dataclass(frozen=True)
class StackedExperts:
    """One stacked expert parameter, by the tail of its name (`target`, "mlp.experts.gate_up_proj"),
    and the per-expert checkpoint tensors it is cut into along dim 1, in order (`sources`, with '*'
    where the expert's index goes: "mlp.experts.*.gate_proj.weight")."""

    target: str
    sources: tuple[str, ...]

    def source_regex(self, index: int) -> re.Pattern[str]:
        """An HF key ending in source `index`: (prefix, expert)."""
        head, tail = self.sources[index].split("*")
        prefix = "(.*)" if head.startswith(".") else r"(|.*\.)"  # whole names: "mlp" is not "shared_mlp"
        return re.compile(f"^{prefix}{re.escape(head)}(\\d+){re.escape(tail)}$")

    def prefix_of(self, internal_key: str) -> str | None:
        """The module prefix of `internal_key` when it names this stacked parameter, else None."""
        boundary = "" if self.target.startswith(".") else "."
        if internal_key == self.target and boundary:
            return ""
        return internal_key[: -len(self.target)] if internal_key.endswith(boundary + self.target) else None


def _describe(conversion) -> str:
    operations = ", ".join(type(op).__name__ for op in getattr(conversion, "operations", ()))
    return (f"{type(conversion).__name__} {conversion._original_source_patterns} -> "
            f"{conversion._original_target_patterns}" + (f" ({operations})" if operations else ""))


def _stacked(conversion) -> StackedExperts | None:
    """The converter as `StackedExperts`, or None when it is not of the one kind mapped (module docstring)."""
    if type(conversion) is not WeightConverter:
        return None
    sources, targets = conversion._original_source_patterns, conversion._original_target_patterns
    ops = conversion.operations
    merged = len(ops) >= 1 and type(ops[0]) is MergeModulelist and ops[0].dim == 0
    concatenated = (len(ops) == 1 and len(sources) == 1) or (
        len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1 and ops[1].num_shards_attribute is None)
    plain = all(_PLAIN_PATTERN.fullmatch(p) for p in (*sources, *targets))
    if not (merged and concatenated and plain and len(targets) == 1 and "*" not in targets[0]
            and all(p.count("*") == 1 for p in sources)):
        return None
    return StackedExperts(targets[0], tuple(sources))


def stacked_experts(args: HfArgs) -> tuple[StackedExperts, ...]:
    """The stacked expert parameters transformers' conversion table gives the model; ValueError
    naming an entry this adapter does not map."""
    table = get_checkpoint_conversion_mapping(args.architecture)
    if table is None:
        table = get_checkpoint_conversion_mapping(args.model_type) or []
    out = []
    for conversion in table:
        stacked = _stacked(conversion)
        if stacked is None:
            raise ValueError(f"{args.architecture}: transformers converts its checkpoint tensors with "
                             f"{_describe(conversion)}, which the hf family's state-dict adapter does not map yet")
        out.append(stacked)
    return tuple(out)


class HfStateDictAdapter:
    """transformers' HF names, stacked experts split per expert (module docstring)."""

    def __init__(self, args: HfArgs) -> None:
        self.args = args
        self.stacked = stacked_experts(args)
        if args.num_experts and not self.stacked:
            raise ValueError(f"{args.architecture}: a MoE model whose experts transformers' conversion table does "
                             "not name; the hf family's state-dict adapter does not map its experts")
        self.tied_keys = frozenset({"lm_head.weight"} if args.tie_word_embeddings else ())
        self.layer_counts = {"layers": args.num_hidden_layers}
        self._sources = [(stacked, i, stacked.source_regex(i)) for stacked in self.stacked
                         for i in range(len(stacked.sources))]

    def from_hf_key(self, hf_key: str) -> Target | None:
        """Where an HF tensor lands: a per-expert tensor in its stacked parameter's expert (and rows:
        source i of n is the i-th n-th of dim 1), anything else under its own name (a key the model
        has no place for is the reader's to refuse); None for an expert index past the model's."""
        for stacked, i, regex in self._sources:
            match = regex.match(hf_key)
            if match is None:
                continue
            expert = int(match.group(2))
            if expert >= self.args.num_experts:
                return None
            key = match.group(1) + stacked.target
            if len(stacked.sources) == 1:
                return Target(key, expert)
            width = self.args.moe_intermediate_size
            return Target(key, expert, (i * width, (i + 1) * width))
        return Target(hf_key)

    def required_dtype(self, hf_key: str) -> str | None:
        return None

    def hf_prefix(self, internal_key: str) -> str:
        return internal_key

    def internal_prefix(self, hf_name: str) -> str:
        return hf_name

    def to_hf(self, internal_key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, view of `tensor`): a stacked expert parameter expert by expert, each expert's
        sources in order (rows of dim 1 in equal parts); any other tensor as it is."""
        stacked = next((s for s in self.stacked if s.prefix_of(internal_key) is not None), None)
        if stacked is None:
            yield internal_key, tensor
            return
        prefix = stacked.prefix_of(internal_key)
        parts = len(stacked.sources)
        assert tensor.dim() == 3 and tensor.shape[1] % parts == 0, (internal_key, tuple(tensor.shape))
        rows = tensor.shape[1] // parts
        for expert in range(tensor.shape[0]):
            for i, source in enumerate(stacked.sources):
                view = tensor[expert] if parts == 1 else tensor[expert, i * rows : (i + 1) * rows]
                yield prefix + source.replace("*", str(expert)), view

    def hf_shapes(self, internal_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Expected HF key -> shape for a model whose internal tensors have these shapes."""
        return {hf_key: tuple(part.shape) for key, shape in internal_shapes.items()
                for hf_key, part in self.to_hf(key, torch.empty(shape, device="meta"))}
