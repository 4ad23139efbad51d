"""`glmtune inspect`: tables, JSON, and `--verify` on good and damaged checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from glmtune.checkpoint.hf_io import INDEX_NAME
from glmtune.cli import main
from glmtune.cli.inspect_cmd import format_indices
from tests.checkpoint_fixtures import Q_A


def shard_of(ckpt: Path, key: str) -> str:
    return json.loads((ckpt / INDEX_NAME).read_text())["weight_map"][key]


def test_inspect_glm5_tables(capsys):
    assert main(["inspect", "glm5"]) == 0
    out = capsys.readouterr().out
    for text in ("743,911,199,232", "743.91B", "753,864,119,552", "753.86B", "40,833,126,912", "40.83B",
                 "0–2", "3–77", "routed_experts", "MLA attention", "19,200"):
        assert text in out, text


def test_inspect_json(capsys):
    assert main(["inspect", "glm5", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["source"] == "glm5"
    assert payload["total_params"] == 743_911_199_232
    assert payload["total_params_with_mtp"] == 753_864_119_552
    assert payload["active_params"] == 40_833_126_912
    assert payload["architecture"]["num_hidden_layers"] == 78
    assert payload["architecture"]["moe"]["n_routed_experts"] == 256
    assert [r["label"] for r in payload["layer_runs"]] == ["0–2: dense, full", "3–77: MoE, full",
                                                           "78: MoE, full (MTP)"]
    assert sum(payload["params_by_group"].values()) == payload["total_params_with_mtp"]
    assert "verify" not in payload


def test_inspect_glm52(capsys):
    assert main(["inspect", "glm5.2", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["total_params"] == 743_377_000_704
    assert payload["total_params_with_mtp"] == 753_329_921_024
    assert len(payload["architecture"]["indexer"]["full_layers"]) == 21
    assert main(["inspect", "glm5.2"]) == 0
    out = capsys.readouterr().out
    assert "18 full, 57 shared" in out and "6, 10, …, 74" in out


def test_format_indices():
    assert format_indices([0, 1, 2, 6, 10, 14, 18]) == "0–2, 6, 10, …, 18"
    assert format_indices([0, 2]) == "0, 2"
    assert format_indices([]) == ""


def test_inspect_directory_and_verify_ok(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    assert "2,241,440" in capsys.readouterr().out  # tiny total with MTP
    assert main(["inspect", str(ckpt), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "problem" not in out


def test_verify_json(ckpt, capsys):
    (ckpt / shard_of(ckpt, Q_A)).unlink()
    assert main(["inspect", str(ckpt), "--verify", "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["verify"]["ok"] is False
    assert payload["verify"]["problems"][0]["file"] == shard_of(ckpt, Q_A)
    assert payload["total_params"] == 1_921_664


def _delete(ckpt: Path) -> tuple[str, str | None]:
    shard = shard_of(ckpt, Q_A)
    (ckpt / shard).unlink()
    return shard, "missing"


def _truncate(ckpt: Path) -> tuple[str, str | None]:
    shard = shard_of(ckpt, Q_A)
    (ckpt / shard).write_bytes((ckpt / shard).read_bytes()[:-5])
    return shard, "truncated"


def _rename(ckpt: Path) -> tuple[str, str | None]:
    shard = shard_of(ckpt, Q_A)
    tensors = load_file(ckpt / shard)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors.pop(Q_A)
    save_file(tensors, ckpt / shard)
    index = json.loads((ckpt / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.weight"] = index["weight_map"].pop(Q_A)
    (ckpt / INDEX_NAME).write_text(json.dumps(index))
    return shard, "model.layers.0.self_attn.q_proj.weight: unexpected"


def _reshape(ckpt: Path) -> tuple[str, str | None]:
    shard = shard_of(ckpt, Q_A)
    tensors = load_file(ckpt / shard)
    tensors[Q_A] = tensors[Q_A][:, :100].contiguous()
    save_file(tensors, ckpt / shard)
    return shard, f"{Q_A}: shape (64, 100), expected (64, 128)"


@pytest.mark.parametrize("damage", [_delete, _truncate, _rename, _reshape])
def test_verify_fails_on_damage(ckpt, capsys, damage):
    shard, needle = damage(ckpt)
    assert main(["inspect", str(ckpt), "--verify"]) == 1
    out = capsys.readouterr().out
    problem_lines = [line for line in out.splitlines() if line.startswith(shard)]
    assert problem_lines, out
    assert any(needle in line for line in problem_lines), out
    assert "problem" in out


def test_verify_renamed_key_names_missing_key(ckpt, capsys):
    _rename(ckpt)
    assert main(["inspect", str(ckpt), "--verify"]) == 1
    assert f"{INDEX_NAME}: {Q_A}: missing" in capsys.readouterr().out


def test_verify_broken_config(ckpt, capsys):
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    assert main(["inspect", str(ckpt), "--verify"]) == 1
    assert "config.json: does not load" in capsys.readouterr().out


def test_verify_needs_directory(capsys):
    assert main(["inspect", "glm5", "--verify"]) == 2
    assert "--verify needs a checkpoint directory" in capsys.readouterr().err


def test_unknown_model(capsys):
    assert main(["inspect", "no-such-model"]) == 2
    assert "neither a model preset" in capsys.readouterr().err


# -- special files (issue 44, re-test M6): named for what they are, never opened to wait on ----
def _fifo_in_place_of(ckpt: Path, name: str) -> None:
    if (ckpt / name).exists():
        (ckpt / name).unlink()
    os.mkfifo(ckpt / name)


def test_a_fifo_config_json_is_said_to_be_one(ckpt, capsys):
    _fifo_in_place_of(ckpt, "config.json")
    assert main(["inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt / 'config.json'} is a FIFO (named pipe), not a regular file" in err and "no config.json" not in err
    assert main(["inspect", str(ckpt), "--verify"]) == 1
    assert "config.json: does not load: " in (out := capsys.readouterr().out) and "is a FIFO (named pipe)" in out


@pytest.mark.parametrize("name", ["tokenizer.json", INDEX_NAME, "model-00002-of-00008.safetensors"])
def test_a_fifo_among_the_checkpoint_files_is_said_to_be_one(ckpt, capsys, name):
    _fifo_in_place_of(ckpt, name)
    assert main(["inspect", str(ckpt), "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"{name}: is a FIFO (named pipe), not a regular file" in out, out
