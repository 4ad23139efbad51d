"""The trainer's reported tokens/s against `throughput.py`'s on the GLM-5 proxy, in one run.

`glmtune train` trains the proxy (the `glm5` preset cut to `throughput.py`'s depth and expert
count through `model.overrides`: 4 layers = 1 dense + 3 MoE, 32 experts, no MTP layer) on
generated conversations, each longer than a row: a short user turn and a long assistant turn,
truncated to one document of `--seq` tokens (assistant-only loss then supervises nearly every
token, as `throughput.py`'s plain shift does). Batch 1, bf16 parameters, compiled layers,
glmtune's Triton AdamW: `throughput.py --compile --impl glmtune` (its GPU defaults). The
trainer's steady figure is the mean `tokens_per_s` of its logged windows after the first
(which holds compilation); printed beside `throughput.py`'s, and their ratio.

    python benchmarks/trainer_throughput.py --steps 40 --log-every 10
    python benchmarks/trainer_throughput.py --clip 1.0      # the recipes' gradient clipping (throughput.py has none)
    python benchmarks/trainer_throughput.py --clip 1.0 --master-weights auto --skip-reference   # the recipes' defaults

The run directory and data go under --work (default: a temporary directory); the run writes no
checkpoint (`checkpoint.save_at_end: false`, `every_steps: 0`): the 6.5B-parameter proxy's final
one would not fit on the machine's disk, and the probe keeps no weights. Results append to
$OUT/trainer_throughput.jsonl (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--clip", type=float, default=None, help="train.clip_grad_norm (default: none, as throughput.py)")
    p.add_argument("--master-weights", choices=["auto", "fp32", "none"], default="none",
                   help="train.master_weights (default: none, as throughput.py's fast path; auto = the recipes' default)")
    p.add_argument("--work", default=None)
    p.add_argument("--skip-reference", action="store_true", help="only the trainer")
    p.add_argument("--profile", action="store_true",
                   help="train in this process under the torch profiler (3 steps from step 20): $OUT/trainer_profile.txt")
    p.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU: a smoke test of this script")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def write_conversations(path: Path, rows: int, words: int, seed: int = 0) -> None:
    """Conversations longer than a row: most of each row is one assistant turn."""
    rng = random.Random(seed)
    vocabulary = [f"{a}{b}" for a in "bcdfghjklmnprstvz" for b in ("a", "e", "i", "o", "u", "ar", "en", "ol")]
    with path.open("w") as fh:
        for i in range(rows):
            answer = " ".join(rng.choice(vocabulary) for _ in range(words))
            conversation = {"messages": [{"role": "user", "content": f"Write report {i}."},
                                         {"role": "assistant", "content": answer}]}
            fh.write(json.dumps(conversation) + "\n")


def recipe(a, data: Path, run_dir: Path) -> dict:
    proxy = {"num_hidden_layers": 4, "n_routed_experts": 32, "first_k_dense_replace": 1,
             "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "indexer_types": ["full"] * 4,
             "num_nextn_predict_layers": 0, "max_position_embeddings": max(2 * a.seq, 4096)}
    model = {"name_or_path": "glm5", "dtype": "bfloat16", "overrides": proxy}
    train = {"max_steps": a.steps, "global_batch_size": 1, "micro_batch_size": 1, "val_every": 0,
             "log_every": a.log_every, "clip_grad_norm": a.clip, "master_weights": a.master_weights, "device": "cuda"}
    optim = {"lr": 1e-5, "fused": "triton", "scheduler": "constant"}
    if a.tiny:
        model, train["device"], optim["fused"] = {"name_or_path": "tiny", "dtype": "float32"}, "cpu", "auto"
    return {
        "name": "trainer-throughput", "model": model, "train": train, "optim": optim,
        "data": {"train": [str(data)], "packed_sequence_size": a.seq,
                 "too_long": "truncate"},
        "parallel": {"compile": not a.tiny},
        "checkpoint": {"every_steps": 0, "keep_last": 1, "save_at_end": False},
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "progress": False},
    }


def steady_tokens_per_s(metrics: Path) -> tuple[float, list[float]]:
    windows = [json.loads(line)["tokens_per_s"] for line in metrics.read_text().splitlines() if line.strip()]
    steady = windows[1:] or windows
    return sum(steady) / len(steady), windows


def profile_training(recipe_path: Path, env: dict) -> int:
    """The run in this process, steps 20-22 profiled (the profiler steps at each step's gradients)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from benchmarks.timing import kernel_table
    from glmtune.config import load_config
    from glmtune.train.run import RunHooks, run_training

    os.environ.update(env)
    out_dir = Path(os.environ.get("OUT") or ".")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, schedule=schedule(wait=18, warmup=1, active=3, repeat=1)) as prof:
        code = run_training(load_config(recipe_path), hooks=RunHooks(on_gradients=lambda step, model: prof.step()))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    (out_dir / "trainer_profile.txt").write_text(kernel_table(prof, steps=3) + "\n\n" + table)
    prof.export_chrome_trace(str(out_dir / "trainer_profile.json.gz"))
    metrics = Path(load_config(recipe_path).logging.run_dir) / "metrics.jsonl"
    (out_dir / "trainer_metrics.jsonl").write_text(metrics.read_text())
    return code


def main(argv=None) -> int:
    a = parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        work = Path(tmp)
        data = work / "conversations.jsonl"
        write_conversations(data, rows=a.steps + 8, words=a.seq)  # ~1.5 tokens a word: every row truncated
        recipe_path = work / "recipe.yaml"
        recipe_path.write_text(yaml.safe_dump(recipe(a, data, work / "run")))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "GLMTUNE_CACHE_DIR": str(work / "cache")}
        if a.profile:
            return profile_training(recipe_path, env)
        train = subprocess.run([sys.executable, "-m", "glmtune", "train", str(recipe_path)], cwd=ROOT, env=env,
                               capture_output=True, text=True)
        if train.returncode:
            print(train.stdout[-3000:], train.stderr[-3000:], sep="\n")
            return train.returncode
        trainer, windows = steady_tokens_per_s(work / "run" / "metrics.jsonl")
        packing = json.loads((work / "run" / "data_manifest.json").read_text())["train_packing"]
    line = {"impl": "glmtune train", "packing": {k: packing[k] for k in ("num_rows", "num_tokens") if k in packing}, "seq": a.seq, "steps": a.steps, "log_every": a.log_every, "clip": a.clip,
            "steady_tok_s": round(trainer, 1), "windows_tok_s": [round(w, 1) for w in windows]}
    lines = [line]
    if not a.skip_reference:
        bench = [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--seq", str(a.seq), "--impl",
                 "glmtune", "--master-weights", "none", "--steps", "8", "--warmup", "3"]
        bench += ["--tiny"] if a.tiny else ["--compile"]
        reference = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OUT": ""})
        results = [json.loads(x) for x in reference.stdout.splitlines() if x.startswith("{")]
        ours = next(r for r in results if r["impl"] == "glmtune")
        lines.append({"impl": "throughput.py", "seq": a.seq, "tok_s": ours["tok_s"]})
        lines.append({"impl": "trainer / throughput.py", "ratio": round(trainer / ours["tok_s"], 3)})
    from benchmarks.timing import emit, results_path

    date = time.strftime("%Y-%m-%d")
    emit([{**entry, "date": date} for entry in lines], results_path(a.out, "trainer_throughput.jsonl"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
