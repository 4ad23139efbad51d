"""Per-GPU memory and step time of a GLM-5.x LoRA recipe on a frozen FP8 base, from the model's
own parameter inventory (built on the meta device: exact counts, no memory) and the per-layer
measurements of `benchmarks/fp8_layer.py` (docs/benchmarks.md). An estimate for one node until
`glmtune plan` (issue 17) and an 8-GPU run (issue 19) replace it.

    python benchmarks/fp8_1node_plan.py recipes/glm5/lora_fp8_1node.yaml

Memory per GPU: routed experts (e4m3 + scales) / ep; the rest of the base / world (FSDP2);
adapters / ep (routed) or / world (the others), each with its fp32 gradient and AdamW moments
(16 B a parameter); with full activation checkpointing one [tokens, hidden] bf16 input per
layer, plus the live activations of the layer being computed (measured peak minus weights);
the gradient of the LM head's input and the fused loss's chunk are inside the measured layer.
Step time: per MoE layer forward + backward as measured at one GPU's EP share, plus one more
forward (the recompute) under full checkpointing, times the layers, times the micro-batches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    # Measured (docs/benchmarks.md, 2026-12-01, 1 x H200, 32 experts, 4096 tokens, FP8 dequant).
    p.add_argument("--layer-forward-ms", type=float, default=13.30)
    p.add_argument("--layer-backward-ms", type=float, default=15.05)
    p.add_argument("--layer-live-gib", type=float, default=5.65 - 1.38, help="measured peak minus weights")
    p.add_argument("--gpu-gib", type=float, default=139.8, help="an H200's usable memory")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    from glmtune.config import load_config
    from glmtune.models.registry import model_dims
    from glmtune.config.validate import validate_config
    from glmtune.models.glm5.args import get_preset
    from glmtune.models.glm5.fp8_base import convert_to_fp8_base
    from glmtune.models.glm5.model import build_model
    from glmtune.peft import apply_lora

    a = parse_args(argv)
    cfg = load_config(a.recipe)
    dims = model_dims(cfg.model)
    degrees = validate_config(cfg, dims.num_experts, dims.num_layers, model_refusals=dims.refusals)
    args = get_preset(cfg.model.validate_as or cfg.model.name_or_path)
    model = build_model(args, torch.bfloat16, "meta")
    if cfg.model.fp8_base != "none":
        convert_to_fp8_base(model, cfg.model.fp8_base)
    apply_lora(model, cfg.peft)
    world, ep = degrees.world_size, degrees.ep
    routed = lambda name: ".mlp.experts." in f"{name}."  # noqa: E731
    base = {"routed experts": 0.0, "rest of the base": 0.0}
    adapters = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        share = ep if routed(name) else world
        if p.requires_grad:
            adapters += p.numel() * 16 / share  # fp32 parameter, gradient, two AdamW moments
        else:
            base["routed experts" if routed(name) else "rest of the base"] += nbytes / share
    tokens = cfg.data.packed_sequence_size * cfg.train.micro_batch_size
    layers = args.num_hidden_layers
    checkpointed = layers * tokens * args.hidden_size * 2 if cfg.parallel.activation_checkpointing == "full" else None
    rows = [*base.items(), ("adapters + gradients + AdamW", adapters)]
    if checkpointed is None:
        print("activation checkpointing is not full: this estimate covers full checkpointing only")
        return 2
    rows += [("checkpointed layer inputs", checkpointed), ("live layer (measured)", a.layer_live_gib * GIB)]
    total = sum(v for _, v in rows)
    print(f"{a.recipe}: world {world}, ep {ep}, {tokens} tokens per micro-batch, {layers} layers")
    for what, value in rows:
        print(f"  {what:32s} {value / GIB:7.1f} GiB")
    verdict = "fits" if total <= a.gpu_gib * GIB else "does NOT fit"
    print(f"  {'total per GPU':32s} {total / GIB:7.1f} GiB of {a.gpu_gib} GiB: {verdict}")
    recompute = a.layer_forward_ms  # full checkpointing runs each layer's forward twice
    accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * degrees.dp_shard * degrees.dp_replicate)
    step = layers * (a.layer_forward_ms + recompute + a.layer_backward_ms) / 1e3 * accum
    node_tokens = cfg.train.global_batch_size * cfg.data.packed_sequence_size
    print(f"  step ~ {step:.1f} s for {node_tokens:,} tokens ({node_tokens / step:,.0f} tokens/s for the node), "
          f"before the all-to-all, which one GPU cannot measure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
