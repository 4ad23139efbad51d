"""`--device`: a device this machine does not have, or a string that is no device, is refused in
one sentence before anything is read (the suite, the documents, the examples) or launched."""

from __future__ import annotations

import pytest
import torch

from glmtune.decide.run import DecideOptions, check_device, run_decide
from tests.decide.helpers import run_cli


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _decide(tmp_path, *extra: str) -> tuple[int, str, str]:
    # nothing here exists: the device must be refused before the suite or the docs are looked at
    return run_cli(["decide", str(tmp_path / "no-suite.yaml"), "--base", str(tmp_path / "no-model"),
                    "--docs", str(tmp_path / "no-docs"), "--out", str(tmp_path / "out"), *extra])


def test_cuda_without_cuda_is_refused_before_anything_is_read(no_cuda, tmp_path):
    code, stdout, stderr = _decide(tmp_path, "--device", "cuda")
    assert code == 2 and stdout == "", stderr
    assert stderr.count("\n") == 1 and "--device cuda: no CUDA device is available here" in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def test_cuda_without_cuda_is_refused_before_torchrun_starts(no_cuda, tmp_path, monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("torchrun started")

    monkeypatch.setattr("glmtune.distributed.launch.run_command_on_ranks", launched)
    code, _, stderr = _decide(tmp_path, "--device", "cuda", "--nproc-per-node", "2")
    assert code == 2 and "--device cuda: no CUDA device is available here" in stderr, stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device gpu: not a device (expected auto, cpu, cuda or cuda:N)"),
    ("cuda:x", "--device cuda:x: not a device"),
    ("meta", "--device meta: decide runs local models on the CPU or a CUDA GPU"),
    ("cuda", "--device cuda: no CUDA device is available here"),
])
def test_the_api_refuses_what_torch_cannot_use(no_cuda, tmp_path, device, message):
    options = DecideOptions(str(tmp_path / "no-suite.yaml"), str(tmp_path / "no-model"), device=device)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        run_decide(options)


def test_cuda_indices_against_the_devices_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda", sharded=True)
    check_device("cuda:1", sharded=False)
    for device in ("auto", "cpu"):
        check_device(device, sharded=True)
    with pytest.raises(ValueError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1$"):
        check_device("cuda:2", sharded=False)
    with pytest.raises(ValueError, match="each rank runs on its own GPU"):
        check_device("cuda:1", sharded=True)
