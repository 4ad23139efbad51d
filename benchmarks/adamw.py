"""GPU check of glmtune's Triton AdamW against torch's fused AdamW: time per step and
agreement, on bf16 tensors shaped like the GLM-5 proxy's (benchmarks/throughput.py).

    python benchmarks/adamw.py

Both optimizers start from the same parameters, states and gradients; after 4 steps the
parameters may differ only by bf16 rounding (max difference, fraction of elements). Prints JSON and
appends to $OUT/adamw.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> int:
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # updates well above bf16 ulps
    results = {}
    finals = {}
    for name in ("torch_fused", "triton"):
        params = make(0)
        gen = torch.Generator(device="cuda").manual_seed(1)  # the same gradients for both
        grads = [torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype).mul_(1e-3) for p in params]
        opt = (torch.optim.AdamW(params, fused=True, **hyper) if name == "torch_fused"
               else TritonAdamW(params, **hyper))
        results[name + "_ms"] = round(timed(opt, params, grads, 3), 2)
        finals[name] = [p.detach().float() for p in params[::7]]  # a sample of tensors, 4 steps each
        del opt, params, grads
        torch.cuda.empty_cache()
    numel = sum(torch.Size(shape).numel() * count for count, shape in PROXY_SHAPES)
    diff = max(float((a - b).abs().max()) for a, b in zip(finals["torch_fused"], finals["triton"]))
    differ = sum(int((a != b).sum()) for a, b in zip(finals["torch_fused"], finals["triton"]))
    sampled = sum(a.numel() for a in finals["triton"])
    line = {"check": "adamw", "params": numel, **results, "max_param_abs_diff": diff,
            "fraction_params_differing": round(differ / sampled, 6),
            "triton_GBps": round(14 * numel / (results["triton_ms"] / 1e3) / 1e9),
            "gpu": torch.cuda.get_device_name()}
    print(json.dumps(line))
    with Path(os.environ.get("OUT", "."), "adamw.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
