"""An `hf` family decoder layer's layout and the model's parameters, from config.json alone (no torch).

transformers' causal LMs share one decoder layer: an RMSNorm, attention with q/k/v/o projections
over `num_attention_heads` query heads and `num_key_value_heads` key/value heads of `head_dim`
(grouped-query attention), an RMSNorm, a gated SiLU MLP (gate, up, down) or a MoE block (a router
[E, D], E stacked experts, optionally shared experts), residual adds; a final RMSNorm and an LM
head, tied to the embedding or not. What differs between architectures is read from `model_type`
(`LAYOUTS`; their modeling files, transformers 5.x):

  qk_norm         per-head RMSNorm of width head_dim on queries and keys (Qwen3, Qwen3-MoE; GLM-4.5
                  when `use_qk_norm`)
  sandwich_norms  two more hidden-width norms, after attention and after the MLP (GLM-4)
  o_bias          o_proj takes `attention_bias` as q/k/v do (Llama, Qwen3); Qwen2 always has q/k/v
                  biases (`qkv_bias`) and none on o_proj
  interleaved_rope  GLM-4's rope: each layer expands the rotary tables again (interleaved, partial
                  rotary), so autograd keeps a copy per layer, and concatenates the rotated and
                  passed halves, so queries are head-major and attention's output is copied once
                  more for o_proj
  fused_gate_up   one Linear for the MLP's gate and up projections (GLM-4): one LoRA adapter for both

Biases: q/k/v (and o when `o_bias`) carry `attention_bias`, the dense MLP's three projections
`mlp_bias`. A `model_type` not in `LAYOUTS` is taken as Llama's layer without o_proj bias (two
norms, no q/k norm): its parameter count may then miss a few vectors per layer, and the memory
model (memory_model.py) the saved tensors of norms it does not know.

`parameter_counts` is every parameter of transformers' model by the spec's groups (norms and
biases included): the plan checks the layout against the model transformers builds with it (the
memory model's `check_layout`: a count that differs is a layer it does not know); tests/plan check it
equals transformers' own model exactly for Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, GLM-4 and
GLM-4.5 (glm4_moe) configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmtune.models.hf.args import HfArgs


@dataclass(frozen=True)
class Layout:
    """What a `model_type`'s decoder layer has beyond Llama's (module docstring)."""

    qk_norm: bool | str = False  # True, or the config.json key that switches it on
    sandwich_norms: bool = False
    o_bias: bool = False  # o_proj carries `attention_bias`
    qkv_bias: bool = False  # q/k/v always carry a bias, whatever `attention_bias` says
    interleaved_rope: bool = False  # GLM-4's rope: cos/sin re-expanded per layer, rotated half concatenated
    fused_gate_up: bool = False  # the MLP's gate and up projections are one Linear (GLM-4's gate_up_proj)


LAYOUTS = {
    "llama": Layout(o_bias=True),
    "mistral": Layout(),
    "qwen2": Layout(qkv_bias=True),
    "qwen3": Layout(qk_norm=True, o_bias=True),
    "qwen3_moe": Layout(qk_norm=True, o_bias=True),
    "glm4": Layout(sandwich_norms=True, interleaved_rope=True, fused_gate_up=True),
    "glm4_moe": Layout(qk_norm="use_qk_norm"),
}
DEFAULT_LAYOUT = Layout()


def layout_of(args: HfArgs) -> Layout:
    return LAYOUTS.get(args.model_type, DEFAULT_LAYOUT)


def has_qk_norm(args: HfArgs) -> bool:
    flag = layout_of(args).qk_norm
    return bool(args.config.get(flag)) if isinstance(flag, str) else flag


def rotary_dim(args: HfArgs) -> int:
    """The head dims rope turns (`partial_rotary_factor` of head_dim, top level or in `rope_parameters`)."""
    rope = args.config.get("rope_parameters") or {}
    factor = args.config.get("partial_rotary_factor") or (rope.get("partial_rotary_factor") if isinstance(rope, dict)
                                                           else None) or 1.0
    return int(args.head_dim * factor)


def norms_per_layer(args: HfArgs) -> int:
    """Hidden-width RMSNorms in one decoder layer."""
    return 4 if layout_of(args).sandwich_norms else 2


def has_qkv_bias(args: HfArgs) -> bool:
    return bool(args.config.get("attention_bias")) or layout_of(args).qkv_bias


def _attention(args: HfArgs) -> int:
    d, hd, n, kv = args.hidden_size, args.head_dim, args.num_attention_heads, args.num_key_value_heads
    layout, bias = layout_of(args), bool(args.config.get("attention_bias"))
    weights = d * hd * (2 * n + 2 * kv)
    qkv_bias = hd * (n + 2 * kv) if has_qkv_bias(args) else 0
    o_bias = d if bias and layout.o_bias else 0
    return weights + qkv_bias + o_bias


def _dense_mlp(args: HfArgs, intermediate: int) -> int:
    bias = 2 * intermediate + args.hidden_size if args.config.get("mlp_bias") else 0
    return 3 * args.hidden_size * intermediate + bias


def layer_parameters(args: HfArgs, layer: int) -> dict[str, int]:
    """Decoder layer `layer`'s parameters by group (the spec's `param_group`)."""
    d = args.hidden_size
    norms = norms_per_layer(args) * d + (2 * args.head_dim if has_qk_norm(args) else 0)
    out = {"attention": _attention(args), "norm": norms}
    if layer in args.moe_layers:
        shared = args.moe_intermediate_size * args.n_shared_experts
        out.update({"router": args.num_experts * d, "experts": args.num_experts * 3 * d * args.moe_intermediate_size,
                    "mlp": _dense_mlp(args, shared) if shared else 0})
    else:
        out["mlp"] = _dense_mlp(args, args.intermediate_size)
    return out


def parameter_counts(args: HfArgs) -> dict[str, int]:
    """Every parameter of the model by group: embedding, layers, final norm, LM head unless tied."""
    d, v = args.hidden_size, args.vocab_size
    counts = {"embeddings": v * d, "norm": d, "head": 0 if args.tie_word_embeddings else v * d}
    for layer in range(args.num_hidden_layers):
        for group, n in layer_parameters(args, layer).items():
            counts[group] = counts.get(group, 0) + n
    return counts


def parameter_count(args: HfArgs) -> int:
    return sum(parameter_counts(args).values())
