"""`glmtune plan`'s memory model against measurement, on the GLM-5 proxy of `throughput.py`.

For each setup the proxy trains a few steps with glmtune (same weights, batches and step as
`throughput.py`); printed side by side: the planned peak (`glmtune/plan/memory.py`, for the
same model, sequence, checkpointing, precision and LoRA) and the measured
`torch.cuda.max_memory_allocated` over the timed steps, their ratio, the memory allocated at
the end of one forward against the plan's "forward end" phase, and (without activation
checkpointing) a census of what autograd saved per layer (unique storages seen by
`saved_tensors_hooks`, parameters excluded) against the plan's per-layer bytes.

    python benchmarks/plan_check.py                          # the issue's setups (eager) + two compiled
    python benchmarks/plan_check.py --setups 4096:none:none:full --steps 2

Each setup runs in a fresh process. A setup is SEQ:AC:MASTER:MODE[:compile], AC none|full|selective, MASTER none|fp32 (full
fine-tuning), MODE full|lora. Results append to $OUT/plan_check.jsonl (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import DEVICE, emit, free_memory, results_path, time_training  # noqa: E402

GIB = 2**30
DEFAULT_SETUPS = [
    "4096:none:none:full", "4096:full:none:full", "16384:full:none:full",
    "4096:none:fp32:full", "4096:full:fp32:full", "16384:full:fp32:full",
    "4096:none:none:lora", "16384:full:none:lora", "16384:selective:none:full",
    "4096:none:none:full:compile", "4096:none:none:lora:compile",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="+", default=DEFAULT_SETUPS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="narrow widths: a CPU smoke test of this script")
    p.add_argument("--out", default=None)
    p.add_argument("--in-process", action="store_true",
                   help="run the setups in this process (default: one fresh process each, so that no setup "
                        "measures memory an earlier one left behind)")
    return p.parse_args(argv)


def bench_args(a, seq: int, ac: str, compiled: bool, lora: bool):
    """The namespace `throughput.py`'s helpers read, for one setup."""
    from benchmarks.throughput import parse_args as throughput_args

    flags = ["--seq", str(seq), "--layers", str(a.layers), "--dense", str(a.dense), "--experts", str(a.experts),
             "--steps", str(a.steps), "--warmup", str(a.warmup), "--lora-rank", str(a.lora_rank),
             "--ac-min-k", "4096", "--optimizer", "torch"]
    if ac != "none":
        flags += ["--ckpt", "--ckpt-mode", ac]
    if compiled:
        flags.append("--compile")
    if a.tiny:
        flags.append("--tiny")
    return throughput_args(flags)


def job_config(b, ac: str, master: str, lora: bool):
    """The glmtune config that trains what the benchmark trains (one process, batch 1)."""
    from glmtune.config.schema import JobConfig

    cfg = JobConfig()
    cfg.model.dtype = "bfloat16"
    cfg.train.master_weights = "none" if lora else master
    cfg.train.global_batch_size = cfg.train.micro_batch_size = b.batch
    cfg.data.packed_sequence_size = b.seq
    cfg.parallel.activation_checkpointing = ac
    cfg.parallel.ac_keep_matmul_min_k = b.ac_min_k
    cfg.parallel.compile = b.compile
    if lora:
        from benchmarks.lora_bench import peft_config

        cfg.peft = peft_config(b)
    return cfg


def planned(hf_cfg, cfg):
    """The plan's memory for `cfg` on the proxy (built on the meta device)."""
    from glmtune.models.glm5.args import Glm5Args
    from glmtune.models.glm5.model import build_model
    from glmtune.peft import apply_lora
    from glmtune.plan.planner import plan_memory

    model = build_model(Glm5Args.from_hf_dict(hf_cfg.to_dict()), torch.bfloat16, "meta")  # masters: the optimizer's
    if cfg.peft.method == "lora":
        apply_lora(model, cfg.peft, seed=0)
    return plan_memory(cfg, model)


class SavedCensus:
    """Bytes of the unique non-parameter storages autograd saves, by the layer that saved them."""

    def __init__(self, model):
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # FSDP2: DTensors
        self.params = {p.untyped_storage().data_ptr() for p in local}
        self.where = "embedding"
        self.bytes: dict[str, int] = {}
        self.seen: set[int] = set()
        layers = model.model.layers
        for i, layer in enumerate(layers.values() if hasattr(layers, "values") else layers):
            layer.register_forward_pre_hook(lambda m, args, i=i: setattr(self, "where", f"layer {i}"))
        model.model.norm.register_forward_pre_hook(lambda m, args: setattr(self, "where", "head"))

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.bytes[self.where] = self.bytes.get(self.where, 0) + storage.nbytes()
        return tensor


def measure(hf_cfg, state, b, cfg, census: bool):
    """(timed peak GiB, GiB allocated at one forward's end, census or None)."""
    from benchmarks.throughput import build_glmtune, glmtune_step, make_batches
    from glmtune.models.glm5.parallelize import parallelize_glm5
    from glmtune.models.common.document_masks import longest_document
    from glmtune.models.common.microbatch import MicroBatch
    from glmtune.train.optim import build_optimizer

    lora, fp32 = cfg.peft.method == "lora", cfg.train.master_weights == "fp32"
    batches = make_batches(b, hf_cfg.vocab_size)
    model = build_glmtune(hf_cfg, state, b, torch.bfloat16)
    if lora:
        from glmtune.peft import apply_lora

        apply_lora(model, cfg.peft, seed=0)
    parallelize_glm5(model, activation_checkpointing=cfg.parallel.activation_checkpointing, compile=b.compile,
                     ac_keep_matmul_min_k=b.ac_min_k)
    model.train()
    # the run's optimizer: torch's fused AdamW, or glmtune's with the fp32 masters it holds
    opt = build_optimizer(model, 1e-5, 0.0, (0.9, 0.999), 1e-8, "auto", masters=fp32)
    step = glmtune_step(model, opt, batches, b)
    counted = SavedCensus(model) if census else None
    try:
        seconds, _, peak = time_training(step, b)
        ids, positions, _ = batches
        x, pos = ids[0].to(DEVICE), positions.to(DEVICE)
        targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        hooks = torch.autograd.graph.saved_tensors_hooks(counted.pack, lambda t: t) if counted \
            else contextlib.nullcontext()
        with hooks:
            mb = MicroBatch(x, pos, targets=targets, longest_document=longest_document(b.seq, positions),
                            num_supervised=x.numel() - 1, loss_scale=1.0 / (x.numel() - 1))
            out = model(x, mb, compute_logits=False)
        forward_end = torch.cuda.memory_allocated() / GIB if DEVICE == "cuda" else 0.0
        (out.loss_sum / out.num_targets).backward()
        opt.zero_grad(set_to_none=True)
        return peak, forward_end, (counted.bytes if counted else None), seconds
    finally:
        model = opt = step = None
        free_memory()


def main(argv=None) -> int:
    from benchmarks.throughput import init_weights, proxy_config

    a = parse_args(argv)
    if not a.in_process:
        import subprocess

        passed = list(sys.argv[1:] if argv is None else argv)
        if "--setups" in passed:  # the setups follow --setups up to the next option
            at = passed.index("--setups")
            end = next((j for j in range(at + 1, len(passed)) if passed[j].startswith("--")), len(passed))
            passed = passed[:at] + passed[end:]
        for setup in a.setups:
            subprocess.run([sys.executable, __file__, *passed, "--in-process", "--setups", setup], check=False)
        return 0
    first = bench_args(a, 4096, "none", False, False)
    hf_cfg = proxy_config(first)
    state = init_weights(hf_cfg)
    out = results_path(a.out, "plan_check.jsonl")
    for setup in a.setups:
        seq, ac, master, mode, *rest = setup.split(":")
        compiled, lora = "compile" in rest, mode == "lora"
        b = bench_args(a, int(seq), ac, compiled, lora)
        hf_cfg = proxy_config(b)
        cfg = job_config(b, ac, master, lora)
        plan = planned(hf_cfg, cfg)
        line = {"setup": setup, "planned_peak_gib": round(plan.peak.total / GIB, 2), "planned_phase": plan.peak.name,
                "planned_forward_end_gib": round(plan.phases[0].total / GIB, 2)}
        try:
            peak, forward_end, census, seconds = measure(hf_cfg, state, b, cfg, census=ac == "none" and not compiled)
            line.update({"measured_peak_gib": round(peak, 2), "measured_forward_end_gib": round(forward_end, 2),
                         "planned_over_measured": round(plan.peak.total / GIB / peak, 3) if peak else None,
                         "step_s": round(seconds, 3)})
            if census:
                line["saved_gib"] = {k: round(v / GIB, 3) for k, v in census.items()}
                line["planned_saved_gib"] = {f"layer {i}": round(v / GIB, 3)
                                             for i, v in plan.activations_per_layer.items()}
        except torch.OutOfMemoryError:
            line["oom"] = True
            free_memory()
        line.update({"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d")})
        emit([line], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
