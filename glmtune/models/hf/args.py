"""`HfArgs`: the architecture of a transformers causal LM, read from its config.json without torch.

What glmtune's commands need of an `hf` family model before anything is built (the layout
check's experts and layers, the FLOPs per token, the parameter count) are its shapes, read here
under the names the common transformers configurations use. The whole config.json is kept
(`config`): the spec builds the model from it through transformers' own configuration class.

Experts are `num_experts` (Qwen2/3-MoE), `num_local_experts` (Mixtral; transformers 5 writes
Qwen3-MoE's under this name) or `n_routed_experts` (GLM-4.5, DeepSeek); 0 for a dense model.
Which layers are MoE follows the keys those configs use: `mlp_only_layers` and
`decoder_sparse_step` (Qwen-MoE), `first_k_dense_replace` (GLM-4.5 / DeepSeek).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmtune.models.common.hf_config import read_hf_config

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# What the fused loss on the final hidden states does not apply: (key, the value that asks for
# nothing, what any other value asks); a config that asks for it is refused.
UNSUPPORTED_KEYS = (
    ("final_logit_softcapping", None, "soft-caps the logits"),
    ("logit_scale", 1.0, "scales the logits"),
    ("output_router_logits", False, "adds the router's auxiliary loss to the training loss"),
)


def _positive_int(config: dict[str, Any], key: str, source: str, default: Any = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _refusals(config: dict[str, Any], source: str) -> None:
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
            and architectures[0].endswith("ForCausalLM")):
        raise ValueError(f"{source}: architectures is {architectures!r}; the hf family trains a causal LM "
                         "(an architectures entry ending in ForCausalLM)")
    for key, neutral, what in UNSUPPORTED_KEYS:
        value = config.get(key, neutral)
        if value != neutral and value is not None:
            raise ValueError(f"{source}: {key}={value!r} {what}, which glmtune's loss on the final hidden "
                             "states does not do yet")


@dataclass(frozen=True)
class HfArgs:
    """Shapes of a transformers causal LM (module docstring) and its whole config.json."""

    model_type: str
    architecture: str  # config.json `architectures[0]`, transformers' class name
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    num_experts: int = 0  # routed experts per MoE layer; 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    moe_layers: tuple[int, ...] = ()  # indices of the MoE decoder layers
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_config_dict(cls, config: dict[str, Any], source: str) -> HfArgs:
        """The shapes of a parsed config.json (`source` names it in messages)."""
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise ValueError(f"{source}: no model_type (transformers' name of the architecture)")
        _refusals(config, source)
        layers = _positive_int(config, "num_hidden_layers", source)
        heads = _positive_int(config, "num_attention_heads", source)
        hidden = _positive_int(config, "hidden_size", source)
        experts = next((config[key] for key in EXPERT_KEYS if config.get(key)), 0)
        moe = {}
        if experts:
            experts = _positive_int({"experts": experts}, "experts", source)
            moe = {"num_experts": experts, "num_experts_per_tok": _positive_int(config, "num_experts_per_tok", source),
                       "moe_intermediate_size": _positive_int(config, "moe_intermediate_size", source),
                       "n_shared_experts": int(config.get("n_shared_experts") or 0),
                       "moe_layers": _moe_layers(config, layers)}
        return cls(model_type=model_type, architecture=config["architectures"][0],
                   vocab_size=_positive_int(config, "vocab_size", source), hidden_size=hidden,
                   num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=_positive_int(config, "num_key_value_heads", source, heads),
                   head_dim=_positive_int(config, "head_dim", source, hidden // heads),
                   intermediate_size=_positive_int(config, "intermediate_size", source),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), config=dict(config), **moe)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> HfArgs:
        """The shapes of an HF directory's config.json (or of the config.json `path` names)."""
        path = Path(path)
        source = str(path / "config.json" if path.is_dir() else path)
        return cls.from_config_dict(read_hf_config(path), source)

    def with_layers(self, num_layers: int) -> HfArgs:
        """The first `num_layers` decoder layers (preflight's small replicas)."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ValueError(f"num_layers={num_layers}: expected 1..{self.num_hidden_layers}")
        config = {**self.config, "num_hidden_layers": num_layers}
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:num_layers]
        return HfArgs.from_config_dict(config, "truncated config")

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as read (what the base fingerprint's config hash covers)."""
        return dict(self.config)

    def to_json(self) -> str:
        return json.dumps(self.config, indent=2, sort_keys=True)


def _moe_layers(config: dict[str, Any], layers: int) -> tuple[int, ...]:
    dense_only = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    return tuple(i for i in range(layers)
                 if i not in dense_only and (i + 1) % step == 0 and i >= first_dense)
