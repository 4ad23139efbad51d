"""GPU check of the DSA fast paths against their references, at GLM-5 widths, with timings.

    python benchmarks/dsa_kernels.py --seq 4096 16384

Attention: 64 heads, qk 192+64, v 256, a top-2048 mask over a one-document row. The
"gemm" backend (masked blocks as explicit GEMMs) and the "flex" one (FlexAttention
block-sparse tail) against "sdpa" (causal prefix + boolean-masked blocks through cuDNN):
outputs and q/k/v gradients, fwd+bwd time.
Indexer: 32 heads x 128, bf16 q/k; the fused Triton scores against the chunked
fp32 reference: score error, selections equal up to ties within the score error.
Mask cost: the same SDPA calls with the boolean mask, a bias, and no mask at all.
Absorbed (`--only absorbed`): one MLA layer's attention, kv_b included (q [B, N, S, 256], the
normed latent and roped k_rot of the keys in; o_proj's input out), fwd+bwd, through the
"sdpa", "triton", "absorbed" and "absorbed_triton" backends, for `seq` one-document queries and for a cp-8
rank's `seq` queries of an 8 x seq row (head_tail ranks 0 and 1): ms, the model's TFLOP/s
(top-k attention + kv_b per local token, as glmtune/models/glm5/flops.py counts them) and
the output / gradient differences against "sdpa".
Results print as JSON lines and append to $OUT/dsa_kernels.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.models.common.sequence_shard import SequenceShard  # noqa: E402
from glmtune.models.glm5.args import Glm5Args  # noqa: E402
from glmtune.models.glm5.attention import MLAttention, sdpa_attention  # noqa: E402
from glmtune.models.glm5.flex_attention import flex_sparse_attention  # noqa: E402
from glmtune.models.glm5.gemm_attention import gemm_masked_attention  # noqa: E402
from glmtune.models.glm5.indexer import Indexer, dsa_topk_mask  # noqa: E402
from glmtune.models.glm5.triton_attention import triton_masked_attention  # noqa: E402


def bench_ms(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def random_topk_mask(seq, topk, gen):
    """Causal one-document mask; queries past topk keep topk random keys of their past."""
    scores = torch.rand(seq, seq, generator=gen, device="cuda").tril()
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril(), -1.0)
    top = scores.topk(topk, dim=-1).indices
    allowed = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    return (allowed & torch.zeros_like(allowed).scatter(-1, top, True)).unsqueeze(0)


FLEX_VARIANTS = {"m128n64s2": {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2},
                 "m64n64s1": {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}}


def check_attention(seq, topk=2048, heads=64, flex=True):
    gen = torch.Generator(device="cuda").manual_seed(0)
    mask = random_topk_mask(seq, topk, gen)
    shape = (1, heads, seq)
    # GLM-5's qk head dim: 192 nope + 64 rope.
    q = torch.randn(*shape, 256, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(*shape, 256, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(*shape, 256, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad_out = torch.randn(*shape, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 256**-0.5
    prefix = min(topk, seq)
    results = {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import glmtune.models.glm5.flex_attention as flex_module

    def sdpa_with(backend):
        def run():
            with sdpa_kernel([backend]):
                return sdpa_attention(q, k, v, mask, scale, prefix)
        return run

    triton_kernels_only = functools.partial(triton_masked_attention, score_buffer_bytes=0)
    triton_materialized = functools.partial(triton_masked_attention, score_buffer_bytes=1 << 40)
    variants = [("sdpa", lambda: sdpa_attention(q, k, v, mask, scale, prefix), None),
                ("sdpa_cudnn", sdpa_with(SDPBackend.CUDNN_ATTENTION), None),
                ("sdpa_efficient", sdpa_with(SDPBackend.EFFICIENT_ATTENTION), None),
                ("gemm", lambda: sdpa_attention(q, k, v, mask, scale, prefix, masked=gemm_masked_attention), None),
                # the Triton backward with its dQ and dV kernels, and with dS and P materialized
                ("triton", lambda: sdpa_attention(q, k, v, mask, scale, prefix, seq,
                                                  masked=triton_kernels_only), None),
                ("triton_materialized", lambda: sdpa_attention(q, k, v, mask, scale, prefix, seq,
                                                               masked=triton_materialized), None),
                ("causal_flash_no_topk", lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale), None)]
    variants += [(f"flex_{key}", lambda: flex_sparse_attention(q, k, v, mask, scale, prefix), options)
                 for key, options in FLEX_VARIANTS.items() if flex]
    for name, fn, options in variants:
        flex_module.KERNEL_OPTIONS = options
        flex_module._compiled_flex.cache_clear()
        torch._dynamo.reset()

        def step():
            o = fn()
            torch.autograd.grad(o, (q, k, v), grad_out)

        try:
            out = fn()
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            results[name] = (out.float(), [g.float() for g in grads])
            results[name + "_ms"] = bench_ms(step)
        except Exception as exc:  # a tile config this GPU cannot hold: report, try the next
            results.pop(name, None)
            results[name + "_error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
    ref_out, ref_grads = results["sdpa"]
    line = {"check": "attention", "seq": seq, "sdpa_fwd_bwd_ms": round(results["sdpa_ms"], 2)}
    flex_names = [f"flex_{k}" for k in FLEX_VARIANTS] if flex else []
    for name in ["sdpa_cudnn", "sdpa_efficient", "gemm", "triton", "triton_materialized",
                 "causal_flash_no_topk"] + flex_names:
        if name not in results:
            line[name] = results[name + "_error"]
            continue
        out, grads = results[name]
        rel = [round(float((g - r).norm() / r.norm()), 5) for g, r in zip(grads, ref_grads)]
        line[name] = {"fwd_bwd_ms": round(results[name + "_ms"], 2), "grad_rel_diff_qkv": rel,
                      "out_max_abs_diff": float((out - ref_out).abs().max())}
    return line


def check_mask_cost(seq, topk=2048, heads=64):
    """What the top-k mask itself costs: the last masked block (1024 queries x all keys) with
    the boolean mask, an additive bias (broadcast or per head) and no mask, fwd+bwd; then a
    whole layer by query block."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    mask = random_topk_mask(seq, topk, gen)
    q, k, v = (torch.randn(1, heads, seq, 256, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    grad = torch.randn(1, heads, seq, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    start = seq - 1024
    qs, block = q[:, :, start:], mask[:, start:, :].unsqueeze(1)
    bias = torch.zeros(block.shape, dtype=torch.bfloat16, device="cuda").masked_fill(~block, float("-inf"))
    per_head = bias.expand(-1, heads, -1, -1).contiguous()

    def fwd_bwd(fn):
        def step():
            out = fn()
            torch.autograd.grad(out, (q, k, v), grad[:, :, -out.shape[2]:])
        return round(bench_ms(step), 3)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    line = {"check": "mask_cost", "seq": seq,
            "block_bool_mask_ms": fwd_bwd(lambda: sdpa(qs, k, v, attn_mask=block)),
            "block_bias_ms": fwd_bwd(lambda: sdpa(qs, k, v, attn_mask=bias)),
            "block_bias_per_head_ms": fwd_bwd(lambda: sdpa(qs, k, v, attn_mask=per_head)),
            "block_no_mask_ms": fwd_bwd(lambda: sdpa(qs, k, v))}
    for query_block in (256, 512, 1024, 2048):
        line[f"layer_query_block_{query_block}_ms"] = fwd_bwd(
            lambda: sdpa_attention(q, k, v, mask, 256**-0.5, min(topk, seq), query_block))
    return line


TRITON_SWEEP = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    "FORWARD_CONFIG": [(128, 64, 8, 2), (128, 64, 8, 1), (64, 64, 4, 2)],
    "DQ_CONFIG": [(128, 64, 8, 2), (128, 64, 8, 1), (64, 32, 4, 2)],
    "DK_CONFIG": [(64, 128, 8, 2), (64, 128, 8, 1), (32, 128, 8, 2), (64, 64, 4, 2), (128, 128, 8, 1)],
    "DV_CONFIG": [(64, 128, 8, 2), (64, 128, 8, 1), (32, 128, 8, 2), (64, 64, 4, 2), (128, 128, 8, 1),
                  (128, 64, 8, 2)],
}


def check_triton_sweep(seq, topk=2048, heads=64):
    """The masked-flash kernels over the top-k tail (queries topk..seq) per tile config: the
    forward, or the whole backward with one kernel's config changed at a time."""
    from glmtune.kernels import sparse_attention as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    mask = random_topk_mask(seq, topk, gen)[:, topk:]
    q = torch.randn(1, heads, seq - topk, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, heads, seq, 256, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    grad_out = torch.randn_like(q)
    scale = 256**-0.5
    out, lse = kernels.sparse_attention_forward(q, k, v, mask, scale)
    line = {"check": "triton_sweep", "seq": seq, "tflop_forward_backward": round(
        heads * sum(range(topk + 1, seq + 1)) * 14 * 256 / 1e12, 3)}
    defaults = {name: dict(getattr(kernels, name)) for name in TRITON_SWEEP}
    for name, configs in TRITON_SWEEP.items():
        timings = {}
        for block_m, block_n, warps, stages in configs:
            getattr(kernels, name).update(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            if name == "FORWARD_CONFIG":
                def fn():
                    kernels.sparse_attention_forward(q, k, v, mask, scale)
            else:
                def fn():  # the dQ and dV kernels too, whatever the default buffer bound
                    kernels.sparse_attention_backward(grad_out, q, k, v, out, lse, mask, scale, 0, 0)
            try:
                timings[f"m{block_m}n{block_n}w{warps}s{stages}"] = round(bench_ms(fn, 2, 5), 3)
            except Exception as exc:  # a tile config this GPU cannot hold: report, try the next
                timings[f"m{block_m}n{block_n}w{warps}s{stages}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        getattr(kernels, name).update(defaults[name])
        line[name + ("_ms" if name == "FORWARD_CONFIG" else "_backward_ms")] = timings
    big = 1 << 40
    for label, limits in (("kernels_only", (0, 0)), ("materialized_ds", (big, 0)), ("materialized_p", (0, big)),
                          ("materialized_ds_and_p", (big, big))):  # dQ and dV from kernels or GEMMs
        line[f"backward_{label}_ms"] = round(bench_ms(
            lambda: kernels.sparse_attention_backward(grad_out, q, k, v, out, lse, mask, scale, *limits), 2, 5), 3)
    return line


ABSORBED_CASES = ("one_document", "cp8_rank0", "cp8_rank1")


def layer_case(case: str, seq: int, device):
    """(global positions of the local queries [S], keys T (one past the last query), shard or None)."""
    if case == "one_document":
        return torch.arange(seq, device=device), seq, None
    shard = SequenceShard(int(case.removeprefix("cp8_rank")), 8, "head_tail", gather=lambda x: x)
    return shard.query_index(8 * seq, device), shard.key_end(8 * seq), shard


def topk_selection(positions_S, keys: int, topk: int, gen):
    """bool [1, S, T]: each query's min(top-k, its causal past) random keys of its past."""
    scores = torch.rand(len(positions_S), keys, generator=gen, device=positions_S.device)
    causal = torch.arange(keys, device=positions_S.device) <= positions_S.unsqueeze(-1)
    top = scores.masked_fill(~causal, -1.0).topk(min(topk, keys), dim=-1).indices
    return (causal & torch.zeros_like(causal).scatter(-1, top, True)).unsqueeze(0)


def layer_attention_step(layer: MLAttention, backend: str, inputs, grad_out):
    """Output [1, S, N x V] and the gradients of (q, latent, k_rot, kv_b weight) through `backend`."""
    q_BSNK, latent_BTR, k_rot_B1TK, sparse_BST, shard, row = inputs
    q_BNSK = q_BSNK.transpose(1, 2)  # the layer's own layout: a view of q_b's output
    if backend in ("absorbed", "absorbed_triton"):
        layer.backend = backend
        out = layer._absorbed_attend(q_BNSK, latent_BTR, k_rot_B1TK, sparse_BST, layer.index_topk)
    else:
        layer.backend = backend
        k_BNTK, v_BNTV = layer.keys_and_values(latent_BTR, k_rot_B1TK)
        out = layer._attend_pieces(q_BNSK, k_BNTK, v_BNTV, sparse_BST, False, True, shard, row)
        out = out.transpose(1, 2).reshape(grad_out.shape)
    return out, torch.autograd.grad(out, (q_BSNK, latent_BTR, k_rot_B1TK, layer.kv_b_proj.weight), grad_out)


def _elapsed_ms(fn, device, warmup=2, reps=5):
    if torch.device(device).type == "cuda":
        return bench_ms(fn, warmup, reps)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1000 / reps


def check_absorbed(seq, args=None, device="cuda", backends=("sdpa", "triton", "absorbed", "absorbed_triton"),
                   dtype=torch.bfloat16):
    """One line per case of `ABSORBED_CASES`: each backend's fwd+bwd ms, model TFLOP/s and error."""
    args = args or Glm5Args()  # GLM-5: 64 heads, qk 192 + 64, v 256, latent 512, top-2048
    with torch.device(device):
        layer = MLAttention(args, has_indexer=False, backend="sdpa").to(dtype)
    torch.nn.init.normal_(layer.kv_b_proj.weight, std=0.02)
    heads, qk = args.num_attention_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
    lines = []
    for case in ABSORBED_CASES:
        gen = torch.Generator(device=device).manual_seed(0)
        positions, keys, shard = layer_case(case, seq, device)
        randn = functools.partial(_leaf, gen=gen, device=device, dtype=dtype)
        inputs = (randn(1, seq, heads, qk), randn(1, keys, args.kv_lora_rank),
                  randn(1, 1, keys, args.qk_rope_head_dim), topk_selection(positions, keys, args.index_topk, gen),
                  shard, keys if shard is None else 8 * seq)
        grad_out = torch.randn(1, seq, heads * args.v_head_dim, generator=gen, device=device, dtype=dtype)
        attended = sum(min(int(p) + 1, args.index_topk) for p in positions.tolist())
        model_flops = 3 * 2 * heads * attended * (qk + args.v_head_dim) + 6 * seq * layer.kv_b_proj.weight.numel()
        line = {"check": "absorbed", "case": case, "queries": seq, "keys": keys}
        reference = None
        for backend in backends:
            try:
                out, grads = layer_attention_step(layer, backend, inputs, grad_out)
                ms = _elapsed_ms(functools.partial(layer_attention_step, layer, backend, inputs, grad_out), device)
            except Exception as exc:  # a backend this machine cannot run (triton without a GPU): report it
                line[backend] = f"{type(exc).__name__}: {str(exc)[-200:]}"
                continue
            reference = reference or (out.detach().float(), [g.float() for g in grads])
            line[backend] = {"fwd_bwd_ms": round(ms, 2), "model_tflops": round(model_flops / ms / 1e9, 1),
                             "out_rel_diff": _rel_diff(out, reference[0]),
                             "grad_rel_diff_q_latent_krot_kvb": [_rel_diff(g, r) for g, r in zip(grads, reference[1])]}
        lines.append(line)
    return lines


def _leaf(*shape, gen, device, dtype):
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype).requires_grad_()


def _rel_diff(got, want):
    return float(f"{float((got.detach().float() - want).norm() / want.norm()):.3g}")


def check_indexer(seq, topk=2048, heads=32, dim=128):
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1, seq, heads, device="cuda", generator=gen) * heads**-0.5
    allowed = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril().unsqueeze(0)
    scale = dim**-0.5
    from glmtune.kernels.indexer_scores import indexer_scores

    rows = slice(seq - 512, seq)  # score error on the last queries (they see every key)
    reference = Indexer.combine(q[:, rows], k, w[:, rows], scale)
    fused = indexer_scores(q[:, rows], k, w[:, rows], scale)
    score_err = float((fused - reference).abs().max())
    masks = {}
    timings = {}
    for name, is_fused in (("chunked", False), ("fused", True)):
        masks[name] = dsa_topk_mask(q, k, w, allowed, scale, topk, topk, is_fused)
        timings[name] = bench_ms(lambda: dsa_topk_mask(q, k, w, allowed, scale, topk, topk, is_fused), 2, 5)
    differ = masks["chunked"] != masks["fused"]
    return {"check": "indexer", "seq": seq, "score_max_abs_diff": score_err,
            "score_max_abs": float(reference.abs().max()), "masks_differ_entries": int(differ.sum()),
            "rows_differing": int(differ.any(-1).sum()), "same_counts": bool(torch.equal(
                masks["chunked"].sum(-1), masks["fused"].sum(-1))),
            "chunked_ms": round(timings["chunked"], 2), "fused_ms": round(timings["fused"], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--only", choices=["attention", "indexer", "mask_cost", "triton_sweep", "absorbed"], default=None)
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention variants (slow to compile)")
    a = p.parse_args(argv)
    out = Path(os.environ.get("OUT", "."), "dsa_kernels.jsonl")
    for seq in a.seq:
        checks = {"indexer": check_indexer, "attention": lambda n: check_attention(n, flex=not a.no_flex),
                  "mask_cost": check_mask_cost, "triton_sweep": check_triton_sweep, "absorbed": check_absorbed}
        for name, check in checks.items():
            if a.only not in (None, name):
                continue
            result = check(seq)
            for line in result if isinstance(result, list) else [result]:
                line["gpu"] = torch.cuda.get_device_name()
                print(json.dumps(line), flush=True)
                with out.open("a") as fh:
                    fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
