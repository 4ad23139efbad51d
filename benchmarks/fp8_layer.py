"""One GLM-5 MoE layer at full width trained with LoRA on a frozen base: bf16 against FP8
(e4m3 weights, 128 x 128 scales; `glmtune/models/glm5/fp8_base.py`), forward and backward
timed apart, peak memory, weights held. The real attention (MLA + DSA indexer, top-2048),
router and expert widths; vocab cut to 2048 so the LM head does not hide the layer.

    python benchmarks/fp8_layer.py --experts 256 --seq 4096             # all 256 experts on one GPU
    python benchmarks/fp8_layer.py --experts 32 --seq 4096              # one GPU's share at EP 8
    python benchmarks/fp8_layer.py --experts 32 --seq 16384 --ckpt
    python benchmarks/fp8_layer.py --bases bf16,dequant,scaled_mm

At EP 8 each GPU holds 32 of the 256 experts and computes every row routed to them: with
4096 tokens per GPU that is 8 x 4096 x 8 / 8 = 32768 rows, what `--experts 32 --seq 4096`
gives one GPU here (the all-to-all is not in it). Results append to $OUT/fp8_layer.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import free_memory, peak_gib  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing (selective)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--bases", default="bf16,dequant,scaled_mm", help="bf16 and/or FP8 matmul backends")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def build(a, base: str):
    from glmtune.config.schema import PeftConfig
    from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
    from glmtune.models.glm5.args import get_preset
    from glmtune.models.glm5.fp8_base import convert_to_fp8_base
    from glmtune.models.glm5.model import build_model
    from glmtune.models.glm5.parallelize import parallelize_glm5
    from glmtune.peft import apply_lora

    args = get_preset("glm5").replace(num_hidden_layers=1, first_k_dense_replace=0, vocab_size=2048,
                                      n_routed_experts=a.experts, num_nextn_predict_layers=0, pad_token_id=0,
                                      indexer_types=["full"], max_position_embeddings=max(4096, 2 * a.seq))
    model = build_model(args, torch.bfloat16, "cuda", seed=0)
    if base != "bf16":
        convert_to_fp8_base(model, base)
        torch.cuda.empty_cache()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    # The default targets but the dense MLP's (a MoE layer has none).
    targets = [t for t in DEFAULT_LORA_TARGETS if not t.startswith("*.mlp.") or "experts" in t]
    apply_lora(model, PeftConfig(method="lora", rank=a.rank, alpha=2.0 * a.rank, target_modules=targets), seed=0)
    parallelize_glm5(model, activation_checkpointing="selective" if a.ckpt else "none", compile=a.compile)
    model.train()
    return model, weights


def measure(a, base: str) -> dict:
    from glmtune.models.common.microbatch import MicroBatch

    model, weights = build(a, base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (a.warmup + a.steps, 1, a.seq), generator=g).cuda()
    events = []
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        x = ids[i]
        marks[0].record()
        mb = MicroBatch(x, targets=torch.roll(x, -1, 1), longest_document=a.seq, num_supervised=x.numel(),
                        loss_scale=1.0 / x.numel())
        out = model(x, mb, compute_logits=False)
        marks[1].record()
        (out.loss_sum / out.num_targets).backward()
        marks[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks[3].record()
        if i >= a.warmup:
            events.append(marks)
    torch.cuda.synchronize()
    ms = [[m[j].elapsed_time(m[j + 1]) for j in range(3)] for m in events]
    mean = [sum(col) / len(col) for col in zip(*ms)]
    result = {"base": base, "experts": a.experts, "seq": a.seq, "ckpt": a.ckpt, "compile": a.compile,
              "rank": a.rank, "forward_ms": round(mean[0], 2), "backward_ms": round(mean[1], 2),
              "optimizer_ms": round(mean[2], 2), "peak_gib": round(peak_gib(), 2), "weights_gib": round(weights, 2),
              "loss": round(float(out.loss_sum / out.num_targets), 4),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    model = opt = out = None
    free_memory()
    return result


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out or os.path.join(os.environ.get("OUT", "."), "fp8_layer.jsonl"))
    for base in a.bases.split(","):
        try:
            result = measure(a, base)
        except Exception as err:  # an OOM or a backend that does not run here is a result too
            result = {"base": base, "experts": a.experts, "seq": a.seq, "ckpt": a.ckpt,
                      "error": f"{type(err).__name__}: {str(err)[:300]}"}
            free_memory()
        print(json.dumps(result), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
