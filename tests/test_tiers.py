"""The test tiers (issue 49): `make test-fast` leaves out every test that starts other processes,
which tests/conftest.py marks at collection (by the module's source, the tests.* modules it imports,
and the fixtures it uses); `make test` records the 25 slowest tests."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import _SLOW, TESTS, _tiers_of_file

ROOT = TESTS.parent


@pytest.mark.parametrize("path, tiers", [
    ("distributed/test_fsdp_train.py", {"multiprocess"}),
    ("train/test_resume.py", {"subprocess"}),                 # through tests/train/run_helpers.py
    ("test_golden_losses.py", {"multiprocess", "subprocess"}),  # imports tests/distributed's runs
    ("cli/test_torch_free.py", {"subprocess"}),
    ("config/test_warmup_ratio.py", set()),                   # in-process: the fast tier
    ("eval/test_gates.py", set()),
])
def test_modules_are_marked_by_what_they_start(path, tiers):
    found = _tiers_of_file((TESTS / path).resolve())
    assert tiers <= found and bool(found) == bool(tiers), found  # run_helpers' runs may be either


def test_a_fixture_that_trains_marks_the_test_that_uses_it():
    """tests/release's `sft_run` trains in a subprocess (its conftest); the module itself starts nothing."""
    files = ["tests/release/test_manifest.py", "tests/config/test_warmup_ratio.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "-m", "not multiprocess and not subprocess", *files],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    kept = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert kept == {"tests/config/test_warmup_ratio.py"}, done.stdout
    assert "subprocess" in _tiers_of_file((TESTS / "release" / "conftest.py").resolve())


def test_makefile_targets():
    makefile = (ROOT / "Makefile").read_text()
    fast = re.search(r"^test-fast:.*?(?=^\S|\Z)", makefile, re.M | re.S).group(0)
    assert '-m "not multiprocess and not subprocess and not slow"' in fast and "--durations=25" in fast
    full = re.search(r"^test:.*?(?=^\S|\Z)", makefile, re.M | re.S).group(0)
    assert "--durations=60" in full and "-m \"not" not in full  # the whole suite


def test_the_slow_list_names_tests_that_exist():
    for node in _SLOW:
        path, _, name = node.partition("::")
        source = (ROOT / path).read_text()
        assert not name or f"def {name}(" in source, node
