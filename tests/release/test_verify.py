"""`glmtune release verify`: clean is exit 0; a flipped adapter byte, a deleted file, an added file,
a size change and a hand-edited manifest are each named on their artifact's line, exit 1.

The fixtures' eval directories lie beside the run, outside the release file's directory, so
their roots are absolute: read only with --allow-outside (tests/release/test_verify_paths.py)."""

from __future__ import annotations

import json
import shutil

from glmtune.cli import main


def _verify(capsys, path) -> tuple[int, dict[str, str]]:
    code = main(["release", "verify", str(path), "--allow-outside"])
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line for line in lines[:-1]}
    return code, {**by_name, "verdict": lines[-1]}


def test_verify_catches_drift(lora_run, capsys):
    run, eval_dir = lora_run
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0
    capsys.readouterr()
    release = run / "release.json"
    code, lines = _verify(capsys, release)
    assert code == 0 and lines["verdict"].endswith("clean (11 artifacts, 28 files)"), lines
    assert all(" ok " in line for name, line in lines.items() if name != "verdict")
    assert "unsigned: integrity only" in lines["release.json"]

    # One flipped byte in the middle of the adapter's weights: same size, another sha256.
    weights = run / "adapter" / "adapter_model.safetensors"
    original = weights.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    weights.write_bytes(bytes(flipped))
    code, lines = _verify(capsys, release)
    assert code == 1 and "DRIFT in 1 of 12" in lines["verdict"]
    assert "DRIFT" in lines["adapter"] and "adapter_model.safetensors sha256 changed" in lines["adapter"]
    assert all(" ok " in line for name, line in lines.items() if name not in ("adapter", "verdict"))
    weights.write_bytes(original)
    assert _verify(capsys, release)[0] == 0

    # A deleted data file, a file added to the base directory, a truncated tokenizer file.
    train_file = next((run / "data").glob("train-*.jsonl"))
    train_file.unlink()
    (run / "base" / "extra.safetensors").write_bytes(b"x")
    (run / "base" / ".hidden-note").write_text("hidden entries are not part of an artifact")
    tokenizer = run / "base" / "tokenizer_config.json"
    tokenizer.write_text(tokenizer.read_text()[:-10])
    code, lines = _verify(capsys, release)
    assert code == 1 and "DRIFT in 3 of 12" in lines["verdict"]
    assert f"{train_file.name} is missing" in lines["data"]
    assert "extra.safetensors is new (not recorded)" in lines["base"] and "hidden" not in lines["base"]
    assert "tokenizer_config.json size changed" in lines["base"]
    assert "tokenizer_config.json size changed" in lines["tokenizer"]

    # A whole artifact gone, and --json.
    shutil.rmtree(run / "adapter_per_expert")
    assert main(["release", "verify", str(release), "--json", "--allow-outside"]) == 1
    result = json.loads(capsys.readouterr().out)
    problems = {a["name"]: a["problems"] for a in result["artifacts"]}
    assert result["clean"] is False and problems["adapter_per_expert"] == [
        f"directory {run / 'adapter_per_expert'} is missing"]
    assert problems["adapter"] == [] and problems["eval"] == []


def test_verify_moved_run_and_edited_manifest(sft_run, tmp_path, capsys):
    run, eval_dir = sft_run
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0
    capsys.readouterr()
    # The run moves with its release (roots inside it are relative); the eval dir stays where it was.
    moved = tmp_path / "moved"
    shutil.move(run, moved)
    code, lines = _verify(capsys, moved / "release.json")
    assert code == 0, lines
    # A threshold edited by hand no longer matches the id.
    manifest = json.loads((moved / "release.json").read_text())
    manifest["rollback"]["triggers"][0]["threshold"] = 0.0
    (moved / "release.json").write_text(json.dumps(manifest, indent=2))
    code, lines = _verify(capsys, moved / "release.json")
    assert code == 1 and "content does not match its id" in lines["release.json"]
