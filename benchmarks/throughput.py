"""Training throughput of glmtune vs transformers on a GLM-5 proxy, side by side in one run.

The proxy keeps every real GLM-5 layer width (hidden 6144, 64 heads, q/kv LoRA ranks
2048/512, qk 192+64, v 256, indexer 32 x 128 with top-k 2048, expert width 2048, top-8
+ 1 shared, vocab 154880) and cuts depth and expert count (default 4 layers = 1 dense
+ 3 MoE, 32 experts). Both implementations start from the same bf16 weights, see the
same token batches and use the same fused AdamW over all parameters, one after the
other on the same GPU. Printed per implementation: tokens/s, model TFLOP/s and MFU
(benchmarks/flops.py, one formula for both, against 989 TFLOP/s dense bf16), peak
memory; then the glmtune/transformers ratio and the largest per-step loss difference
(the fast path must compute the same function).

    python benchmarks/throughput.py --seq 4096
    python benchmarks/throughput.py --seq 8192 --ckpt
    python benchmarks/throughput.py --seq 16384 --ckpt --impl glmtune
    python benchmarks/throughput.py --seq 4096 --docs 4     # packed rows of 4 documents
    python benchmarks/throughput.py --seq 4096 --impl glmtune --master-weights both   # + fp32 master weights

`--master-weights fp32` trains glmtune's proxy as `train.master_weights: fp32` does: bf16
parameters and gradients, fp32 masters and moments held by the optimizer (`MasterAdamW`, its
Triton kernel with `--optimizer triton`, else its torch reference); `both` reports it beside
the bf16-only figure.

Results append to $OUT/throughput.jsonl (or --out) as JSON lines.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.flops import flops_per_token  # noqa: E402
from benchmarks.timing import DEVICE, emit, free_memory, profile, results_path, time_training  # noqa: E402

PEAK_BF16_TFLOPS = 989.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--docs", type=int, default=1, help="documents packed per row")
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--ckpt-mode", choices=["selective", "full"], default="selective", help="glmtune AC mode")
    p.add_argument("--ac-min-k", type=int, default=2048,
                   help="selective AC keeps matmul outputs with reduction dim >= this (glmtune's config default: 4096)")
    p.add_argument("--optimizer", choices=["torch", "triton"],
                   default="triton" if torch.cuda.is_available() else "torch",
                   help="glmtune's AdamW: torch's fused kernel (what transformers gets) or glmtune's Triton kernel "
                        "(optim.fused: triton; the GPU default here)")
    p.add_argument("--query-block", type=int, default=None, help="sdpa backend: queries per masked block")
    p.add_argument("--score-buffer-mib", type=int, default=None,
                   help="Triton attention: dQ / dV as GEMMs over dS / P buffers of at most this many MiB each "
                        "(model.attention_score_buffer_mib; default 1024, 0: the dQ and dV kernels)")
    p.add_argument("--compile", action="store_true", help="torch.compile each glmtune decoder layer")
    p.add_argument("--impl", choices=["both", "glmtune", "hf"], default="both")
    p.add_argument("--master-weights", choices=["none", "fp32", "both"], default="none",
                   help="glmtune's parameters: bf16 only (none), fp32 masters with bf16 compute, or both runs")
    p.add_argument("--lora", action="store_true",
                   help="LoRA instead of full fine-tuning: glmtune against transformers + PEFT (benchmarks/lora_bench.py)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=float, default=64.0)
    p.add_argument("--lora-experts", action=argparse.BooleanOptionalAction, default=True,
                   help="target the routed experts too (the default targets); --no-lora-experts leaves them out")
    p.add_argument("--lora-compute", choices=["base", "fp32"], default="base",
                   help="glmtune's peft.adapter_compute: adapter products in bf16 (base) or fp32")
    p.add_argument("--lora-kernel", choices=["auto", "torch", "triton"], default="auto",
                   help="glmtune's peft.adapter_kernel: the experts' base + update sums fused (triton) or not (torch)")
    p.add_argument("--attention", default="auto", help="glmtune attention backend (auto: Triton on GPU)")
    p.add_argument("--indexer", default="auto", help="glmtune indexer backend (auto: the Triton kernel on GPU)")
    p.add_argument("--dispatch", default="auto", help="glmtune MoE token movement (auto: Triton kernels on GPU)")
    p.add_argument("--norm", choices=["torch", "triton"], default="torch", help="glmtune's model.norm_backend")
    p.add_argument("--profile", action="store_true", help="write a torch profiler table for glmtune")
    p.add_argument("--tiny", action="store_true", help="narrow widths: a CPU smoke test of this script")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def proxy_config(a):
    from transformers import GlmMoeDsaConfig

    widths = {}
    if a.tiny:
        widths = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=16,
                      index_n_heads=4, num_experts_per_tok=2)
    return GlmMoeDsaConfig(num_hidden_layers=a.layers, first_k_dense_replace=a.dense, n_routed_experts=a.experts,
                           max_position_embeddings=max(2 * a.seq, 4096), **widths)


def make_batches(a, vocab: int):
    """Token ids, position ids (restarting per packed document) and document lengths."""
    g = torch.Generator().manual_seed(1234)
    total = a.warmup + a.steps
    ids = torch.randint(0, vocab, (total, a.batch, a.seq), generator=g)
    cuts = sorted(torch.randperm(a.seq - 1, generator=g)[: a.docs - 1].add(1).tolist())
    bounds = [0, *cuts, a.seq]
    lengths = [b - a_ for a_, b in zip(bounds, bounds[1:])]
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(a.batch, -1)
    return ids, positions, lengths


def init_weights(cfg):
    """The shared starting point: transformers' model with every matrix ~ N(0, 0.02), on the host."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 experts_implementation="grouped_mm")
    for param in model.parameters():
        if param.dim() >= 2:
            torch.nn.init.normal_(param, std=0.02)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    del model
    return state


def build_hf(cfg, state):
    """transformers' proxy on the device with `state`'s bf16 weights."""
    from transformers import AutoModelForCausalLM

    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 experts_implementation="grouped_mm")
    model.load_state_dict(state)
    return model


def hf_step(model, opt, batches, a):
    """One training step of transformers' proxy on batch i: the loss, detached."""
    ids, positions, _ = batches
    ids = ids.to(DEVICE)  # staged before timing, as a prefetching loader would (no sync in the step)
    pos = positions.to(DEVICE) if a.docs > 1 else None

    def step(i):
        x = ids[i]
        # use_cache=False: with a cache object transformers skips packed-sequence detection and
        # lets documents of a packed row attend each other (a different function).
        out = model(input_ids=x, labels=x, position_ids=pos, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    return step


def run_hf(cfg, state, batches, a):
    model = build_hf(cfg, state)
    if a.ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=DEVICE == "cuda")
    step = hf_step(model, opt, batches, a)
    try:
        return time_training(step, a)
    finally:
        model = opt = step = None  # drop the last references before freeing GPU memory
        free_memory()


def build_glmtune(cfg, state, a, dtype, mtp_layers: int = 0):
    """glmtune's proxy on the device with `state`'s weights (cast to `dtype`), not yet parallelized;
    with `mtp_layers` MTP layers (GLM-5 has one), which transformers' proxy lacks: drawn N(0, 0.02)
    (norms 1) from a fixed seed."""
    from glmtune.models.glm5.args import Glm5Args
    from glmtune.models.glm5.attention import set_attention_score_buffer
    from glmtune.models.glm5.model import build_model
    from glmtune.models.common.rmsnorm import set_norm_backend
    from glmtune.models.glm5.moe import set_moe_dispatch_backend

    args = Glm5Args.from_hf_dict(cfg.to_dict()).replace(num_nextn_predict_layers=mtp_layers)
    model = build_model(args, dtype, DEVICE, a.attention, "grouped_mm", init=False, indexer_backend=a.indexer)
    set_moe_dispatch_backend(model, a.dispatch)
    set_norm_backend(model, a.norm)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(key.startswith("mtp.") for key in missing), (missing, unexpected)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for layer in model.mtp:
            layer.reset_parameters(0.02)
    if a.score_buffer_mib is not None:
        set_attention_score_buffer(model, a.score_buffer_mib)
    if a.query_block is not None:
        for layer in model.model.layers:
            layer.self_attn.query_block = a.query_block
    return model


def glmtune_step(model, opt, batches, a):
    """One training step of glmtune's proxy on batch i: the loss, detached."""
    from glmtune.models.common.document_masks import longest_document
    from glmtune.models.common.microbatch import MicroBatch

    ids, positions, _ = batches
    ids, pos = ids.to(DEVICE), positions.to(DEVICE)
    longest = longest_document(a.seq, positions)  # on the host, as glmtune's data loader does

    def step(i):
        x = ids[i]
        # The same next-token targets transformers' loss uses (a plain shift over the row).
        targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        mb = MicroBatch(x, pos, targets=targets, longest_document=longest, num_supervised=x.numel() - x.shape[0],
                        loss_scale=1.0 / (x.numel() - x.shape[0]))
        out = model(x, mb, compute_logits=False)
        loss = out.loss_sum / out.num_targets
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run_glmtune(cfg, state, batches, a, master_weights="none"):
    from glmtune.models.glm5.parallelize import parallelize_glm5
    from glmtune.train.master_adamw import MasterAdamW

    model = build_glmtune(cfg, state, a, torch.bfloat16)
    parallelize_glm5(model, activation_checkpointing=a.ckpt_mode if a.ckpt else "none", compile=a.compile,
                     ac_keep_matmul_min_k=a.ac_min_k)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if master_weights == "fp32":  # train.master_weights: fp32 (its masters start from the bf16 weights exactly)
        opt = MasterAdamW(trainable, lr=1e-5, backend="triton" if a.optimizer == "triton" else "torch")
    elif a.optimizer == "triton":
        from glmtune.train.optim import TritonAdamW

        opt = TritonAdamW(trainable, lr=1e-5)
    else:
        opt = torch.optim.AdamW(trainable, lr=1e-5, fused=DEVICE == "cuda")
    step = glmtune_step(model, opt, batches, a)
    try:
        result = time_training(step, a)
        if a.profile:
            profile(step, a)
        return result
    finally:
        model = opt = step = None  # drop the last references before freeing GPU memory
        free_memory()


def report(name, cfg, a, lengths, measured):
    seconds, losses, peak = measured
    tokens = a.batch * a.seq
    tok_s = tokens / seconds
    tflops = flops_per_token(cfg, a.layers, a.dense, lengths) * tok_s / 1e12
    ours = name.startswith("glmtune")
    return {"impl": name, "seq": a.seq, "optimizer": a.optimizer if ours else "torch",
            "master_weights": ("fp32" if name.endswith("fp32-master") else "none") if ours else "none",
            "batch": a.batch, "docs": a.docs, "ckpt": a.ckpt, "compile": a.compile, "norm": a.norm if ours else "torch",
            "layers": a.layers, "experts": a.experts, "step_s": round(seconds, 4), "tok_s": round(tok_s, 1),
            "tflops": round(tflops, 1), "mfu": round(tflops / PEAK_BF16_TFLOPS, 4), "peak_gib": round(peak, 2),
            "losses": [round(x, 5) for x in losses]}


def compare(name, a, ours, base):
    """ours / base: tokens/s and peak memory; the largest per-step loss difference."""
    diffs = [abs(x - y) for x, y in zip(base["losses"], ours["losses"])]
    return {"impl": name, "seq": a.seq, "ckpt": a.ckpt, "docs": a.docs,
            "speedup": round(ours["tok_s"] / base["tok_s"], 3),
            "memory_ratio": round(ours["peak_gib"] / base["peak_gib"], 3) if base["peak_gib"] else None,
            "max_loss_diff": round(max(diffs), 5)}


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = proxy_config(a)
    batches = make_batches(a, cfg.vocab_size)
    state = init_weights(cfg)
    results = {}
    if a.lora:
        from benchmarks.lora_bench import run_lora

        return _emit(run_lora(cfg, state, batches, a), a)
    if a.impl in ("both", "hf"):
        try:
            results["transformers"] = report("transformers", cfg, a, batches[2], run_hf(cfg, state, batches, a))
        except torch.OutOfMemoryError:
            results["transformers"] = {"impl": "transformers", "seq": a.seq, "ckpt": a.ckpt, "oom": True}
            free_memory()
    if a.impl in ("both", "glmtune"):
        for master in ("none", "fp32") if a.master_weights == "both" else (a.master_weights,):
            name = "glmtune" if master == "none" else "glmtune-fp32-master"
            results[name] = report(name, cfg, a, batches[2], run_glmtune(cfg, state, batches, a, master))
    lines = list(results.values())
    hf, ours, masters = results.get("transformers"), results.get("glmtune"), results.get("glmtune-fp32-master")
    if hf and ours and not hf.get("oom"):
        lines.append(compare("ratio", a, ours, hf))
    if ours and masters:  # what fp32 master weights cost against bf16 only
        lines.append(compare("fp32_master_vs_bf16", a, masters, ours))
    return _emit(lines, a)


def _emit(lines, a) -> int:
    """Print each result line with the GPU, torch and date; append them to --out or $OUT/throughput.jsonl."""
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    meta = {"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    emit([{**line, **meta} for line in lines], results_path(a.out, "throughput.jsonl"))
    return 0

if __name__ == "__main__":
    sys.exit(main())
