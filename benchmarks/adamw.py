"""GPU check of glmtune's Triton AdamW against torch's fused AdamW: time per step and
agreement, on bf16 tensors shaped like the GLM-5 proxy's (benchmarks/throughput.py).

    python benchmarks/adamw.py
    python benchmarks/adamw.py --masters     # MasterAdamW: its kernel against its torch reference

Both optimizers start from the same parameters, states and gradients; after 4 steps the
parameters may differ only by bf16 rounding (max difference, fraction of elements). With
`--masters` the two sides are the fp32-master optimizer's Triton kernel and its torch reference
(`glmtune/train/master_adamw.py`), compared on the fp32 masters; bandwidth counts its 28 bytes
per parameter. Prints JSON and appends to $OUT/adamw.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.train.master_adamw import MasterAdamW  # noqa: E402
from glmtune.train.optim import TritonAdamW  # noqa: E402

# (count, shape): routed experts of 3 MoE layers, attention-sized matrices, embeddings, norms
PROXY_SHAPES = [(3, (32, 4096, 6144)), (3, (32, 6144, 2048)), (2, (154880, 6144)), (4, (16384, 6144)),
                (4, (12288, 2048)), (4, (24576, 512)), (4, (2048, 6144)), (3, (4096, 6144)), (3, (6144, 2048)),
                (2, (12288, 6144)), (1, (6144, 12288)), (16, (6144,))]


def make(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).mul_(0.02).requires_grad_()
            for count, shape in PROXY_SHAPES for _ in range(count)]


def timed(opt, params, grads, steps):
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()  # creates the states
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def build(name, params, hyper):
    if name == "torch_fused":
        return torch.optim.AdamW(params, fused=True, **hyper)
    if name == "triton":
        return TritonAdamW(params, **hyper)
    return MasterAdamW(params, backend=name.removeprefix("master_"), **hyper)


def main() -> int:
    masters = "--masters" in sys.argv[1:]
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # updates well above bf16 ulps
    results = {}
    finals = {}
    sides = ("master_torch", "master_triton") if masters else ("torch_fused", "triton")
    for name in sides:
        params = make(0)
        gen = torch.Generator(device="cuda").manual_seed(1)  # the same gradients for both
        grads = [torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype).mul_(1e-3) for p in params]
        opt = build(name, params, hyper)
        results[name + "_ms"] = round(timed(opt, params, grads, 3), 2)
        held = [opt.master_of(p) for p in params] if masters else params
        finals[name] = [t.detach().float() for t in held[::7]]  # a sample of tensors, 4 steps each
        del opt, params, grads, held
        torch.cuda.empty_cache()
    numel = sum(torch.Size(shape).numel() * count for count, shape in PROXY_SHAPES)
    reference, ours = (finals[name] for name in sides)
    diff = max(float((a - b).abs().max()) for a, b in zip(reference, ours))
    differ = sum(int((a != b).sum()) for a, b in zip(reference, ours))
    sampled = sum(a.numel() for a in ours)
    bytes_per_param, kernel_ms = (28, results["master_triton_ms"]) if masters else (14, results["triton_ms"])
    line = {"check": "adamw_masters" if masters else "adamw", "params": numel, **results, "max_param_abs_diff": diff,
            "fraction_params_differing": round(differ / sampled, 6),
            "triton_GBps": round(bytes_per_param * numel / (kernel_ms / 1e3) / 1e9),
            "gpu": torch.cuda.get_device_name()}
    print(json.dumps(line))
    with Path(os.environ.get("OUT", "."), "adamw.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
