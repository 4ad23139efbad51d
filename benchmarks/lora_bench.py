"""`benchmarks/throughput.py --lora`: LoRA training of the GLM-5 proxy, glmtune against
transformers + PEFT, in one run.

Both sides train the same adapters: glmtune applies LoRA (`peft.rank`, `peft.alpha`, the
schema's default targets: MLA projections, dense MLP, shared and routed experts; or
without the routed experts), then exports them in PEFT's format, and transformers + PEFT
loads that export (`PeftModel.from_pretrained(..., is_trainable=True)`: routed experts
through `target_parameters`). So the targets and the initial A and B are the same on
both sides; both inventories are printed by group and must be equal. Same bf16 base
weights, token batches and optimizer (torch's fused AdamW over the fp32 adapters, lr
1e-4). Reported per side: tokens/s, peak memory, trainable parameters; then the ratio and
the largest per-step loss difference.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from benchmarks.timing import DEVICE, free_memory, profile, time_training

LR = 1e-4
_ATTENTION = re.compile(r"\.self_attn\.([a-z_]+)\.")


def inventory_kind(name: str) -> str:
    """The group of a trainable parameter, named the same way for glmtune's and PEFT's names."""
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".shared_experts." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_mlp"
    match = _ATTENTION.search(name)
    if match:
        return f"attention.{match.group(1)}"
    return f"other:{name}"


def inventory(model: torch.nn.Module) -> dict[str, int]:
    groups: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            kind = inventory_kind(name)
            groups[kind] = groups.get(kind, 0) + param.numel()
    return dict(sorted(groups.items()))


def peft_config(a):
    from glmtune.config.schema import PeftConfig

    exclude = [] if a.lora_experts else ["*.mlp.experts"]
    return PeftConfig(method="lora", rank=a.lora_rank, alpha=a.lora_alpha, exclude_modules=exclude,
                      adapter_compute=a.lora_compute, adapter_kernel=a.lora_kernel)


def run_glmtune_lora(cfg, state, batches, a, adapter_dir: Path):
    """glmtune LoRA; writes the initial adapters to `adapter_dir` (PEFT layout) for the other side."""
    from benchmarks.throughput import build_glmtune, glmtune_step
    from glmtune.models.glm5.parallelize import parallelize_glm5
    from glmtune.peft import apply_lora, export_adapter

    model = build_glmtune(cfg, state, a, torch.bfloat16)
    apply_lora(model, peft_config(a), seed=0)
    export_adapter(model, adapter_dir, "peft", overwrite=True)
    groups = inventory(model)
    parallelize_glm5(model, activation_checkpointing=a.ckpt_mode if a.ckpt else "none", compile=a.compile,
                     ac_keep_matmul_min_k=a.ac_min_k)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=DEVICE == "cuda")
    step = glmtune_step(model, opt, batches, a)
    try:
        measured = time_training(step, a)
        if a.profile:
            profile(step, a, stem=f"profile_lora_seq{a.seq}{'_ckpt' if a.ckpt else ''}")
        return measured, groups
    finally:
        model = opt = step = None  # drop the last references before freeing GPU memory
        free_memory()


def run_peft_lora(cfg, state, batches, a, adapter_dir: Path):
    """transformers + PEFT, loading the adapters glmtune exported (trainable)."""
    import warnings

    from peft import PeftModel

    from benchmarks.throughput import build_hf, hf_step

    model = build_hf(cfg, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    if a.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    groups = inventory(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=DEVICE == "cuda")
    step = hf_step(model, opt, batches, a)
    try:
        return time_training(step, a), groups
    finally:
        model = opt = step = None
        free_memory()


def _report(name, a, measured, groups):
    seconds, losses, peak = measured
    tok_s = a.batch * a.seq / seconds
    return {"impl": name, "mode": "lora", "seq": a.seq, "ckpt": a.ckpt, "compile": a.compile, "docs": a.docs,
            "rank": a.lora_rank, "alpha": a.lora_alpha, "experts_targeted": a.lora_experts,
            "adapter_compute": a.lora_compute if name == "glmtune-lora" else "fp32",
            "adapter_kernel": a.lora_kernel if name == "glmtune-lora" else None,
            "layers": a.layers, "experts": a.experts, "trainable": sum(groups.values()), "inventory": groups,
            "step_s": round(seconds, 4), "tok_s": round(tok_s, 1), "peak_gib": round(peak, 2),
            "losses": [round(x, 5) for x in losses]}


def run_lora(cfg, state, batches, a) -> list[dict]:
    """Both sides (or one: `a.impl`), then the comparison line. OOM on a side is reported, not raised."""
    lines = []
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = Path(tmp) / "adapter"
        # glmtune runs first: it writes the adapters the PEFT side starts from.
        measured, groups = run_glmtune_lora(cfg, state, batches, a, adapter_dir)
        if a.impl in ("both", "glmtune"):
            results["glmtune"] = _report("glmtune-lora", a, measured, groups)
        if a.impl in ("both", "hf"):
            try:
                measured, groups = run_peft_lora(cfg, state, batches, a, adapter_dir)
                results["peft"] = _report("transformers+peft", a, measured, groups)
            except torch.OutOfMemoryError:
                results["peft"] = {"impl": "transformers+peft", "mode": "lora", "seq": a.seq, "ckpt": a.ckpt,
                                   "oom": True}
                free_memory()
    lines.extend(results.values())
    ours, theirs = results.get("glmtune"), results.get("peft")
    if ours and theirs and not theirs.get("oom"):
        assert ours["inventory"] == theirs["inventory"], (ours["inventory"], theirs["inventory"])
        diffs = [abs(x - y) for x, y in zip(ours["losses"], theirs["losses"])]
        lines.append({"impl": "lora_ratio", "seq": a.seq, "ckpt": a.ckpt, "same_inventory": True,
                      "speedup": round(ours["tok_s"] / theirs["tok_s"], 3),
                      "memory_ratio": round(ours["peak_gib"] / theirs["peak_gib"], 3) if theirs["peak_gib"] else None,
                      "max_loss_diff": round(max(diffs), 5)})
    return lines
