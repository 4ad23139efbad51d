"""`glmtune eval --device cuda` where torch sees no CUDA device is refused in one line before the
suite, a model or torchrun is touched (eval/placement.py `check_device`, shared with decide)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from glmtune.cli import main


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _eval(tmp_path, *extra: str) -> tuple[int, str, str]:
    # nothing here exists: the device must be refused before the suite or a model is looked at
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["eval", str(tmp_path / "no-suite.yaml"), "--base", str(tmp_path / "no-base"),
                     "--candidate", str(tmp_path / "no-candidate"), "--out", str(tmp_path / "out"), *extra])
    return code, out.getvalue(), err.getvalue()


def test_cuda_without_cuda_is_refused_before_anything_is_read(no_cuda, tmp_path):
    code, stdout, stderr = _eval(tmp_path, "--device", "cuda")
    assert code == 2 and stdout == "", stderr
    assert stderr.count("\n") == 1 and "--device cuda: no CUDA device is available here" in stderr, stderr
    assert list(tmp_path.iterdir()) == []  # no output directory


def test_cuda_without_cuda_is_refused_before_torchrun_starts(no_cuda, tmp_path, monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("torchrun started")

    monkeypatch.setattr("glmtune.distributed.launch.run_command_on_ranks", launched)
    code, _, stderr = _eval(tmp_path, "--device", "cuda", "--nproc-per-node", "2")
    assert code == 2 and "--device cuda: no CUDA device is available here" in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def test_cpu_goes_on_to_read_the_suite(tmp_path):
    code, _, stderr = _eval(tmp_path, "--device", "cpu")
    assert code == 2 and "no-suite.yaml" in stderr and "--device" not in stderr, stderr
