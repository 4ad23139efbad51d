"""Activation memory of one GLM-5 decoder layer, per micro-batch, from the model's shapes.

The GLM-5 family's formulas (MLA, the DSA indexer, MoE and dense MLP layers) behind its memory
model (memory_model.py, `glmtune plan`'s questions in models/common/memory_model.py); `mb` is
the rank's `StepShape`, `args` the family's `Glm5Args`.

What autograd keeps from forward to backward, tensor by tensor, as glmtune's eager GPU path
saves it (bf16 compute, the Triton attention and fused indexer, grouped GEMMs, the Triton
MoE combine, the fused loss). Bytes per micro-batch of `q` queries and `k` keys on this rank
(q = k = rows x seq without context parallelism; q = rows x seq / cp and k = rows x seq
under it). e is the compute dtype's size (2 for bf16).

  RMSNorm(x: [q, w])      fp32 copy of x (4 q w; pow and mul need it), the bf16 normalized
                          value (2 q w, only when the weight trains), rsqrt (4 q); with
                          model.norm_backend: triton, x itself (2 q w) and 1/rms (4 q)
  MLA                     input norm; its output (2 q D, read by q_a and kv_a); q_a norm and
                          output (q_b's input); kv_a norm and output (kv_b's input); the
                          roped query and the key, [N, qk] each (q and k); the kv_b output
                          whose value half attention reads (k N (nope + v)); attention
                          outputs (q N v) and fp32 log-sum-exp (4 q N); o_proj's input (q N v)
  DSA                     the selected-key mask, bool [q, k], per full-indexer layer when a
                          query has more allowed keys than top-k; the frozen indexer itself
                          runs without a graph
  MoE (K of E experts)    post-attention norm and output; the router's fp32 input (4 q D, when
                          the router trains) and sigmoid scores (4 q E); the dispatched rows
                          (q K D), the gate/up output (q K 2I), SiLU output and product (q K I
                          each), the experts' output (q K D); routing indices (int64) and
                          weights; the shared experts' four [q, Is] values
  dense MLP               post-attention norm and output, gate/up/SiLU/product [q, I] each

Activation checkpointing: "full" keeps each layer's input (e q D) and recomputes the rest in
the layer's backward, where it is alive again; "selective" also keeps the top-k mask, the
attention outputs and log-sum-exp, and every matmul output whose reduction dim is at least
`parallel.ac_keep_matmul_min_k`.

`backward_transient` is what one layer's backward allocates beyond its saved tensors: the
activation gradients alive at once, and the attention backward's bf16 dS and P buffers
(one [rows, N, tail queries, k] each, materialized only when each fits
`model.attention_score_buffer_mib`).
"""

from __future__ import annotations

from dataclasses import dataclass

from glmtune.models.common.memory_model import StepShape
from glmtune.models.glm5.args import Glm5Args

F32, I64, BOOL = 4, 8, 1


def sparse_needed(args: Glm5Args, mb: StepShape) -> bool:
    """Whether a query can have more allowed keys than the indexer's top-k."""
    return mb.seq > args.index_topk


@dataclass(frozen=True)
class Trainability:
    """Which of a layer's weights receive gradients (they decide what autograd saves)."""

    norms: bool = True
    router: bool = True
    lora_rank: int = 0  # adapters on the projections (0: none); the base inputs are saved either way

    @classmethod
    def of(cls, lora_rank: int) -> Trainability:
        # LoRA trains adapters only (the schema's targets never include norms or the router).
        return cls(norms=not lora_rank, router=not lora_rank, lora_rank=lora_rank)


def norm_saved(q: int, width: int, e: int, weight_trains: bool, fused: bool = False) -> int:
    if fused:  # model.norm_backend: triton keeps its input and 1/rms, whether the weight trains or not
        return e * q * width + F32 * q
    return F32 * q * width + F32 * q + (e * q * width if weight_trains else 0)


def attention_saved(args: Glm5Args, mb: StepShape, layer: int, e: int, train: Trainability) -> dict[str, int]:
    q, k, n = mb.queries, mb.keys, args.num_attention_heads
    d, rq, r = args.hidden_size, args.q_lora_rank, args.kv_lora_rank
    qk, nope, v = args.qk_head_dim, args.qk_nope_head_dim, args.v_head_dim
    out = {
        "norms": sum(norm_saved(q, width, e, train.norms, mb.fused_norms) for width in (d, rq, r)),
        "projection inputs": e * q * (d + rq) + e * k * r,
        "query, key": e * q * n * qk + e * k * n * qk,
        "kv_b output (values)": e * k * n * (nope + v),
        "attention outputs": 2 * e * q * n * v + F32 * q * n,
    }
    if mb.absorbed_attention:
        out.pop("kv_b output (values)")
        out.update(absorbed_saved(args, mb, e))
    if args.indexer_types[layer] == "full" and sparse_needed(args, mb):
        out["top-k mask"] = BOOL * q * k
    if train.lora_rank:  # each of the five adapted projections keeps x @ A.T [tokens, rank]
        out["adapter products"] = e * train.lora_rank * (3 * q + 2 * k)
    return out


def absorbed_saved(args: Glm5Args, mb: StepShape, e: int) -> dict[str, int]:
    """What the absorbed form keeps instead of the expanded keys and values: no kv_b input (kv_b
    never runs over the keys); the roped query (q_nope W_uk's input), the absorbed query [q, N, C]
    and the compressed keys [k, C] (the attention op's inputs), each query's key indices and their
    validity [q, top-k]; the output latent [q, N, R] (the op's output, W_uv's input), the fp32 lse
    and o_proj's input [q, N, V]."""
    q, k, n = mb.queries, mb.keys, args.num_attention_heads
    width = args.kv_lora_rank + args.qk_rope_head_dim
    return {"projection inputs": e * q * (args.hidden_size + args.q_lora_rank),
            "query, key": e * q * n * (args.qk_head_dim + width) + e * k * width,
            "selected key indices": (I64 + BOOL) * q * min(args.index_topk, k),
            "attention outputs": e * q * n * (args.kv_lora_rank + args.v_head_dim) + F32 * q * n}


def mlp_saved(args: Glm5Args, mb: StepShape, layer: int, e: int, train: Trainability) -> dict[str, int]:
    q, d = mb.queries, args.hidden_size
    base = {"norms": norm_saved(q, d, e, train.norms, mb.fused_norms), "mlp input": e * q * d}
    adapters = 3 * e * q * train.lora_rank  # gate, up, down of the dense MLP or shared experts
    if args.mlp_layer_types[layer] != "sparse":
        return {**base, "dense MLP": 4 * e * q * args.intermediate_size + adapters}
    kk, i, experts = args.num_experts_per_tok, args.moe_intermediate_size, args.n_routed_experts
    shared = args.moe_intermediate_size * args.n_shared_experts
    pairs = q * kk
    router = F32 * q * experts + (F32 * q * d if train.router else 0)
    routing = 3 * I64 * pairs + 2 * F32 * pairs + F32 * q  # order/inverse/top-k ids, weights
    return {**base, "router": router + routing,
            "routed experts": e * pairs * (2 * d + 4 * i + 2 * train.lora_rank),
            "shared experts": 4 * e * q * shared + adapters}


def layer_saved(args: Glm5Args, mb: StepShape, layer: int, e: int, train: Trainability) -> dict[str, int]:
    """Saved bytes of decoder layer `layer` without checkpointing, by component."""
    parts = {f"attention: {k}": v for k, v in attention_saved(args, mb, layer, e, train).items()}
    parts.update({f"mlp: {k}": v for k, v in mlp_saved(args, mb, layer, e, train).items()})
    return parts


def selective_kept(args: Glm5Args, mb: StepShape, layer: int, e: int, min_k: int) -> int:
    """What selective checkpointing keeps of a layer: its input, the top-k mask, the attention
    outputs and log-sum-exp, and the outputs of matmuls reducing over >= min_k."""
    q, k, d, n = mb.queries, mb.keys, args.hidden_size, args.num_attention_heads
    kept = e * q * d + e * q * n * args.v_head_dim + F32 * q * n
    if mb.absorbed_attention:  # the op's output latent instead of the attention output, and the key indices
        kept += e * q * n * (args.kv_lora_rank - args.v_head_dim) + (I64 + BOOL) * q * min(args.index_topk, k)
    if args.indexer_types[layer] == "full" and sparse_needed(args, mb):
        kept += BOOL * q * k
    # (reduction dim, output bytes) of each matmul of the layer
    matmuls = [(d, e * q * args.q_lora_rank), (d, e * k * (args.kv_lora_rank + args.qk_rope_head_dim)),
               (args.q_lora_rank, e * q * n * args.qk_head_dim),
               (n * args.v_head_dim, e * q * d)]
    if not mb.absorbed_attention:  # the absorbed form never runs kv_b over the keys
        matmuls.append((args.kv_lora_rank, e * k * n * (args.qk_nope_head_dim + args.v_head_dim)))
    if args.mlp_layer_types[layer] == "sparse":
        pairs, i = q * args.num_experts_per_tok, args.moe_intermediate_size
        shared = i * args.n_shared_experts
        matmuls += [(d, F32 * q * args.n_routed_experts), (d, e * pairs * 2 * i), (i, e * pairs * d),
                    (d, 2 * e * q * shared), (shared, e * q * d)]
    else:
        matmuls += [(d, 2 * e * q * args.intermediate_size), (args.intermediate_size, e * q * d)]
    return kept + sum(nbytes for width, nbytes in matmuls if width >= min_k)


def backward_transient(args: Glm5Args, mb: StepShape, layer: int, e: int, train: Trainability,
                       score_buffer_bytes: int, moe_buffers: int = 0) -> int:
    """Peak bytes inside one layer's backward beyond the layer's saved tensors (module docstring).

    The MLP's backward runs first, with every saved tensor still alive: the MoE's experts'
    output gradient and then their SiLU input's (once the output and the product are freed,
    the gate/up and dispatched-row gradients take their place). The attention's backward
    runs once the MLP's saved tensors are freed: dq, dk, dv, the kv_b output's gradient, and
    the dS and P buffers. `moe_buffers` (expert parallelism's all-to-all send buffer) are held in
    the MoE's part only."""
    q, k, n, d = mb.queries, mb.keys, args.num_attention_heads, args.hidden_size
    attention = e * (q + 2 * k) * n * args.qk_head_dim + e * k * n * (args.qk_nope_head_dim + args.v_head_dim)
    if mb.absorbed_attention:
        attention = absorbed_backward_transient(args, mb, e, score_buffer_bytes)
    elif sparse_needed(args, mb):
        tail = (mb.seq - args.index_topk if mb.one_document and mb.cp == 1 else mb.seq // mb.cp) * mb.rows
        buffer = e * n * tail * mb.seq
        if 0 < buffer <= score_buffer_bytes:
            attention += 2 * buffer
    if args.mlp_layer_types[layer] == "sparse":
        mlp = e * q * args.num_experts_per_tok * (d + args.moe_intermediate_size) + moe_buffers
    else:
        mlp = 3 * e * q * args.intermediate_size
    mlp_saved_bytes = sum(mlp_saved(args, mb, layer, e, train).values())
    return max(mlp, attention - mlp_saved_bytes) + F32 * q * d  # + the residual's gradient


def absorbed_backward_transient(args: Glm5Args, mb: StepShape, e: int, score_buffer_bytes: int) -> int:
    """The absorbed attention's backward: the gradients of the absorbed and the roped query, the
    compressed keys' fp32 sum and its rounding, the fp32 delta, and the P and dS buffers the fused
    kernels fill (each [queries of a chunk, N, top-k], at most `score_buffer_bytes`, at least one
    query; the pure-torch form's blocks stay within the same 2 GiB at the default bound)."""
    q, k, n = mb.queries, mb.keys, args.num_attention_heads
    width, slots = args.kv_lora_rank + args.qk_rope_head_dim, min(args.index_topk, mb.keys)
    per_query = e * n * slots
    buffers = 2 * per_query * min(q, max(1, score_buffer_bytes // per_query))
    return e * q * n * (width + args.qk_head_dim) + (F32 + e) * k * width + F32 * q * n + buffers


def indexer_transient(args: Glm5Args, mb: StepShape, e: int, chunk_bytes: int = 256 * 2**20) -> int:
    """The indexer's forward scratch: queries and keys, and one chunk of fp32 scores + top-k."""
    if not sparse_needed(args, mb):
        return 0
    q, k = mb.queries, mb.keys
    projections = e * q * args.index_n_heads * args.index_head_dim + e * k * args.index_head_dim
    scores = min(chunk_bytes, F32 * q * k)  # one chunk of queries' fp32 scores (the fused kernel: one head)
    return projections + 2 * scores + BOOL * q * k
