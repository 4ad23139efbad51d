"""`HF_MEMORY`: the `hf` family's answers to `glmtune plan`'s memory questions, from config.json's shapes.

What autograd keeps from a decoder layer's forward to its backward, tensor by tensor, as
transformers' modules save them (memory_layout.py: the layer; SDPA attention, the default;
glmtune's chunked loss on the final hidden states). Bytes per micro-batch of q = rows x seq
tokens; e is the compute dtype's size; N query heads and G key/value heads of h dims:

  RMSNorm(x: [q, w])   x in fp32 (4 q w: pow and mul read it; in fp32 it is x itself), rsqrt
                       (4 q), the normalized value in x's dtype (e q w, when the weight trains)
  attention            input norm; the projections' shared input (e q D); q/k norms over h when
                       the architecture has them; what SDPA saves: query (e q N h), key and value
                       (e q G h each; e q N h each under a packed-documents mask, which makes
                       transformers repeat them per query head, plus SDPA's copy of the mask in
                       the compute dtype, e rows seq^2), its output (e q N h, o_proj's input too)
                       and fp32 log-sum-exp (4 q N); GLM-4's post-attention norm, its per-layer
                       rotary tables (2 e q rot) and o_proj's own copy of the head-major output
  dense MLP            post-attention norm, its output (e q D), gate and up outputs, SiLU output
                       and product (e q I each); GLM-4's post-MLP norm
  MoE (K of E experts) post-attention norm and output; router: fp32 softmax (4 q E), top-k
                       indices (8 q K), and with `norm_topk_prob` the top-k values and their sums
                       (4 q K + 4 q); the grouped experts (transformers' `grouped_mm`): the
                       dispatched rows (e P D, P = q K), gate/up output (e P 2I), SiLU output and
                       product (e P I each), the experts' output (e P D), routing weights (e P),
                       three int64 orderings (24 P) and the int32 offsets; shared experts as a
                       dense MLP
  LoRA                 the family's default targets (every Linear of attention and MLP, the stacked
                       experts folded), `peft.adapter_compute: base`, dropout 0 (the bundled
                       recipes'; dropout's masks are not counted): each adapted Linear keeps
                       x @ A.T (e q r) and its scaled B factor (e r out), and in bf16 its A factor
                       cast from fp32 (e r in); folded experts keep their effective weights
                       (e E 3 I D) and, in bf16, their factors' casts; frozen norms and router keep
                       nothing for their weights, and the first layer's input norm nothing at all
                       (no gradient flows into a frozen embedding)

Rope's cos/sin are computed once and shared by every layer (`fixed`, 2 e q rot). Packed rows of
several documents take a boolean [rows, 1, seq, seq] mask (one per attention kind: full and
sliding), built once and shared by every layer; one-document rows keep the plain causal path
(none), unless a sliding window is shorter than the row.

Activation checkpointing (transformers' own, non-reentrant, per decoder layer): "full" keeps
each layer's input (e q D) and its backward recomputes the layer; "none" keeps everything; the
family refuses "selective" at config time. A layer's backward scratch is its MLP's gradients
(3 e q I dense, e P (D + I) MoE), or, once those saved tensors are freed, attention's dq, dk, dv
with the fp32 dq accumulator and softmax row sums, whichever is larger, plus the residual's
gradient (e q D). The loss (the last stage): final norm, hidden rows and their gradient (2 e q D),
one [2048, V] slice of logits in e + fp32.

The plan checks the layout against the model transformers builds (`check_layout`: memory_layout.py's
parameter count against the model's) and says so when they differ.

Checked (tests/plan/test_hf_memory.py): a layer's saved bytes against a `saved_tensors_hooks`
census of transformers' own forward on CPU (the tensors autograd keeps, each storage once), for
Llama, Qwen3, Qwen3-MoE and GLM-4 layers, fp32 and bf16, one document and packed documents, full
fine-tuning and LoRA, and under full checkpointing: equal to the byte.
"""

from __future__ import annotations

import re

from glmtune.models.common.memory_model import LayerMemory, MemoryModel, StepShape, StepTerms
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.memory_layout import (
    LAYOUTS,
    has_qk_norm,
    has_qkv_bias,
    layout_of,
    parameter_count,
    rotary_dim,
)

F32, I32, I64, BOOL = 4, 4, 8, 1
LOSS_SLICE = 2048  # tokens per slice of the chunked loss's logits (models/hf/model.py LOSS_CHUNK_SIZE)
DEFAULT_INITIALIZER_RANGE = 0.02  # transformers' configurations' default `initializer_range`
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def norm_saved(q: int, width: int, e: int, weight_trains: bool) -> int:
    return F32 * q * width + F32 * q + (e * q * width if weight_trains else 0)


def _masked(args: HfArgs, step: StepShape) -> bool:
    """Whether attention runs with a materialized mask (packed documents, or a window shorter than a row)."""
    window = args.config.get("sliding_window")
    return not step.one_document or (isinstance(window, int) and window < step.seq)


def _adapters(step: StepShape, linears: int, out_features: int, in_features: int) -> int:
    """LoRA on `linears` Linear layers of `out_features` outputs and `in_features` inputs together: each
    keeps x @ A.T [q, r] and its scaled B factor [out, r] (a new tensor), and, when the compute dtype is
    narrower than the fp32 adapters, its A cast to it [r, in] (the input's gradient reads it)."""
    e, r = step.compute_bytes, step.lora_rank
    return e * r * (linears * step.queries + out_features + (in_features if e < F32 else 0))


def attention_saved(args: HfArgs, step: StepShape, layer: int) -> int:
    q, e, d, h = step.queries, step.compute_bytes, args.hidden_size, args.head_dim
    n, g, r = args.num_attention_heads, args.num_key_value_heads, step.lora_rank
    norms = not r
    kv_heads = n if _masked(args, step) and g < n else g  # repeat_kv under a mask
    # Under LoRA nothing before the first layer trains: its input needs no gradient, its norm keeps nothing.
    saved = 0 if r and layer == 0 else norm_saved(q, d, e, norms)
    saved += e * q * d  # the projections' shared input
    if has_qk_norm(args):
        saved += norm_saved(q * n, h, e, norms) + norm_saved(q * g, h, e, norms)
    saved += e * q * h * (n + 2 * kv_heads) + e * q * n * h + F32 * q * n  # SDPA: q, k, v, output, lse
    if _masked(args, step):  # SDPA's own copy of the mask, in the query's dtype
        saved += e * step.rows * step.seq * step.seq
    if layout_of(args).interleaved_rope:  # its cos/sin per layer; SDPA's head-major output copied for o_proj
        saved += 2 * e * q * rotary_dim(args) + e * q * n * h
    if layout_of(args).sandwich_norms:
        saved += norm_saved(q, d, e, norms)
    if r:  # q, k, v's A casts, unless their input needs no gradient (the first layer's) and glmtune's
        # bias-free fused LoRA path (which keeps them regardless) does not apply
        qkv_a = 0 if layer == 0 and has_qkv_bias(args) else 3 * d
        saved += _adapters(step, 4, h * (n + 2 * g) + d, qkv_a + n * h)
    return saved


def _dense_mlp(args: HfArgs, step: StepShape, intermediate: int) -> int:
    """A gated MLP's gate and up outputs, SiLU output and product, and its adapters (its input aside)."""
    e, q, r = step.compute_bytes, step.queries, step.lora_rank
    d, linears = args.hidden_size, 2 if layout_of(args).fused_gate_up else 3
    return 4 * e * q * intermediate + (_adapters(step, linears, 2 * intermediate + d, (linears - 1) * d + intermediate)
                                       if r else 0)


def mlp_saved(args: HfArgs, step: StepShape, layer: int) -> int:
    q, e, d = step.queries, step.compute_bytes, args.hidden_size
    trains = not step.lora_rank  # norms and router (LoRA adapts neither)
    saved = norm_saved(q, d, e, trains) + (norm_saved(q, d, e, trains) if layout_of(args).sandwich_norms else 0)
    if layer not in args.moe_layers:
        return saved + e * q * d + _dense_mlp(args, step, args.intermediate_size)
    k, i, experts = args.num_experts_per_tok, args.moe_intermediate_size, args.num_experts
    pairs = q * k
    # the block's input, kept by the router's matmul for its weight's gradient, or by shared experts' adapters
    router_input = e * q * d if trains or args.n_shared_experts else 0
    router = F32 * q * experts + I64 * pairs + (F32 * (pairs + q) if args.config.get("norm_topk_prob") else 0)
    routed = e * pairs * (2 * d + 4 * i + 1) + 3 * I64 * pairs + I32 * experts  # + grouped_mm's offsets
    if step.lora_rank:  # adapters folded into the experts' weights: the effective weights are kept, and
        # the fp32 factors' casts to a narrower compute dtype (the fold's matmuls read them)
        routed += e * experts * 3 * i * d + (e * experts * step.lora_rank * (3 * i + 2 * d) if e < F32 else 0)
    shared = _dense_mlp(args, step, i * args.n_shared_experts) if args.n_shared_experts else 0
    return saved + router_input + router + routed + shared


def layer_saved(args: HfArgs, step: StepShape, layer: int) -> int:
    """Saved bytes of decoder layer `layer` without checkpointing (module docstring)."""
    return attention_saved(args, step, layer) + mlp_saved(args, step, layer)


def backward_scratch(args: HfArgs, step: StepShape, layer: int) -> int:
    """Peak bytes inside one layer's backward beyond its saved tensors (module docstring)."""
    q, e, d, h = step.queries, step.compute_bytes, args.hidden_size, args.head_dim
    n, g = args.num_attention_heads, args.num_key_value_heads
    kv_heads = n if _masked(args, step) and g < n else g
    attention = e * q * h * (n + 2 * kv_heads) + F32 * q * n * h + F32 * q * n
    if layer in args.moe_layers:
        mlp = e * q * args.num_experts_per_tok * (d + args.moe_intermediate_size)
    else:
        mlp = 3 * e * q * args.intermediate_size
    return max(mlp, attention - mlp_saved(args, step, layer)) + e * q * d


class HfMemoryModel(MemoryModel):
    """The hf family's memory model (module docstring)."""

    def layer(self, args: HfArgs, step: StepShape, index: int) -> LayerMemory:
        assert step.activation_checkpointing in ("none", "full"), "the hf family refuses it at config time"
        saved = layer_saved(args, step, index)
        if step.activation_checkpointing == "none":
            return LayerMemory(saved, 0, backward_scratch(args, step, index))
        layer_input = step.compute_bytes * step.queries * args.hidden_size
        return LayerMemory(layer_input, saved, backward_scratch(args, step, index))

    def step_terms(self, args: HfArgs, step: StepShape, layers: list[int], last: bool) -> StepTerms:
        e, q, d = step.compute_bytes, step.queries, args.hidden_size
        kinds = 2 if "sliding_attention" in (args.config.get("layer_types") or ()) else 1
        fixed = {"masks": kinds * BOOL * step.rows * step.seq * step.seq if _masked(args, step) else 0,
                 "rotary cos/sin": 2 * e * q * rotary_dim(args)}
        loss = {"final norm": norm_saved(q, d, e, not step.lora_rank),
                "loss: hidden rows and their gradient": 2 * e * q * d} if last else {}
        logits_slice = min(LOSS_SLICE, q) * args.vocab_size * (e + F32) if last else 0
        return StepTerms(fixed=fixed, loss=loss, forward_scratch=logits_slice, transients={},
                         head_elements=args.vocab_size * d)

    def unit_of(self, name: str) -> str:
        """`layer.{i}` for a decoder layer's parameters (parallelize.py wraps each), `embed` for the
        input embedding, `head` for the rest of the root (final norm, LM head)."""
        found = _LAYER.search(name)
        if found:
            return f"layer.{int(found.group(1))}"
        return "embed" if "embed_tokens" in name else "head"

    def routed_expert(self, name: str) -> bool:
        return ".experts." in name

    def check_layout(self, args: HfArgs, parameters: int) -> str | None:
        """The layout memory_layout.py reads for `model_type` counts transformers' model exactly; a count
        that differs means a layer it does not know (norms, biases, another MLP)."""
        counted = parameter_count(args)
        if counted == parameters:
            return None
        known = "" if args.model_type in LAYOUTS else " (not one the memory model knows: planned as a Llama layer)"
        return (f"model_type {args.model_type!r}{known}: the memory model's layer layout counts {counted:,} parameters, "
                f"transformers' model has {parameters:,}; the activations are an estimate")

    def weight_std(self, args: HfArgs) -> float:
        return float(args.config.get("initializer_range", DEFAULT_INITIALIZER_RANGE))


HF_MEMORY = HfMemoryModel()
