"""Shared fixtures: a sharded tiny HF checkpoint, fresh copies of it a test may damage, and
results made once per session for several tests; and the test tiers.

Tiers (issue 49): every test that starts other processes is marked at collection, so
`make test-fast` (`-m "not multiprocess and not subprocess and not slow"`) is the edit-test loop:
- `multiprocess`: gloo jobs of several ranks (torchrun, `--nproc-per-node`, the forked or
  spawned harnesses of tests/distributed);
- `subprocess`: a glmtune command or training run in another interpreter (`subprocess`,
  tests/train/run_helpers.py's runs, preflight's reference runs, peak-RSS probes, the browser).
- `slow`: the in-process tests of more than ~10 s, listed below by node id.
A test module is marked by its own source and by every tests.* module it imports (transitively),
a test also by the source of each fixture it uses (a conftest fixture that trains, for one).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from glmtune import save_pretrained
from glmtune.models.glm5 import build_model, get_preset
from tests.shared_results import SharedResults


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_pretrained(build_model(get_preset("tiny"), seed=0), path, max_shard_size="1MB")
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A fresh copy of the sharded tiny checkpoint each test may damage."""
    return Path(shutil.copytree(saved, tmp_path / "tiny"))


@pytest.fixture(scope="session")
def shared_results(tmp_path_factory) -> SharedResults:
    """Results several tests read (reference runs, one gloo job for several cases), made once
    per session; under pytest-xdist the workers share them through the session's temp root."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # <session>/popen-gwN -> <session>, the same for every worker
    return SharedResults(root / "shared")


TESTS = Path(__file__).resolve().parent
_TIERS = {
    # `"--nproc-per-node", "2"` as an argument (a command launched in-process starts torchrun)
    "multiprocess": re.compile(r"\btorchrun\b|[\"']--nproc-per-node[\"'],|--nproc-per-node[= ]\d|\bnproc\s*=\s*\d|"
                               r"\bmultiprocessing\b|\bmp\.spawn\b|tests\.distributed\.(gloo_helpers|forked_runs)\b"),
    "subprocess": re.compile(r"\bsubprocess\b|\bPopen\b|\bos\.fork\b|tests\.train\.run_helpers\b|"
                             r"tests\.peak_rss\b|\bshared_run\b|\bplaywright\b"),
}
# In-process tests of more than ~10 s on an idle core (the fast tier's `--durations`, 2026-12-05): `slow`,
# so that `make test-fast` stays the edit-test loop. A node id, or its prefix (a module, a parametrized test).
_SLOW = (
    "tests/kernels/test_sparse_attention.py::test_sparse_attention_in_interpreter",
    "tests/kernels/test_sparse_mla.py::test_sparse_mla_in_interpreter",
    "tests/eval/test_serving_metrics.py::",
    "tests/eval/test_exit_codes.py::test_an_internal_error_exits_3_in_one_line_and_debug_shows_it",
    "tests/eval/test_preference_scorer.py::test_log_probabilities_equal_transformers",
    "tests/generation/test_generation.py::test_greedy_equals_transformers_generate",
    "tests/generation/test_generation.py::test_seeded_sampling_reproducible",
    "tests/generation/test_generation.py::test_run_samples_uses_the_cache",
    "tests/benchmarks/test_lora_bench.py::",
    "tests/benchmarks/test_plan_scripts.py::",
    "tests/benchmarks/test_generation_bench.py::",
    "tests/distributed/test_fsdp_units.py::test_optimizer_held_masters_give_the_earlier_fp32_master_path_per_step",
    "tests/distill/test_generate_local.py::test_in_process_topk_equals_the_teacher_forced_distribution",
)
# Directories whose tests start processes through the code under test: preflight's reference runs.
_SUBPROCESS_DIRS = ("preflight",)
_TESTS_IMPORT = re.compile(r"^\s*(?:from|import)\s+(tests(?:\.\w+)+)", re.M)


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: starts a job of several processes (make test-fast leaves it out)")
    config.addinivalue_line("markers", "subprocess: runs glmtune in another interpreter (make test-fast leaves it out)")
    config.addinivalue_line("markers", "slow: in-process, over ~10 s on an idle core (make test-fast leaves it out)")
    _share_the_cores()


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker's torch takes its share of the cores.

    Every worker's intra-op pool otherwise takes all of them: with `-n 2` on 2 cores four OpenMP threads
    spin at each other's barriers, and the small ops of the tiny models run several times slower
    (tests/distributed/test_schedule_order.py's replica cases: 17 s each against 2.8 s with one thread).
    A test that needs more threads sets them itself. The processes a test starts choose their own (the
    training runs' helpers one thread each; the distillation demo, often the last test running, all)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@functools.lru_cache(maxsize=None)
def _tiers_of_file(path: Path) -> frozenset[str]:
    """The tiers a tests/ source file needs, from its text and the tests.* modules it imports."""
    if path == TESTS / "conftest.py" or not path.is_file():  # this file names the patterns it looks for
        return frozenset()
    text = path.read_text()
    tiers = {name for name, pattern in _TIERS.items() if pattern.search(text)}
    for module in _TESTS_IMPORT.findall(text):
        parts = module.split(".")[1:]
        for candidate in (TESTS.joinpath(*parts).with_suffix(".py"), TESTS.joinpath(*parts, "__init__.py")):
            if candidate != path:
                tiers |= _tiers_of_file(candidate)
    return frozenset(tiers)


def _fixture_files(item) -> set[Path]:
    info = getattr(item, "_fixtureinfo", None)
    files = set()
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            source = inspect.getsourcefile(fixturedef.func)
            if source and Path(source).resolve().is_relative_to(TESTS):
                files.add(Path(source).resolve())
    return files


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        tiers = set(_tiers_of_file(path))
        for source in _fixture_files(item):
            tiers |= _tiers_of_file(source)
        if path.relative_to(TESTS).parts[0] in _SUBPROCESS_DIRS:
            tiers.add("subprocess")
        if item.nodeid.startswith(_SLOW):
            tiers.add("slow")
        for tier in sorted(tiers):
            item.add_marker(getattr(pytest.mark, tier))
