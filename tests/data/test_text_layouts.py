"""The text recipe (recipes/tiny/cpt_domain_text.yaml) at FSDP2, PP 2, EP 2 and CP 2 over 2 gloo ranks, and at
HSDP (2 replicas x 2 shards) over 4, equals one process: the same packed rows (documents split at the row's length
with overlap, document masks) give the same per-step losses, gradient norms, validation losses and supervised
tokens (the existing equivalence harness: tests/distributed/forked_runs.py's forked ranks and
layout_tolerances.py's bound). Its LoRA variant (recipes/tiny/cpt_lora_domain_text.yaml) at FSDP2 equals its
one process too."""

from __future__ import annotations

import time
from pathlib import Path

from tests.distributed.forked_cli import SECONDS_PER_RUN, _entry
from tests.distributed.forked_runs import one_torch_thread  # noqa: F401 (fixture)
from tests.distributed.gloo_helpers import start_forkserver_ranks
from tests.distributed.layout_tolerances import LOSS_REL
from tests.train.run_helpers import assert_same_steps, step_records

RECIPE = "recipes/tiny/cpt_domain_text.yaml"
FLAGS = ["--train.max_steps", "3", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
         "--train.val_every", "3", "--train.val_steps", "2", "--train.log_every", "1", "--checkpoint.every_steps", "0",
         "--data.packed_sequence_size", "128", "--data.long_document_overlap", "8", "--logging.progress", "false",
         "--optim.warmup_steps", "1"]
DATA_PARALLEL = ["--train.val_steps", "1"]  # one validation batch per rank: the one-process run's two
# 4 ranks = 2 replicas x 2 shards, one row each per step and one validation row each: the one-process run's rows
HSDP = ["--parallel.dp_replicate", "2", "--train.micro_batch_size", "1", "--train.val_steps", "1"]
LORA_RECIPE = "recipes/tiny/cpt_lora_domain_text.yaml"


def _train(run_dir: Path, cache_dir: Path, nproc: int, *extra: str, recipe: str = RECIPE) -> None:
    argv = ["train", recipe, *FLAGS, "--logging.run_dir", str(run_dir), "--data.cache_dir", str(cache_dir), *extra]
    jobs = [(str(run_dir.parent / f"{run_dir.name}.out"), argv)]
    context = start_forkserver_ranks(_entry, (nproc, str(run_dir.parent / f"gloo-{time.monotonic_ns()}"), jobs),
                                     nproc)
    deadline = time.monotonic() + SECONDS_PER_RUN
    while not context.join(timeout=1.0):
        assert time.monotonic() < deadline, f"{nproc} forked ranks not done after {SECONDS_PER_RUN:.0f} s"


KEYS = ("loss", "grad_norm", "val_loss", "tokens", "supervised_tokens")


def _runs(shared_results) -> Path:
    def build(root: Path) -> None:
        _train(root / "one", root / "cache", 1)
        _train(root / "fsdp2", root / "cache", 2, *DATA_PARALLEL)
        _train(root / "pp2", root / "cache", 2, "--parallel.pp", "2")
        _train(root / "ep2", root / "cache", 2, "--parallel.ep", "2", *DATA_PARALLEL)
        _train(root / "cp2", root / "cache", 2, "--parallel.cp", "2")

    return shared_results.get("text-layouts", build)


def test_text_recipe_fsdp2_equals_one_process(shared_results) -> None:
    root = _runs(shared_results)
    one, fsdp = step_records(root / "one", KEYS), step_records(root / "fsdp2", KEYS)
    assert "world 2 = dp_replicate 1 x dp_shard 2" in (root / "fsdp2.out").read_text()
    assert "documents ->" in (root / "one.out").read_text()
    assert sorted(one) == [1, 2, 3] and one[3][2] is not None  # a validation loss at step 3
    assert_same_steps(fsdp, one, rel=LOSS_REL)


def test_text_recipe_pp2_equals_one_process(shared_results) -> None:
    """Two pipeline stages (1F1B): the document masks and positions travel with the micro-batches."""
    root = _runs(shared_results)
    assert "pp 2" in (root / "pp2.out").read_text()
    assert_same_steps(step_records(root / "pp2", KEYS), step_records(root / "one", KEYS), rel=LOSS_REL)


def test_text_recipe_ep2_equals_one_process(shared_results) -> None:
    """Experts split over the two ranks (each rank its own rows): the all-to-all carries every token."""
    root = _runs(shared_results)
    assert "ep 2" in (root / "ep2.out").read_text()
    assert_same_steps(step_records(root / "ep2", KEYS), step_records(root / "one", KEYS), rel=LOSS_REL)


def test_text_recipe_cp2_equals_one_process(shared_results) -> None:
    """Each packed row's sequence split over the two ranks: several documents and split chunks in a row,
    their masks and restarting positions cut with it."""
    root = _runs(shared_results)
    assert "cp 2" in (root / "cp2.out").read_text()
    assert_same_steps(step_records(root / "cp2", KEYS), step_records(root / "one", KEYS), rel=LOSS_REL)


def test_text_recipe_hsdp_equals_one_process(shared_results) -> None:
    """HSDP: parameters sharded over 2 ranks and replicated twice, 4 data-parallel ranks of one row each."""
    one = _runs(shared_results) / "one"
    root = shared_results.get("text-layouts-hsdp", lambda root: _train(root / "hsdp", root / "cache", 4, *HSDP))
    assert "world 4 = dp_replicate 2 x dp_shard 2" in (root / "hsdp.out").read_text()
    assert_same_steps(step_records(root / "hsdp", KEYS), step_records(one, KEYS), rel=LOSS_REL)


def test_text_recipe_lora_fsdp2_equals_one_process(shared_results) -> None:
    """LoRA on text: only the adapters train (the losses differ from full fine-tuning's after step 1, where
    both are the same base), and FSDP2 over 2 ranks gives the one-process LoRA run's steps."""
    def build(root: Path) -> None:
        _train(root / "one", root / "cache", 1, recipe=LORA_RECIPE)
        _train(root / "fsdp2", root / "cache", 2, *DATA_PARALLEL, recipe=LORA_RECIPE)

    root = shared_results.get("text-layouts-lora", build)
    lora, full = step_records(root / "one", KEYS), step_records(_runs(shared_results) / "one", KEYS)
    assert "lora" in (root / "one.out").read_text().lower()
    assert lora[1][0] == full[1][0] and lora[3][0] != full[3][0]  # one base; then adapters only, at their own lr
    assert lora[1][4] == full[1][4]  # the same rows: every token of the text a target
    assert_same_steps(step_records(root / "fsdp2", KEYS), lora, rel=LOSS_REL)
