"""`glmtune --version` and `glmtune version`: one line with glmtune, torch, transformers, triton,
CUDA and the GPU, for bug reports (issue 49). `--help` stays torch-free: tests/cli/test_torch_free.py
runs `glmtune version --help` with the other commands."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from glmtune import __version__
from glmtune.cli import main
from glmtune.cli import version_cmd


def _expected_line() -> str:
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CUDA cpu"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "none"
    return (f"glmtune {__version__} | torch {torch.__version__} | transformers {metadata.version('transformers')}"
            f" | triton {triton} | {cuda} | GPU {gpu}")


def test_dash_dash_version_prints_one_line_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code in (0, None)
    out = capsys.readouterr().out
    if torch.cuda.device_count() <= 1:
        assert out == _expected_line() + "\n"
    assert out.count("\n") == 1 and out.startswith(f"glmtune {__version__} | torch ")


def test_version_command_prints_the_same_line(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out == version_cmd.version_line() + "\n"


def test_missing_triton_and_a_gpu_are_named(monkeypatch):
    real = metadata.version

    def version(name):
        if "triton" in name:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(version_cmd.metadata, "version", version)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    fields = version_cmd.version_line().split(" | ")
    assert fields[3:] == ["triton none", "CUDA 12.8", "GPU NVIDIA H100 80GB HBM3 x 8"]
