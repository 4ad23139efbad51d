"""The floor of one LoRA training step of the GLM-5 proxy on this GPU, from measured pieces.

A LoRA step needs, of the frozen base, only the forward and the input-gradient product of
each matmul (no weight gradients), attention's full forward and backward, the frozen
indexer's forward, the adapters' own small products (forward, input gradient and weight
gradient of A and B), and AdamW over the adapters. Each piece is timed alone at the
proxy's shapes (`triton.testing.do_bench`, bf16; the routed experts as one grouped GEMM
with the tokens spread evenly, top-8); attention is PyTorch's causal flash kernel at
the proxy's head dims. Their sum is the step time no implementation beats by much:
elementwise work (norms, rope, SwiGLU, routing, the loss) is left out.

    python benchmarks/lora_floor.py --seq 4096              # experts targeted (the default set)
    python benchmarks/lora_floor.py --seq 4096 --no-lora-experts

Prints one JSON line (ms per piece, floor ms, floor tok/s); appends it to $OUT/lora_floor.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BF16 = torch.bfloat16


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def mm_ms(m: int, k: int, n: int) -> float:
    a = torch.randn(m, k, device="cuda", dtype=BF16)
    b = torch.randn(k, n, device="cuda", dtype=BF16)
    return _bench(lambda: a @ b)


def grouped_ms(groups: int, rows: int, k: int, n: int) -> float:
    a = torch.randn(groups * rows, k, device="cuda", dtype=BF16)
    w = torch.randn(groups, k, n, device="cuda", dtype=BF16)
    offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
    return _bench(lambda: F.grouped_mm(a, w, offs=offs))


def adapter_ms(m: int, k: int, n: int, r: int, groups: int = 1) -> float:
    """A LoRA pair on an (m x k) @ (k x n) product: 2 forward products, 2 input-gradient
    products and 2 weight-gradient products, each about as costly as its forward."""
    if groups == 1:
        return 3 * (mm_ms(m, k, r) + mm_ms(m, r, n))
    return 3 * (grouped_ms(groups, m // groups, k, r) + grouped_ms(groups, m // groups, r, n))


def floor(cfg, seq: int, layers: int, dense: int, rank: int, experts_targeted: bool) -> dict:
    t, d = seq, cfg.hidden_size
    h, qk, v = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    q_rank, kv_rank, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    e, k, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    shared = inter * cfg.n_shared_experts
    attention_mms = [(t, d, q_rank), (t, q_rank, h * qk), (t, d, kv_rank + rope), (t, kv_rank, h * (qk - rope + v)),
                     (t, h * v, d)]
    dense_mms = [(t, d, cfg.intermediate_size), (t, d, cfg.intermediate_size), (t, cfg.intermediate_size, d)]
    shared_mms = [(t, d, shared), (t, d, shared), (t, shared, d)]
    rows = t * k  # routed (token, expert) pairs
    moe = layers - dense
    ms: dict[str, float] = {}
    # Frozen base: forward + input gradient (2 of the 3 products of a trained matmul).
    ms["attention_projections"] = 2 * layers * sum(mm_ms(*s) for s in attention_mms)
    ms["dense_mlp"] = 2 * dense * sum(mm_ms(*s) for s in dense_mms)
    ms["shared_experts"] = 2 * moe * sum(mm_ms(*s) for s in shared_mms)
    ms["routed_experts"] = 2 * moe * (grouped_ms(e, rows // e, d, 2 * inter) + grouped_ms(e, rows // e, inter, d))
    ms["lm_head"] = 2 * mm_ms(t, d, cfg.vocab_size)
    ms["indexer_forward"] = layers * (mm_ms(t, q_rank, cfg.index_n_heads * cfg.index_head_dim)
                                      + mm_ms(t, d, cfg.index_head_dim) + mm_ms(t, d, cfg.index_n_heads))
    q = torch.randn(1, h, t, qk, device="cuda", dtype=BF16, requires_grad=True)
    key = torch.randn(1, h, t, qk, device="cuda", dtype=BF16, requires_grad=True)
    val = torch.randn(1, h, t, v, device="cuda", dtype=BF16, requires_grad=True)
    grad = torch.randn(1, h, t, v, device="cuda", dtype=BF16)
    ms["attention_fwd_bwd"] = layers * _bench(
        lambda: F.scaled_dot_product_attention(q, key, val, is_causal=True).backward(grad))
    # The adapters' own products (the default targets).
    adapters = layers * sum(adapter_ms(m, kk, n, rank) for m, kk, n in attention_mms)
    adapters += dense * sum(adapter_ms(m, kk, n, rank) for m, kk, n in dense_mms)
    adapters += moe * sum(adapter_ms(m, kk, n, rank) for m, kk, n in shared_mms)
    trainable = layers * sum(rank * (kk + n) for _, kk, n in attention_mms)
    trainable += dense * sum(rank * (kk + n) for _, kk, n in dense_mms) + moe * sum(rank * (kk + n) for _, kk, n in shared_mms)
    if experts_targeted:  # gate and up share A: one pair on [2I, D], one on [D, I]
        adapters += moe * (adapter_ms(rows, d, 2 * inter, rank, e) + adapter_ms(rows, inter, d, rank, e))
        trainable += moe * e * rank * (d + 2 * inter + inter + d)
    ms["adapter_products"] = adapters
    params = torch.zeros(trainable, device="cuda")
    params.grad = torch.randn_like(params)
    opt = torch.optim.AdamW([params], lr=1e-4, fused=True)
    opt.step()
    ms["adamw_adapters"] = _bench(opt.step)
    total = sum(ms.values())
    return {"seq": seq, "layers": layers, "experts": e, "rank": rank, "experts_targeted": experts_targeted,
            "trainable": trainable, **{f"{name}_ms": round(v, 2) for name, v in ms.items()},
            "floor_ms": round(total, 2), "floor_tok_s": round(seq / total * 1e3, 1)}


def main(argv=None) -> int:
    from benchmarks.throughput import proxy_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-experts", action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args(argv)
    cfg = proxy_config(argparse.Namespace(tiny=False, layers=a.layers, dense=a.dense, experts=a.experts, seq=a.seq))
    line = floor(cfg, a.seq, a.layers, a.dense, a.lora_rank, a.lora_experts)
    line.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    print(json.dumps(line), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "lora_floor.jsonl"), "a") as fh:
            fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
