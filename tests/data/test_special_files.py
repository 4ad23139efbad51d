"""A FIFO, a socket, a device or a directory where a data file belongs is refused in one sentence
naming it, before anything opens it: `open()` of a FIFO waits for a writer forever, and
/dev/zero never ends. The commands run in a subprocess with a timeout, so code that would
block fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.data.chat_template import load_chat_template
from glmtune.data.prepare import split_files
from glmtune.data.sources import file_sha256
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, resolve_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
GUARD_S = 120  # a blocked read fails here; a working refusal returns in about a second


def _glmtune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    try:
        return subprocess.run([sys.executable, "-m", "glmtune", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=GUARD_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"glmtune {' '.join(args)} blocked on a special file ({GUARD_S} s)")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))  # the socket file stays after the socket closes
    server.close()
    return path


def _layout(kind: str, tmp: Path) -> tuple[list[str], str]:
    """The command's arguments and the special file it must name."""
    good = tmp / "good.jsonl"
    good.write_text(json.dumps(ROW) + "\n")
    if kind == "fifo jsonl":
        return ["data", "validate", str(_fifo(tmp / "pipe.jsonl"))], f"data file {tmp / 'pipe.jsonl'} is a FIFO"
    if kind == "fifo parquet":
        return ["data", "validate", str(_fifo(tmp / "pipe.parquet"))], f"{tmp / 'pipe.parquet'} is a FIFO"
    if kind == "fifo in a folder":
        (tmp / "folder").mkdir()
        (tmp / "folder" / "a.jsonl").write_text(json.dumps(ROW) + "\n")
        _fifo(tmp / "folder" / "b.jsonl")
        return ["data", "validate", str(tmp / "folder")], f"{tmp / 'folder' / 'b.jsonl'} is a FIFO"
    if kind == "folder named like a file":
        (tmp / "folder").mkdir()
        (tmp / "folder" / "a.jsonl").mkdir()
        return ["data", "validate", str(tmp / "folder")], f"{tmp / 'folder' / 'a.jsonl'} is a directory"
    if kind == "endless device":
        (tmp / "zero.jsonl").symlink_to("/dev/zero")
        return ["data", "validate", str(tmp / "zero.jsonl")], "zero.jsonl is a character device"
    if kind == "socket":
        return ["data", "validate", str(_socket(tmp / "s.jsonl"))], f"{tmp / 's.jsonl'} is a socket"
    if kind == "fifo schema":
        return (["data", "validate", str(good), "--schema", str(_fifo(tmp / "schema.json"))],
                f"schema file {tmp / 'schema.json'} is a FIFO")
    if kind == "fifo prepare":
        return (["data", "prepare", str(_fifo(tmp / "pipe.jsonl")), "--out", str(tmp / "out")],
                f"data file {tmp / 'pipe.jsonl'} is a FIFO")
    assert kind == "fifo config"
    return ["config", "validate", str(_fifo(tmp / "recipe.yaml"))], f"{tmp / 'recipe.yaml'} is a FIFO"


# Those whose read would block (or never end) before the fix run in a subprocess with a guard.
BLOCKING = ["fifo jsonl", "fifo parquet", "fifo in a folder", "endless device", "fifo prepare"]


@pytest.mark.parametrize("kind", BLOCKING + ["folder named like a file", "socket", "fifo schema", "fifo config"])
def test_command_refuses_a_special_file_in_one_line(kind, tmp_path, capsys):
    args, named = _layout(kind, tmp_path)
    if kind in BLOCKING:
        done = _glmtune(*args, cwd=tmp_path)
        code, out, err = done.returncode, done.stdout, done.stderr
    else:
        code, (out, err) = main(args), capsys.readouterr()
    # `config validate` reports each recipe on stdout (FAIL, then the reason) and exits 1.
    status, said = (1, out.splitlines()[1:]) if kind == "fifo config" else (2, err.splitlines())
    assert code == status, (code, out, err)
    assert len(said) == 1 and named in said[0] and "not a regular file" in said[0], said
    assert "Traceback" not in err


def _copy_tokenizer(dest: Path) -> Path:
    dest.mkdir()
    for file in TINY_TOKENIZER_DIR.iterdir():
        if file.is_file():
            (dest / file.name).write_bytes(file.read_bytes())
    return dest


def test_a_special_file_in_a_tokenizer_or_template_directory_is_refused_not_skipped(tmp_path):
    tokenizer = _copy_tokenizer(tmp_path / "tok")
    (tokenizer / "tokenizer.json").unlink()
    _fifo(tokenizer / "tokenizer.json")  # transformers would open it and wait
    with pytest.raises(ValueError, match=r"tokenizer directory entry .*tokenizer\.json is a FIFO"):
        resolve_tokenizer_dir(tokenizer)
    # A FIFO chat_template.jinja is refused, not passed over for another template.
    _fifo(tmp_path / "chat_template.jinja")
    with pytest.raises(ValueError, match=r"chat template .*chat_template\.jinja is a FIFO"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").mkdir()
    with pytest.raises(ValueError, match=r"tokenizer config .*tokenizer_config\.json is a directory"):
        load_chat_template(tmp_path)


def test_prepared_manifest_and_hashes_refuse_special_files(tmp_path):
    _fifo(tmp_path / "manifest.json")
    with pytest.raises(ValueError, match=r"prepared data manifest .*manifest\.json is a FIFO"):
        split_files(tmp_path)
    with pytest.raises(ValueError, match=r"data file .*manifest\.json is a FIFO"):
        file_sha256(tmp_path / "manifest.json")  # was the hash of nothing
