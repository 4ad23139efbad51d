"""GLM-5 model arguments: one dataclass, read from and written to HF `config.json`.

`Glm5Args` holds every field of `GlmMoeDsaConfig` (transformers >= 5.17) plus the
fields HF ignores but real checkpoints carry (`num_nextn_predict_layers`,
`rope_interleave`, ...), so a config read from a checkpoint is written back
unchanged. Derived fields (`indexer_types`, `mlp_layer_types`, `qk_head_dim`) are
computed exactly as transformers' `__post_init__` does.

Presets (`PRESETS`): real sizes `glm5`, `glm5.2`, `glm5.3` (meta-device use only) and
`tiny`, a GLM-5.2-shaped model small enough to train on a laptop CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmtune.models.common.hf_config import read_hf_config

# Fields that real config.json files carry but transformers ignores; kept verbatim.
_PASSTHROUGH_KEYS = (
    "rope_interleave",
    "indexer_rope_interleave",
    "index_share_for_mtp_iteration",
    "moe_router_dtype",
    "scoring_func",
    "topk_method",
    "ep_size",
    "moe_layer_freq",
    "pretraining_tp",
    "index_topk_freq",
    "index_skip_topk_offset",
    "index_topk_pattern",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "quantization_config",
    "use_cache",
    "output_router_logits",
    "layer_types",
    "bos_token_id",
)


@dataclass
class Glm5Args:
    """Architecture hyper-parameters of a GLM-5 family model (`model_type = "glm_moe_dsa"`)."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288  # dense MLP width (first_k_dense_replace layers)
    moe_intermediate_size: int = 2048  # one routed expert's width
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "default"})
    mlp_layer_types: list[str] | None = None  # "dense" | "sparse" per layer
    attention_bias: bool = False
    attention_dropout: float = 0.0
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    indexer_types: list[str] | None = None  # "full" | "shared" per layer
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers
    extra: dict[str, Any] = field(default_factory=dict)  # passthrough keys, written back on save

    def __post_init__(self) -> None:
        if self.indexer_types is None:
            self.indexer_types = derive_indexer_types(self.num_hidden_layers, self.extra)
        if self.mlp_layer_types is None:
            num_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * num_dense + ["sparse"] * (self.num_hidden_layers - num_dense)
        self.validate()

    # -- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    def validate(self) -> None:
        """Raise `ValueError` for configs the model cannot be built from."""
        for name in _POSITIVE:  # a width, a count to divide by or a top-k of 0 builds no model
            if getattr(self, name) < 1:
                raise ValueError(f"config: {name} is {getattr(self, name)}, must be at least 1")
        num_layers = self.num_hidden_layers
        for name in ("indexer_types", "mlp_layer_types"):
            value = getattr(self, name)
            if len(value) != num_layers:
                raise ValueError(f"config: {name} has {len(value)} entries, num_hidden_layers is {num_layers}")
        if bad := set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"config: indexer_types has unknown values {sorted(bad)} (expected full/shared)")
        if bad := set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"config: mlp_layer_types has unknown values {sorted(bad)} (expected dense/sparse)")
        if num_layers and self.indexer_types[0] != "full":
            raise ValueError("config: indexer_types[0] must be 'full': a shared layer needs an earlier full layer")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"config: n_routed_experts {self.n_routed_experts} not divisible by n_group {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"config: topk_group {self.topk_group} > n_group {self.n_group}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("config: num_experts_per_tok exceeds n_routed_experts")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("config: MLA needs num_key_value_heads == num_attention_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"config: hidden_act {self.hidden_act!r} unsupported (GLM-5 uses silu)")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"config: rope_parameters.rope_type {rope_type!r} unsupported (default, yarn)")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("config: qk_rope_head_dim must not exceed index_head_dim")

    def replace(self, **changes: Any) -> "Glm5Args":
        """A copy with `changes`; per-layer lists are re-derived when the layer count changes."""
        values = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if "num_hidden_layers" in changes or "first_k_dense_replace" in changes:
            values.setdefault("mlp_layer_types", None)
            if "mlp_layer_types" not in changes:
                values["mlp_layer_types"] = None
            if "indexer_types" not in changes:
                values["indexer_types"] = None
        values.update(changes)
        return Glm5Args(**values)

    # -- HF config.json I/O ----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "Glm5Args":
        """Build from a parsed HF `config.json` (GLM-5, 5.1, 5.2 or 5.3)."""
        hf = dict(hf)
        model_type = hf.get("model_type", "glm_moe_dsa")
        if model_type != "glm_moe_dsa":
            raise ValueError(f"config.json: model_type is {model_type!r}, expected 'glm_moe_dsa'")
        if "num_experts" in hf and "n_routed_experts" not in hf:
            hf["n_routed_experts"] = hf.pop("num_experts")
        if "num_local_experts" in hf and "n_routed_experts" not in hf:
            hf["n_routed_experts"] = hf.pop("num_local_experts")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        if rope is None:
            rope = {"rope_theta": hf.get("rope_theta", 10000.0), "rope_type": "default"}
        if not isinstance(rope, dict):
            raise ValueError(f"config: rope_parameters is {_shown(rope)}, not an object")
        rope = dict(rope)
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_parameters"}
        kwargs = {k: hf[k] for k in known if k in hf}
        for key, value in {**kwargs, "rope_parameters": rope}.items():
            problem = _field_problem(key, value)
            if problem:
                raise ValueError(f"config: {key} is {_shown(value)}, {problem}")
        kwargs["rope_parameters"] = rope
        extra = {k: hf[k] for k in _PASSTHROUGH_KEYS if k in hf}
        ignored = {"architectures", "model_type", "head_dim", "qk_head_dim", "rope_theta", "rope_scaling",
                   "num_experts", "num_local_experts", "mlp_bias", "auto_map"}
        for key in hf:
            if key not in known and key not in extra and key not in ignored and key != "rope_parameters":
                extra[key] = hf[key]  # unknown future fields survive a load/save round trip
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "Glm5Args":
        """Read `config.json` from a file or a checkpoint directory; a config the model cannot be
        built from is a ValueError naming the file."""
        config = read_hf_config(path)
        try:
            return cls.from_hf_dict(config)
        except ValueError as exc:
            file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
            raise ValueError(f"{file}: {str(exc).removeprefix('config: ').removeprefix('config.json: ')}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content that `transformers.AutoConfig` reads back to the same model."""
        out: dict[str, Any] = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}
        for f in dataclasses.fields(self):
            if f.name != "extra":
                out[f.name] = copy.deepcopy(getattr(self, f.name))
        out["head_dim"] = self.qk_rope_head_dim
        out["qk_head_dim"] = self.qk_head_dim
        for key, value in self.extra.items():
            out.setdefault(key, copy.deepcopy(value))
        return out


# A config.json holds what its writer put there: each field is checked for the kind the model reads
# (the dataclass default's), sizes are non-negative, and the layer count is bounded (per-layer lists).
MAX_LAYERS = 10_000
# Sizes that must be at least 1 (n_shared_experts, first_k_dense_replace, num_nextn_predict_layers and
# num_hidden_layers may be 0: no shared expert, no dense layer, no MTP layer, embeddings and head only).
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
             "num_attention_heads", "num_key_value_heads", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
             "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
             "max_position_embeddings", "index_topk", "index_head_dim", "index_n_heads")
_NULLABLE_INT = {"pad_token_id"}
_LAYER_KINDS = {"mlp_layer_types", "indexer_types"}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be Glm5Args field `name` read from a config.json (None when it can)."""
    if name in _LAYER_KINDS:
        ok = value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return None if ok else "not a list of layer kinds"
    if name in _NULLABLE_INT or name == "eos_token_id":
        ok = value is None or _is_int(value) or (name == "eos_token_id" and isinstance(value, list)
                                                  and all(_is_int(v) for v in value))
        return None if ok else "not a token id"
    if name == "rope_parameters":
        theta = value.get("rope_theta")
        ok = isinstance(value.get("rope_type"), str) and isinstance(theta, (int, float)) and not isinstance(
            theta, bool) and math.isfinite(theta)
        return None if ok else "not a rope_type name and a finite rope_theta"
    default = _DEFAULTS[name]
    if isinstance(default, bool) or isinstance(default, str):
        return None if type(value) is type(default) else f"not a {type(default).__name__}"
    if isinstance(default, int):
        if not _is_int(value) or value < 0:
            return "not a non-negative integer"
        return f"more than {MAX_LAYERS:,} layers" if name == "num_hidden_layers" and value > MAX_LAYERS else None
    if isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "not a finite number"
    raise AssertionError(f"no type rule for Glm5Args.{name}")


def derive_indexer_types(num_layers: int, extra: dict[str, Any]) -> list[str]:
    """Per-layer "full"/"shared" indexer kinds, derived as transformers' config does."""
    pattern = extra.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            try:
                return [{"F": "full", "S": "shared"}[c] for c in pattern]
            except KeyError as exc:
                raise ValueError(f"config: index_topk_pattern has {exc.args[0]!r}; use F or S") from None
        if not isinstance(pattern, list):
            raise ValueError(f"config: index_topk_pattern is {_shown(pattern)}, not a string of F and S or a list")
        return list(pattern)
    freq, offset = extra.get("index_topk_freq", 1) or 1, extra.get("index_skip_topk_offset", 2)
    if not (_is_int(freq) and _is_int(offset)):
        raise ValueError(f"config: index_topk_freq {_shown(freq)} and index_skip_topk_offset {_shown(offset)} must "
                         "be integers")
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Glm5Args) if f.default is not dataclasses.MISSING}


def _glm5() -> Glm5Args:
    return Glm5Args(
        pad_token_id=154820,
        eos_token_id=[154820, 154827, 154829],
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        num_nextn_predict_layers=1,
        extra={"rope_interleave": True, "indexer_rope_interleave": True, "scoring_func": "sigmoid",
               "topk_method": "noaux_tc"},
    )


def _glm52() -> Glm5Args:
    extra = {"rope_interleave": True, "indexer_rope_interleave": True, "scoring_func": "sigmoid",
             "topk_method": "noaux_tc", "index_topk_freq": 4, "index_skip_topk_offset": 3,
             "index_share_for_mtp_iteration": True, "moe_router_dtype": "float32"}
    return Glm5Args(
        pad_token_id=154820,
        eos_token_id=[154820, 154827, 154829],
        rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"},
        max_position_embeddings=1048576,
        num_nextn_predict_layers=1,
        extra=extra,
    )


def _tiny() -> Glm5Args:
    # GLM-5.2-shaped: 2 dense + 2 MoE layers, shared-indexer layers, grouped routing.
    # index_topk (256) is below the 512-token rows of the default recipe, so the
    # sparse mask is exercised, yet above a typical ticket conversation (~220
    # tokens): a random-init model's frozen indexer would otherwise pick keys at
    # random and hide the ticket from the answer. Vocab matches the bundled tiny
    # tokenizer (4096 ids).
    return Glm5Args(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=32,
        q_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=256,
        index_head_dim=32,
        index_n_heads=4,
        first_k_dense_replace=2,
        max_position_embeddings=4096,
        pad_token_id=4064,
        eos_token_id=[4064, 4071, 4073],
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        indexer_types=["full", "shared", "full", "shared"],
        num_nextn_predict_layers=1,
    )


PRESETS = {
    "glm5": _glm5,
    "glm5.1": _glm5,
    "glm5.2": _glm52,
    "glm5.3": _glm52,
    "tiny": _tiny,
}


def get_preset(name: str) -> Glm5Args:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]()


def covering_layers(args: Glm5Args) -> int:
    """The fewest leading layers that hold every kind of layer the model has: a dense MLP and a
    MoE layer, a full and a shared indexer (GLM-5: 3 dense layers, then MoE: 4)."""
    firsts = [types.index(kind) for types in (args.mlp_layer_types, args.indexer_types) for kind in set(types)]
    return max(firsts) + 1


def truncated_args(args: Glm5Args, num_layers: int) -> Glm5Args:
    """`args` with its first `num_layers` decoder layers and no MTP layer."""
    extra = dict(args.extra)
    for key in ("index_topk_pattern", "layer_types"):  # per-layer passthrough lists
        if isinstance(extra.get(key), (str, list)):
            extra[key] = extra[key][:num_layers]
    return args.replace(num_hidden_layers=num_layers, mlp_layer_types=args.mlp_layer_types[:num_layers],
                        indexer_types=args.indexer_types[:num_layers], num_nextn_predict_layers=0, extra=extra)
