"""`glmtune release` and `release verify` with what is not a regular file inside a shipped artifact: a
FIFO, a socket, a link to nothing, in place of a file the engine reads or beside it. release refuses
it in one line naming it (never skips it, never waits on it) and writes nothing; verify reports one
that appeared after the release (DRIFT, exit 1), a recorded file replaced by a FIFO included."""

from __future__ import annotations

import os
import socket

import pytest

from glmtune.cli import main

ENGINE = ["--engine", "vllm==0.11.0"]


def _make(path, kind, monkeypatch):
    if os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to nothing":
        path.symlink_to(path.parent / "gone")
    else:  # bound by its relative name: a tmp path can exceed the 108 bytes of a socket address
        monkeypatch.chdir(path.parent)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        sock.close()
    return {"fifo": "a FIFO (named pipe)", "socket": "a socket", "link to nothing": "a link to nothing"}[kind]


def _release(capsys, run, eval_dir, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["release", str(run), "--eval", str(eval_dir), *ENGINE, *extra])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


@pytest.mark.parametrize("kind", ["fifo", "socket", "link to nothing"])
@pytest.mark.parametrize("where", ["hf/tokenizer_config.json", "hf/extra.bin"])
def test_release_refuses_a_special_file_in_the_checkpoint(sft_run, capsys, monkeypatch, kind, where):
    run, eval_dir = sft_run
    what = _make(run / where, kind, monkeypatch)
    code, err = _release(capsys, run, eval_dir)
    name = where.split("/")[-1]
    assert code == 2 and err.count("\n") == 1, err
    assert f"{name} is {what}, not a regular file (a release records regular files only" in err, err
    assert not (run / "release.json").exists()


def test_release_refuses_a_fifo_in_the_adapter_and_in_the_data(lora_run, capsys, monkeypatch):
    run, eval_dir = lora_run
    for where in ("adapter_per_expert/adapter_config.json", "data/notes.jsonl"):
        _make(run / where, "fifo", monkeypatch)
        code, err = _release(capsys, run, eval_dir)
        assert code == 2 and f"{where.split('/')[-1]} is a FIFO (named pipe), not a regular file" in err, err
        assert not (run / "release.json").exists()
        (run / where).unlink()


def test_verify_reports_a_special_file_that_appears_after_the_release(sft_run, capsys, monkeypatch):
    run, eval_dir = sft_run
    assert _release(capsys, run, eval_dir, "--allow-failed-gates")[0] == 0
    release = str(run / "release.json")
    assert main(["release", "verify", release, "--allow-outside"]) == 0
    capsys.readouterr()
    config = run / "hf" / "tokenizer_config.json"
    saved = config.read_bytes()
    _make(config, "fifo", monkeypatch)  # a recorded file replaced: named as what it is, not waited on
    _make(run / "hf" / "extra.json", "socket", monkeypatch)  # a new entry of a directory artifact
    assert main(["release", "verify", release, "--allow-outside"]) == 1
    out = capsys.readouterr().out
    checkpoint = next(line for line in out.splitlines() if line.startswith("checkpoint "))
    assert "DRIFT" in checkpoint and "tokenizer_config.json is a FIFO (named pipe), not a regular file" in checkpoint
    assert "extra.json is a socket, not a regular file" in checkpoint
    tokenizer = next(line for line in out.splitlines() if line.startswith("tokenizer "))
    assert "tokenizer_config.json is a FIFO (named pipe), not a regular file" in tokenizer, out
    assert "clean" not in out.splitlines()[-1]
    config.unlink()
    config.write_bytes(saved)
    (run / "hf" / "extra.json").unlink()
    assert main(["release", "verify", release, "--allow-outside"]) == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root lists any directory")
def test_release_refuses_a_directory_it_cannot_list(lora_run, capsys):
    run, eval_dir = lora_run
    hidden = run / "adapter" / "more"
    hidden.mkdir()
    (hidden / "weights.bin").write_bytes(b"x")
    hidden.chmod(0)
    try:
        code, err = _release(capsys, run, eval_dir)
    finally:
        hidden.chmod(0o755)
    assert code == 2 and "more/ cannot be listed (Permission denied)" in err, err
