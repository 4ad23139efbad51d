"""A teacher directory for the distillation tests, built in process: synthetic support tickets (with
their ids), the tiny preset as the teacher (seeded, 4 layers and 8 experts: larger than the recipe's
student), its actual top-K log-probabilities before each token of every row's last assistant turn,
written with `TopKWriter`, and the manifest naming the teacher's tokenizer. Nothing waits on
`glmtune distill generate`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from glmtune.data.synthetic import generate_rows
from glmtune.data.sources import file_sha256
from glmtune.data.token_cache import tokenize_dataset
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.distill.topk_store import TopKWriter
from glmtune.models.registry import GLM5
from glmtune.train.distill_data import MANIFEST, SIDECAR, last_turn_targets
from tests.train.run_helpers import env

K = 4
RECIPE = "tiny/distill_support_json"


@torch.no_grad()
def build_teacher_dir(directory: Path, rows: int = 48, seed: int = 0, skip: tuple[str, ...] = (),
                      short: tuple[str, ...] = (), unstopped: tuple[str, ...] = (), diverged: tuple[str, ...] = (),
                      model: bool = True) -> Path:
    """The rows file of a teacher directory at `directory`: rows whose id is in `skip` get no record,
    those in `short` two positions too few, those in `unstopped` none at their end-of-turn token (a
    sampled stop), those in `diverged` another emitted token at their third position; `model` False:
    random distributions instead of the model's."""
    directory.mkdir(parents=True, exist_ok=True)
    data = generate_rows(rows, seed)
    rows_file = directory / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(row) + "\n" for row in data))
    samples = tokenize_dataset([rows_file], tokenizer_dir=None, loss_on="all_assistant", enable_thinking=False,
                               schema=None, cache_dir=directory / ".cache", vocab_size=4096).samples
    all_logps = _teacher_logps(samples, seed) if model else [
        torch.randn(len(sample.input_ids), 4096, generator=torch.Generator().manual_seed(i)).log_softmax(-1)
        for i, sample in enumerate(samples)]
    with TopKWriter(directory / SIDECAR, K, vocab_size=4096) as writer:
        for row, sample, logps in zip(data, samples, all_logps):
            if row["id"] in skip:
                continue
            labels = last_turn_targets(list(sample.labels))
            if row["id"] in short or row["id"] in unstopped:
                labels = labels[:-2] if row["id"] in short else labels[:-1]
            top = logps[[i - 1 for i in labels]].topk(K, dim=-1)  # the distribution before each answer token
            generated = torch.tensor([sample.labels[i] for i in labels])
            if row["id"] in diverged:
                generated[2] = (generated[2] + 1) % 4096
            writer.append(row["id"], top.indices, top.values, generated=generated)
    # glmtune distill generate's manifest, as much of it as training reads
    manifest = {"command": "glmtune distill generate", "settings": {
        "teacher": "tiny (seed 0, in process)", "tokenizer": str(TINY_TOKENIZER_DIR),
        "tokenizer_sha256": file_sha256(TINY_TOKENIZER_DIR), "top_logprobs": K}}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return rows_file


def _teacher_logps(samples, seed: int) -> torch.Tensor:
    """The tiny preset's log-probabilities at every position of every sample ([rows, longest, V])."""
    teacher = GLM5.weights.build(GLM5.family.preset_args("tiny"), torch.float32, seed=seed).eval()
    # Rows padded on the right, 16 per forward: causal attention keeps each row's positions its own.
    longest = max(len(sample.input_ids) for sample in samples)
    padded = torch.tensor([sample.input_ids + [0] * (longest - len(sample.input_ids)) for sample in samples])
    return torch.cat([teacher(padded[i:i + 16]).logits.float().log_softmax(-1) for i in range(0, len(samples), 16)])


# run_helpers.SMALL without its synthetic data: four steps of 4 packed rows of 256 tokens.
SMALL_DISTILL = [
    "--train.max_steps", "4", "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "0",
    "--data.packed_sequence_size", "256", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
    "--train.val_every", "0", "--train.generate_samples", "0", "--checkpoint.export_hf", "false",
    "--logging.progress", "false", "--logging.tensorboard", "false", "--train.log_every", "1",
    "--optim.warmup_steps", "2",
]


def distill_command(run_dir: Path, cache_dir: Path, rows_file: Path, *extra: str, recipe: str = RECIPE) -> list[str]:
    return [sys.executable, "-m", "glmtune", "train", recipe, *SMALL_DISTILL, "--data.train",
            json.dumps([str(rows_file)]), "--logging.run_dir", str(run_dir), "--data.cache_dir", str(cache_dir),
            *extra]


def run_distill(run_dir: Path, cache_dir: Path, rows_file: Path, *extra: str, recipe: str = RECIPE
                ) -> subprocess.CompletedProcess:
    return subprocess.run(distill_command(run_dir, cache_dir, rows_file, *extra, recipe=recipe), env=env(),
                          capture_output=True, text=True, timeout=600)
