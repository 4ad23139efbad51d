"""merge, export, data synth and data prepare never destroy what they did not create: each refusal
is one sentence and changes nothing (the whole tree is hashed before and after); --overwrite
replaces atomically with nothing left hidden; outputs are 0644 under umask 022; merge checks the
base the adapter records (--force to merge anyway)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune.checkpoint import hf_io
from glmtune import load_pretrained
from glmtune.cli import main
from glmtune.io.output_owner import RECORD
from glmtune.models.registry import hf_dir_identity
from glmtune.peft import apply_lora, export_adapter
from glmtune.peft.merge import merge_to_dir
from tests.checkpoint_fixtures import Q_A, weight_map
from tests.peft.conftest import lora_cfg, randomize_adapters
from tests.peft.test_lora_export_cmd import _trained_run
from tests.train.run_helpers import WITH_EXPORT, shared_run
from tests.tree_snapshot import changes, snapshot

OVERWRITE_HINT = "pass --overwrite to replace it (or choose another directory)"
Q_B = "model.layers.0.self_attn.q_b_proj.weight"  # adapted below
INPUT_HINT = "which this command reads; choose another directory (--overwrite never replaces an input)"
NOT_ITS_OWN = "--overwrite replaces only what glmtune {} wrote: choose another {}, or move it away"


@pytest.fixture(scope="module")
def adapter_dir(saved, tmp_path_factory):
    """An adapter trained (randomized) on the tiny base `saved`, recording that base's identity."""
    model = load_pretrained(saved, dtype=torch.float32)
    apply_lora(model, lora_cfg(target_modules=["*.o_proj", "*.q_b_proj"]))
    randomize_adapters(model)
    return export_adapter(model, tmp_path_factory.mktemp("adapter") / "adapter",
                          base_identity=hf_dir_identity(saved))


@pytest.fixture
def work(saved, adapter_dir, tmp_path):
    """tmp_path holding base/ and adapter/ copies, the tree each test hashes whole."""
    return shutil.copytree(saved, tmp_path / "base"), shutil.copytree(adapter_dir, tmp_path / "adapter")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "run"
    _trained_run(path)
    return path


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and stderr of `glmtune ARGV` run in-process."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


def refused(capsys, root, argv, message):
    """`glmtune ARGV` exits 2 with the one-line `message` and changes nothing under `root`."""
    before = snapshot(root)
    code, err = cli(capsys, *argv)
    # `glmtune data synth: error: ...`: the CLI may name the data action too
    assert code == 2 and re.fullmatch(rf"glmtune {argv[0]}( \w+)?: error: {re.escape(message)}", err), err
    assert changes(before, snapshot(root)) == []


def _old_out(path):
    path.mkdir()
    (path / "notes.txt").write_text("the user's")
    return path


def test_merge_onto_a_directory_it_did_not_write_is_refused_even_with_overwrite(work, tmp_path, capsys):
    base, adapter = work
    out = _old_out(tmp_path / "out")
    problem = (f"is a directory glmtune merge did not write: it has no {RECORD} and is not an HF checkpoint glmtune "
               "wrote; --overwrite replaces only what glmtune merge wrote: choose another directory, or move it away")
    refused(capsys, tmp_path, ["merge", base, adapter, out], f"OUT_DIR {out} already exists and is not empty, and "
                                                              + problem)
    refused(capsys, tmp_path, ["merge", base, adapter, out, "--overwrite"], f"OUT_DIR {out} {problem}")


def test_merge_out_equal_to_base_is_refused_even_with_overwrite(work, tmp_path, capsys):
    base, adapter = work
    refused(capsys, tmp_path, ["merge", base, adapter, base, "--overwrite"], f"OUT_DIR {base} is BASE_DIR {base}, "
                                                                             + INPUT_HINT)


def test_merge_out_inside_adapter_is_refused(work, tmp_path, capsys):
    base, adapter = work
    out = adapter / "merged"
    refused(capsys, tmp_path, ["merge", base, adapter, out], f"OUT_DIR {out} is inside ADAPTER_DIR {adapter}, "
                                                             + INPUT_HINT)


def test_merge_overwrite_replaces_its_own_output_whole_with_nothing_hidden(work, tmp_path, capsys):
    base, adapter = work
    out = tmp_path / "out"
    assert cli(capsys, "merge", base, adapter, out) == (0, "")
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert shards == [hf_io.SINGLE_NAME] and json.loads((out / RECORD).read_text())["command"] == "merge"
    refused(capsys, tmp_path, ["merge", base, adapter, out], f"OUT_DIR {out} already exists and is not empty; "
                                                              + OVERWRITE_HINT)
    before = snapshot(tmp_path, ignore=("out",))
    assert cli(capsys, "merge", base, adapter, out, "--overwrite", "--max-shard-size", "1MB") == (0, "")
    assert changes(before, snapshot(tmp_path, ignore=("out",))) == []
    assert sorted(os.listdir(tmp_path)) == ["adapter", "base", "out"]  # no .out.tmp-* / .out.old-*
    assert not any((out / name).exists() for name in shards) and set(weight_map(out)) == set(weight_map(base))
    assert not torch.equal(_tensor(out, Q_B), _tensor(base, Q_B))  # the merged weights


def _tensor(ckpt, key):
    return load_file(ckpt / weight_map(ckpt)[key])[key]


def test_merge_failure_mid_write_keeps_the_old_out(work, tmp_path, monkeypatch):
    base, adapter = work
    out = _old_out(tmp_path / "out")  # the library call names no command: plain overwrite
    before = snapshot(tmp_path)
    real_save, calls = hf_io.save_file, []

    def save_then_fail(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(*args, **kwargs)

    monkeypatch.setattr(hf_io, "save_file", save_then_fail)
    with pytest.raises(OSError, match="No space left"):
        merge_to_dir(base, adapter, out, max_shard_size="1MB", overwrite=True)
    assert len(calls) == 2 and changes(before, snapshot(tmp_path)) == []


def test_max_shard_size_not_a_size_names_the_option(work, tmp_path, capsys):
    base, adapter = work
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["merge", str(base), str(adapter), str(tmp_path / "out"), "--max-shard-size", "banana"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "glmtune merge: error: argument --max-shard-size: 'banana' is not a size; use a number of bytes or e.g. "
        "500MB, 5GB")
    assert changes(before, snapshot(tmp_path)) == []


def test_merge_onto_another_base_of_the_same_shape_needs_force(work, tmp_path, capsys):
    base, adapter = work
    file = base / weight_map(base)[Q_A]
    tensors = load_file(file)
    tensors[Q_A] = tensors[Q_A] * 2  # same shape and dtype: only the recorded hash tells them apart
    save_file(tensors, file, metadata={"format": "pt"})
    found = hf_dir_identity(base)["weights_sha256"]
    recorded = json.loads((adapter / "glmtune_adapter.json").read_text())["base"]["weights_sha256"]
    problem = (f"BASE_DIR {base} is not the base this adapter was trained on (weights differ: recorded sha256 "
               f"{recorded[:12]}…, found {found[:12]}…)")
    out = tmp_path / "out"
    refused(capsys, tmp_path, ["merge", base, adapter, out], f"{problem}; pass --force to merge anyway")
    assert cli(capsys, "merge", base, adapter, out, "--force") == (0, f"warning: {problem}; merging anyway (--force)")
    assert (out / hf_io.SINGLE_NAME).is_file() and sorted(os.listdir(tmp_path)) == ["adapter", "base", "out"]


def test_adapter_from_another_tool_merges_with_a_note(work, tmp_path, capsys):
    base, adapter = work
    (adapter / "glmtune_adapter.json").unlink()
    code, err = cli(capsys, "merge", base, adapter, tmp_path / "out")
    assert (code, err) == (0, f"note: ADAPTER_DIR {adapter} records no base (glmtune_adapter.json); "
                              "the base could not be checked")


def test_merged_and_exported_files_are_world_readable(work, run_dir, tmp_path, capsys, umask022):
    base, adapter = work
    assert cli(capsys, "merge", base, adapter, tmp_path / "merged")[0] == 0
    assert cli(capsys, "export", run_dir, "--adapter", tmp_path / "exported")[0] == 0
    for out in (tmp_path / "merged", tmp_path / "exported"):
        modes = {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
        assert modes == {0o644} and stat.S_IMODE(out.stat().st_mode) == 0o755, out


def test_export_replaces_only_its_own_output(run_dir, tmp_path, capsys):
    run = shutil.copytree(run_dir, tmp_path / "run")
    out_dir, out_file = _old_out(tmp_path / "out"), tmp_path / "out.txt"
    out_file.write_text("the user's")
    for flags in ([], ["--overwrite"]):
        exists = "" if flags else "already exists and is not empty, and "
        refused(capsys, tmp_path, ["export", run, "--adapter", out_dir, *flags],
                f"--adapter {out_dir} {exists}is a directory glmtune export did not write: it has no {RECORD} and is "
                "not an adapter glmtune exported; " + NOT_ITS_OWN.format("export", "directory"))
        refused(capsys, tmp_path, ["export", run, "--adapter", out_file, *flags],
                f"--adapter {out_file} {'' if flags else 'already exists, and '}is a file, not what glmtune export "
                "writes there; " + NOT_ITS_OWN.format("export", "directory"))
    ours = tmp_path / "ours"
    assert cli(capsys, "export", run, "--adapter", ours)[0] == 0
    assert sorted(os.listdir(ours)) == [RECORD, "README.md", "adapter_config.json", "adapter_model.safetensors"]
    (ours / RECORD).unlink()  # as glmtune wrote it before output records: recognized by its files
    before = snapshot(tmp_path, ignore=("ours",))
    assert cli(capsys, "export", run, "--adapter", ours, "--overwrite", "--layout", "per_expert")[0] == 0
    assert json.loads((ours / "adapter_config.json").read_text())["target_modules"] != []
    assert changes(before, snapshot(tmp_path, ignore=("ours",))) == []
    assert sorted(os.listdir(tmp_path)) == ["ours", "out", "out.txt", "run"]
    merged = tmp_path / "merged"
    (merged / "sub").mkdir(parents=True)  # not an adapter: --overwrite of export leaves it
    refused(capsys, tmp_path, ["export", run, "--adapter", merged, "--overwrite"],
            f"--adapter {merged} is a directory glmtune export did not write: it has no {RECORD} and is not an "
            "adapter glmtune exported; " + NOT_ITS_OWN.format("export", "directory"))


def test_export_into_the_run_directory_is_refused(run_dir, tmp_path, capsys):
    run = shutil.copytree(run_dir, tmp_path / "run")
    refused(capsys, tmp_path, ["export", run, "--adapter", run, "--overwrite"], f"--adapter {run} is RUN_DIR {run}, "
                                                                                 + INPUT_HINT)


def test_synth_replaces_only_synthetic_rows(tmp_path, capsys):
    out = tmp_path / "mine.jsonl"
    out.write_text('{"id": "t-1", "group": "g", "messages": []}\n')
    for flags, exists in (([], "already exists, and "), (["--overwrite"], "")):
        refused(capsys, tmp_path, ["data", "synth", out, "--rows", "5", *flags],
                f"OUT {out} {exists}is a file glmtune data synth did not write: it is not synthetic rows; "
                + NOT_ITS_OWN.format("data synth", "path"))
    ours = tmp_path / "synth.jsonl"
    assert cli(capsys, "data", "synth", ours, "--rows", "5") == (0, "")
    refused(capsys, tmp_path, ["data", "synth", ours, "--rows", "5"],
            f"OUT {ours} already exists; pass --overwrite to replace it (or choose another path)")
    assert cli(capsys, "data", "synth", ours, "--rows", "7", "--overwrite") == (0, "")
    assert len(ours.read_text().splitlines()) == 7 and sorted(os.listdir(tmp_path)) == ["mine.jsonl", "synth.jsonl"]


@pytest.mark.parametrize("case", ["file", "non-empty", "inside-input"])
def test_prepare_out_that_would_destroy_data_is_refused(tmp_path, capsys, case):
    data = tmp_path / "data"
    data.mkdir()
    assert cli(capsys, "data", "synth", data / "train.jsonl", "--rows", "40")[0] == 0
    out = {"file": tmp_path / "out", "non-empty": tmp_path / "out", "inside-input": data / "prepared"}[case]
    if case == "file":
        out.write_text("the user's")
        message = (f"--out {out} already exists, and is a file, not what glmtune data prepare writes there; "
                   + NOT_ITS_OWN.format("data prepare", "directory"))
    elif case == "non-empty":
        _old_out(out)
        message = (f"--out {out} already exists and is not empty, and is a directory glmtune data prepare did not "
                   f"write: it has no {RECORD} and is not a prepared dataset; "
                   + NOT_ITS_OWN.format("data prepare", "directory"))
    else:
        message = f"--out {out} is inside input {data}, " + INPUT_HINT
    refused(capsys, tmp_path, ["data", "prepare", data, "--out", out], message)


# --- a run directory's own files: no command but its training writes them (glmtune/io/outputs.py) -----------

SUITE = "recipes/tiny/eval_support_json.yaml"


@pytest.fixture(scope="module")
def sft_source(shared_results):
    return shared_run(shared_results, *WITH_EXPORT).run_dir


@pytest.fixture
def sft_copy(sft_source, tmp_path):
    """A finished full fine-tuning run, its checkpoints included."""
    return shutil.copytree(sft_source, tmp_path / "run", symlinks=True)


def _run_refusal(run, target, command, writes):
    rel = os.path.relpath(target, run) if target != run else "."
    where = "is a glmtune run directory" if target == run else f"is inside the glmtune run directory {run}"
    return f"{target} {where} ({rel}: the run's, and glmtune {command} writes {writes}); choose another "


@pytest.mark.parametrize("place", ["checkpoints", "checkpoints/step-00000004", "tensorboard", "eval", "metrics.jsonl",
                                   "data", "hf/sub", "notes", "."])
def test_eval_never_writes_over_a_runs_own_files(sft_copy, tmp_path, capsys, place):
    run = sft_copy
    target = run / place if place != "." else run
    before = snapshot(tmp_path)
    code, err = cli(capsys, "eval", SUITE, "--base", run, "--candidate", run, "--out", target, "--overwrite")
    assert code == 2 and len(err.splitlines()) == 1, err
    if place in ("data", "hf/sub", "."):  # what eval reads: refused as its input first
        assert "which this command reads" in err, err
    else:
        assert f"--out {_run_refusal(run, target, 'eval', f'{run}/eval/NAME')}directory" in err, err
    assert changes(before, snapshot(tmp_path)) == []


def test_eval_replaces_only_an_eval_directory_inside_the_run(sft_copy, tmp_path, capsys):
    run = sft_copy
    exported = run / "eval" / "adapter-copy"
    shutil.copytree(run / "hf", exported)  # not an eval's output, though under RUN/eval
    before = snapshot(tmp_path)
    code, err = cli(capsys, "eval", SUITE, "--base", run, "--candidate", run, "--out", exported, "--overwrite")
    assert code == 2 and f"--out {exported} holds the output of glmtune train (path, says its {RECORD})" in err, err
    (exported / RECORD).unlink()
    before = snapshot(tmp_path)
    code, err = cli(capsys, "eval", SUITE, "--base", run, "--candidate", run, "--out", exported, "--overwrite")
    assert code == 2 and (f"--out {exported} is a directory glmtune eval did not write: it has no {RECORD} and is "
                          "not an eval directory (scorecard.json)") in err, err
    assert changes(before, snapshot(tmp_path)) == []


@pytest.mark.parametrize("argv, option, command, kind", [
    (["data", "synth", "{run}/metrics.jsonl", "--overwrite"], "OUT", "data synth", "path"),
    (["data", "synth", "{run}/data/more.jsonl", "--overwrite"], "OUT", "data synth", "path"),
    (["data", "prepare", "{data}", "--out", "{run}/tensorboard", "--overwrite"], "--out", "data prepare", "directory"),
    (["merge", "{run}/base", "{adapter}", "{run}/checkpoints", "--overwrite"], "OUT_DIR", "merge", "directory"),
])
def test_no_other_command_writes_inside_a_run_directory(sft_copy, adapter_dir, tmp_path, capsys, argv, option,
                                                         command, kind):
    run = sft_copy
    data = tmp_path / "raw"
    data.mkdir()
    (data / "train.jsonl").write_text((run / "data").glob("train-*.jsonl").__next__().read_text())
    argv = [a.format(run=run, data=data, adapter=adapter_dir) for a in argv]
    target = Path(argv[argv.index(option) + 1] if option.startswith("--") else argv[-2])  # OUT, OUT_DIR
    before = snapshot(tmp_path)
    code, err = cli(capsys, *argv)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{option} {_run_refusal(run, target, command, 'nothing inside a run directory')}{kind}" in err, err
    assert changes(before, snapshot(tmp_path)) == []
