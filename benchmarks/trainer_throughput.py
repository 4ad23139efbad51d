"""The trainer's reported tokens/s against `throughput.py`'s on the GLM-5 proxy, in one run.

`glmtune train` trains the proxy (the `glm5` preset cut to `throughput.py`'s depth and expert
count through `model.overrides`: 4 layers = 1 dense + 3 MoE, 32 experts, no MTP layer) on
generated conversations, each longer than a row: a short user turn and a long assistant turn,
truncated to one document of `--seq` tokens (assistant-only loss then supervises nearly every
token, as `throughput.py`'s plain shift does). Batch 1, bf16 parameters, compiled layers,
glmtune's Triton AdamW: `throughput.py --compile --impl glmtune` (its GPU defaults). The
trainer's steady figure is the mean `tokens_per_s` of its logged windows after the first
(which holds compilation); printed beside `throughput.py`'s, and their ratio.

`--data text` trains the same proxy with the same settings on raw text instead (`data.kind: text`,
continued pretraining): documents of about three rows each, split at the row's length
(`long_documents: split`), so nearly every row is one full chunk and the last chunks pack together
with document masks; every token a target. `--data both` trains chat then text in one call and
adds their ratio (issue 47: text and chat rows should train at the same tokens/s, packing keeping
the rows full); each run's line carries its packing (rows, real tokens) and its no-padding tokens/s.

    python benchmarks/trainer_throughput.py --steps 40 --log-every 10
    python benchmarks/trainer_throughput.py --data both --steps 30 --log-every 10 --skip-reference
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
    p.add_argument("--data", choices=["chat", "text", "both"], default="chat",
                   help="chat rows, raw text (data.kind: text), or both in turn with their ratio (default: chat)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.profile and a.data == "both":
        p.error("--profile profiles one run: --data chat or --data text")
    return a


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


def write_documents(path: Path, documents: int, words: int, seed: int = 0) -> None:
    """Raw-text documents, each its own source, each longer than a row (`words` words)."""
    rng = random.Random(seed)
    vocabulary = [f"{a}{b}" for a in "bcdfghjklmnprstvz" for b in ("a", "e", "i", "o", "u", "ar", "en", "ol")]
    with path.open("w") as fh:
        for i in range(documents):
            text = f"Report {i}. " + " ".join(rng.choice(vocabulary) for _ in range(words))
            fh.write(json.dumps({"text": text, "source": f"report-{i}"}) + "\n")


def data_section(kind: str, data: Path, seq: int) -> dict:
    """The recipe's data: chat rows truncated to one row, or text documents split at the row's length."""
    if kind == "chat":
        return {"train": [str(data)], "packed_sequence_size": seq, "too_long": "truncate"}
    return {"kind": "text", "train": [str(data)], "text_field": "text", "source_field": "source",
            "long_documents": "split", "packed_sequence_size": seq, "split": {"train": 1.0}}


def recipe(a, data: Path, run_dir: Path, kind: str = "chat") -> dict:
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
        "data": data_section(kind, data, a.seq),
        "parallel": {"compile": not a.tiny},
        "checkpoint": {"every_steps": 0, "keep_last": 1, "save_at_end": False},
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "progress": False},
    }


def steady_tokens_per_s(metrics: Path, key: str = "tokens_per_s") -> tuple[float, list[float]]:
    windows = [json.loads(line)[key] for line in metrics.read_text().splitlines() if line.strip()]
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


def write_data(a, kind: str, work: Path) -> Path:
    """Rows for --steps steps and a few more: chat rows of one truncated conversation each (~1.5 tokens a
    word), or text documents of ~3 rows each."""
    if kind == "chat":
        data = work / "conversations.jsonl"
        write_conversations(data, rows=a.steps + 8, words=a.seq)
    else:
        data = work / "documents.jsonl"
        write_documents(data, documents=(a.steps + 8) // 2 + 2, words=2 * a.seq)
    return data


def train_once(a, kind: str, work: Path) -> dict | int:
    """One `glmtune train` of the proxy on `kind` rows in `work`: its result line, or its exit code."""
    work.mkdir(parents=True, exist_ok=True)
    recipe_path = work / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(a, write_data(a, kind, work), work / "run", kind)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GLMTUNE_CACHE_DIR": str(work / "cache")}
    if a.profile:
        return profile_training(recipe_path, env)
    train = subprocess.run([sys.executable, "-m", "glmtune", "train", str(recipe_path)], cwd=ROOT, env=env,
                           capture_output=True, text=True)
    if train.returncode:
        print(train.stdout[-3000:], train.stderr[-3000:], sep="\n")
        return train.returncode
    trainer, windows = steady_tokens_per_s(work / "run" / "metrics.jsonl")
    real, _ = steady_tokens_per_s(work / "run" / "metrics.jsonl", "tokens_per_s_no_padding")
    packing = json.loads((work / "run" / "data_manifest.json").read_text())["train_packing"]
    fill = packing["num_tokens"] / (packing["num_rows"] * a.seq)  # real tokens over the rows' room
    return {"impl": "glmtune train", "data": kind,
            "packing": {k: packing[k] for k in ("num_rows", "num_tokens") if k in packing}, "fill": round(fill, 4),
            "seq": a.seq,
            "steps": a.steps, "log_every": a.log_every, "clip": a.clip, "steady_tok_s": round(trainer, 1),
            "steady_tok_s_no_padding": round(real, 1), "windows_tok_s": [round(w, 1) for w in windows]}


def reference_line(a) -> dict:
    """`throughput.py --impl glmtune` at the same length: its tokens/s."""
    bench = [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--seq", str(a.seq), "--impl",
             "glmtune", "--master-weights", "none", "--steps", "8", "--warmup", "3"]
    bench += ["--tiny"] if a.tiny else ["--compile"]
    reference = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OUT": ""})
    results = [json.loads(x) for x in reference.stdout.splitlines() if x.startswith("{")]
    ours = next(r for r in results if r["impl"] == "glmtune")
    return {"impl": "throughput.py", "seq": a.seq, "tok_s": ours["tok_s"]}


def main(argv=None) -> int:
    a = parse_args(argv)
    kinds = ["chat", "text"] if a.data == "both" else [a.data]
    lines = []
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        for kind in kinds:
            line = train_once(a, kind, Path(tmp) / kind)
            if not isinstance(line, dict):
                return line
            lines.append(line)
    trainer = {line["data"]: line["steady_tok_s"] for line in lines}
    if a.data == "both":
        lines.append({"impl": "text / chat", "seq": a.seq, "chat_tok_s": trainer["chat"],
                      "text_tok_s": trainer["text"], "ratio": round(trainer["text"] / trainer["chat"], 3)})
    if not a.skip_reference:
        reference = reference_line(a)
        lines.append(reference)
        lines += [{"impl": "trainer / throughput.py" if kind == "chat" else "trainer text / throughput.py",
                   "ratio": round(tok_s / reference["tok_s"], 3)}
                  for kind, tok_s in trainer.items()]
    from benchmarks.timing import emit, results_path

    date = time.strftime("%Y-%m-%d")
    emit([{**entry, "date": date} for entry in lines], results_path(a.out, "trainer_throughput.jsonl"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
