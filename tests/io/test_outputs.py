"""glmtune.io.outputs: refuse what would destroy data, replace atomically, leave nothing hidden,
write with the user's permissions; glmtune.io.sizes: sizes or one clear sentence."""

from __future__ import annotations

import argparse
import json
import os
import stat

import pytest

from glmtune.checkpoint.hf_io import TOKENIZER_FILES
from glmtune.io import outputs
from glmtune.io.output_owner import HF_SIDE_FILES, RECORD
from glmtune.io.outputs import check_output, output_dir, output_file
from glmtune.io.run_lock import LOCK_FILE, RunLock, write_run_record
from glmtune.io.sizes import parse_size, size_arg
from tests.tree_snapshot import changes, snapshot


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture(params=["exchange", "rename-aside"])
def swap(request, monkeypatch):
    """Both ways of replacing a directory: renameat2 RENAME_EXCHANGE, and the fallback without it."""
    if request.param == "exchange":
        assert outputs._renameat2() is not None  # Linux + glibc: the atomic swap is really used
    else:
        monkeypatch.setattr(outputs, "_renameat2", lambda: None)
    return request.param


def _old_dir(path):
    path.mkdir()
    (path / "keep.txt").write_text("user data")
    return path


def test_new_directory_appears_whole_with_user_permissions(tmp_path, umask022):
    target = tmp_path / "deep" / "out"
    with output_dir(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".out.tmp-") and not target.exists()
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "w.bin").write_bytes(b"x")
        os.chmod(tmp / "sub" / "w.bin", 0o600)  # what mkstemp / safetensors leave
    assert (target / "sub" / "w.bin").read_bytes() == b"x"
    modes = {p.relative_to(target).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in target.rglob("*")}
    assert modes == {"sub": 0o755, "sub/w.bin": 0o644} and stat.S_IMODE(target.stat().st_mode) == 0o755
    assert os.listdir(target.parent) == ["out"]


def test_umask_is_respected(tmp_path):
    old = os.umask(0o027)
    try:
        with output_file(tmp_path / "f.jsonl") as tmp:
            tmp.write_text("{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f.jsonl").stat().st_mode) == 0o640


def test_empty_directory_is_used_and_non_empty_one_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with output_dir(tmp_path / "empty") as tmp:
        (tmp / "a").write_text("a")
    assert (tmp_path / "empty" / "a").read_text() == "a"
    before = snapshot(tmp_path)
    message = (f"OUT_DIR {tmp_path / 'empty'} already exists and is not empty; pass --overwrite to replace it "
               "(or choose another directory)")
    with pytest.raises(ValueError) as info, output_dir(tmp_path / "empty", what="OUT_DIR"):
        pytest.fail("the body must not run")
    assert str(info.value) == message
    assert changes(before, snapshot(tmp_path)) == []


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_wrong_kind_of_existing_target_needs_overwrite(tmp_path, kind, swap):
    target = tmp_path / "t"
    if kind == "dir":  # a directory output where a file is
        target.write_text("user file")
        expected = "is an existing file, not a directory; pass --overwrite to replace it (or choose another directory)"
    else:  # a file output where a (even empty) directory is
        target.mkdir()
        expected = "is an existing directory, not a file; pass --overwrite to replace it (or choose another path)"
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="^OUT .*/t " + expected.replace("(", r"\(").replace(")", r"\)") + "$"):
        check_output(target, kind=kind)
    assert changes(before, snapshot(tmp_path)) == []
    stage = output_dir if kind == "dir" else output_file
    with stage(target, overwrite=True) as tmp:
        (tmp / "new" if kind == "dir" else tmp).write_text("new")
    assert (target / "new" if kind == "dir" else target).read_text() == "new"
    assert os.listdir(tmp_path) == ["t"]


def test_existing_file_refused_then_replaced(tmp_path, umask022):
    target = tmp_path / "data.jsonl"
    target.write_text("mine\n")
    with pytest.raises(ValueError, match=r"^OUT .*data.jsonl already exists; pass --overwrite to replace it"):
        with output_file(target):
            pass
    assert target.read_text() == "mine\n"
    with output_file(target, overwrite=True) as tmp:
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o600  # mkstemp's: normalized on publish
        tmp.write_text("new\n")
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["data.jsonl"]


@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink"])
def test_a_source_is_never_the_target_even_with_overwrite(tmp_path, where):
    base = _old_dir(tmp_path / "base")
    (tmp_path / "link").symlink_to(base)
    target = {"same": base, "inside": base / "out", "contains": tmp_path, "symlink": tmp_path / "link"}[where]
    relation = {"same": "is", "inside": "is inside", "contains": "contains", "symlink": "is"}[where]
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info, output_dir(target, overwrite=True, sources=[("BASE_DIR", base)],
                                                       what="OUT_DIR"):
        pytest.fail("the body must not run")
    assert str(info.value) == (f"OUT_DIR {target} {relation} BASE_DIR {base}, which this command reads; "
                               "choose another directory (--overwrite never replaces an input)")
    assert changes(before, snapshot(tmp_path)) == []


def test_overwrite_replaces_whole_and_leaves_nothing_hidden(tmp_path, swap):
    target = _old_dir(tmp_path / "out")
    (tmp_path / "neighbour").write_text("untouched")
    with output_dir(target, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"new")
        assert (target / "keep.txt").read_text() == "user data"  # visible until the swap
    assert sorted(os.listdir(target)) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["neighbour", "out"]


def test_failure_while_writing_leaves_target_and_parents_as_they_were(tmp_path):
    target = _old_dir(tmp_path / "out")
    before = snapshot(tmp_path)
    with pytest.raises(OSError, match="disk full"), output_dir(target, overwrite=True) as tmp:
        (tmp / "half.bin").write_bytes(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"), output_file(tmp_path / "a" / "b" / "f", overwrite=True):
        raise OSError("disk full")
    assert changes(before, snapshot(tmp_path)) == []  # the created parents a/b were removed too


def test_failed_rename_in_fallback_puts_the_old_target_back(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "_renameat2", lambda: None)
    target = _old_dir(tmp_path / "out")
    before = snapshot(tmp_path)
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".out.tmp-"):  # the new output's move into place fails
            raise OSError("simulated failure")
        real_rename(src, dst)

    monkeypatch.setattr(outputs.os, "rename", rename)
    with pytest.raises(OSError, match="simulated"), output_dir(target, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert changes(before, snapshot(tmp_path)) == []


def test_target_appearing_while_writing_is_not_replaced(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="already exists and is not empty"), output_dir(target) as tmp:
        (tmp / "new").write_text("new")
        _old_dir(target)  # another process got there first
    assert os.listdir(target) == ["keep.txt"] and os.listdir(tmp_path) == ["out"]


def test_parent_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^OUT .*file/out: .*file is not a directory$"):
        with output_dir(tmp_path / "file" / "out"):
            pass


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size(" 500mb ") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5KB") == 1500 and parse_size("123") == 123
    assert parse_size(7) == 7 and parse_size("10B") == 10
    for bad in ("banana", "", "GB", "-5MB", "inf", "nan", "5 bananas"):
        with pytest.raises(ValueError, match=f"^{bad!r} is not a size; use a number of bytes or e.g. 500MB, 5GB$"):
            parse_size(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="'banana' is not a size"):
        size_arg("banana")


# --- --overwrite replaces only what the command wrote (glmtune/io/output_owner.py) ---------------------------


def _write(target, command, what="--out", kind="dir", **options):
    stage = output_dir if kind == "dir" else output_file
    with stage(target, command=command, what=what, **options) as tmp:
        (tmp / "scorecard.json" if kind == "dir" else tmp).write_text('{"format": "glmtune.scorecard/1"}\n')


def test_an_output_directory_records_its_command_and_overwrite_replaces_only_that(tmp_path):
    target = tmp_path / "out"
    _write(target, "eval")
    record = json.loads((target / RECORD).read_text())
    assert (record["format"], record["command"], record["output"]) == ("glmtune.output/1", "eval", "--out")
    _write(target, "eval", overwrite=True)  # its own output
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        _write(target, "merge", what="OUT_DIR", overwrite=True)
    assert str(info.value) == (f"OUT_DIR {target} holds the output of glmtune eval (--out, says its {RECORD}); "
                               "--overwrite replaces only what glmtune merge wrote: choose another directory, or "
                               "move it away")
    with pytest.raises(ValueError, match=r"holds the output of glmtune eval \(--out"):
        _write(target, "export", what="--out", overwrite=True)  # another command's option of the same name
    assert changes(before, snapshot(tmp_path)) == []


@pytest.mark.parametrize("case", ["user dir", "user file", "damaged record", "link", "fifo", "file for a dir"])
def test_what_the_command_did_not_write_is_refused_even_with_overwrite(tmp_path, case):
    target = tmp_path / "out"
    kind = "file" if case in ("user file", "link", "fifo") else "dir"
    if case == "user dir":
        _old_dir(target)
        problem = (f"is a directory glmtune eval did not write: it has no {RECORD} and is not an eval directory "
                   "(scorecard.json)")
    elif case == "damaged record":
        _old_dir(target)
        (target / RECORD).write_text("[[[")
        problem = f"holds a damaged {RECORD} ("
    elif case in ("user file", "file for a dir"):
        target.write_text('{"mine": 1}\n')
        problem = ("is a file glmtune release did not write: it is not a release manifest" if kind == "file"
                   else "is a file, not what glmtune eval writes there")
    elif case == "link":
        (tmp_path / "real.json").write_text('{"format": "glmtune.release/1"}')
        target.symlink_to(tmp_path / "real.json")
        problem = "is a symbolic link (glmtune writes none there)"
    else:
        os.mkfifo(target)
        problem = "is a FIFO (named pipe), not what glmtune release writes there"
    command = "release" if kind == "file" else "eval"
    before = _lstat_tree(tmp_path)  # not snapshot(): reading the FIFO would block
    with pytest.raises(ValueError) as info:
        _write(target, command, kind=kind, overwrite=True)
    assert str(info.value).startswith(f"--out {target} {problem}"), info.value
    assert str(info.value).endswith(f"--overwrite replaces only what glmtune {command} wrote: choose another "
                                    f"{'directory' if kind == 'dir' else 'path'}, or move it away")
    assert _lstat_tree(tmp_path) == before


def _lstat_tree(root):
    return {p.relative_to(root).as_posix(): (p.lstat().st_ino, p.lstat().st_mtime_ns, p.lstat().st_size)
            for p in root.rglob("*")}


def test_without_overwrite_a_foreign_target_says_overwrite_would_not_help(tmp_path):
    _old_dir(tmp_path / "out")
    with pytest.raises(ValueError, match="^OUT_DIR .*/out already exists and is not empty, and is a directory glmtune "
                                         "merge did not write: .*--overwrite replaces only what glmtune merge wrote"):
        check_output(tmp_path / "out", what="OUT_DIR", command="merge")
    _write(tmp_path / "mine", "merge", what="OUT_DIR")
    with pytest.raises(ValueError, match="already exists and is not empty; pass --overwrite to replace it"):
        check_output(tmp_path / "mine", what="OUT_DIR", command="merge")


def _hf(path, *extra):
    path.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json", "generation_config.json"):
        (path / name).write_text("{}")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json", *extra):
        (path / name).write_bytes(b"x")


def _adapter(path, *extra):
    path.mkdir()
    (path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (path / "glmtune_adapter.json").write_text("{}")
    for name in ("adapter_model.safetensors", *extra):
        (path / name).write_bytes(b"x")


def _prepared(path, *extra):
    path.mkdir()
    (path / "pii_report.json").write_text('{"num_findings": 0}')
    (path / "manifest.json").write_text('{"version": "v", "outputs": {}}')
    for name in ("train-0123456789ab.jsonl", *extra):
        (path / name).write_text("{}\n")


def _scorecard(path, *extra):
    path.mkdir()
    (path / "scorecard.json").write_text('{"format": "glmtune.scorecard/1"}')
    (path / "suite.yaml").write_text("name: x\n")
    (path / "sets").mkdir()
    (path / "sets" / "tickets.jsonl").write_text("{}\n")
    for name in extra:
        (path / name).write_text("x")


def _synthetic(path, *extra):
    rows = [{"id": "synth-0-000000", "group": "cust-00000"}, {"id": "pref-3-000001", "group": "c"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "".join(extra))


def _release(path, *extra):
    path.write_text(json.dumps({"format": "glmtune.release/1", "id": "x"}) if not extra else extra[0])


# (command, option, kind, a legacy output, the same with what the command never writes)
LEGACY = [("export", "--hf", "dir", _hf, ("README.md",)), ("merge", "OUT_DIR", "dir", _hf, ("LICENSE",)),
          ("export", "--adapter", "dir", _adapter, ("notes.txt",)),
          ("data prepare", "--out", "dir", _prepared, ("raw.jsonl",)),
          ("eval", "--out", "dir", _scorecard, ("sets/notes.txt",)), ("data synth", "OUT", "file", _synthetic, ('{"id": "mine"}\n',)),
          ("release", "--out", "file", _release, ('{"format": "glmtune.scorecard/1"}',))]


@pytest.mark.parametrize("command, what, kind, make, foreign", LEGACY, ids=[c[0] + c[1] for c in LEGACY])
def test_an_output_written_before_records_is_recognized_by_its_content(tmp_path, command, what, kind, make, foreign):
    make(tmp_path / "old")
    stage = output_dir if kind == "dir" else output_file
    with stage(tmp_path / "old", overwrite=True, command=command, what=what) as tmp:
        (tmp / "new" if kind == "dir" else tmp).write_text("new")
    assert (tmp_path / "old" / "new" if kind == "dir" else tmp_path / "old").read_text() == "new"
    if not foreign:
        return
    make(tmp_path / "theirs", *foreign)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=f"did not write.*replaces only what glmtune {command} wrote"):
        check_output(tmp_path / "theirs", kind=kind, overwrite=True, command=command, what=what)
    assert changes(before, snapshot(tmp_path)) == []


def test_a_file_added_to_an_output_since_is_not_the_commands_to_replace(tmp_path):
    target = tmp_path / "out"
    _write(target, "eval")
    (target / "sets").mkdir()
    (target / "sets" / "my-notes.md").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        _write(target, "eval", overwrite=True)
    assert str(info.value).startswith(f"--out {target} holds sets (and 1 more), which glmtune eval did not write "
                                      f"there (its {RECORD} lists no such); --overwrite replaces only"), info.value
    assert changes(before, snapshot(tmp_path)) == []
    (target / "sets" / "my-notes.md").unlink()
    (target / "sets").rmdir()
    _write(target, "eval", overwrite=True)


def test_the_hf_side_files_are_the_ones_glmtune_copies():
    assert set(HF_SIDE_FILES) == set(TOKENIZER_FILES)


def _run_dir(path):
    path.mkdir()
    write_run_record(path, {"run_id": "r1"})
    (path / LOCK_FILE).write_text("released: glmtune train (pid 1)\n")
    for name in ("checkpoints/step-00000002", "hf", "tensorboard", "data"):
        (path / name).mkdir(parents=True)
    (path / "checkpoints/step-00000002/trainer_state.json").write_text("{}")
    for name in ("metrics.jsonl", "config.yaml", "samples.json"):
        (path / name).write_text("x")
    return path


@pytest.mark.parametrize("command, what, kind, place, allowed", [
    ("eval", "--out", "dir", "eval/support-json", True), ("eval", "--out", "dir", "eval/a/b", True),
    ("eval", "--out", "dir", "eval", False), ("eval", "--out", "dir", "checkpoints", False),
    ("eval", "--out", "dir", "checkpoints/new", False), ("eval", "--out", "dir", "tensorboard", False),
    ("eval", "--out", "dir", "hf", False), ("eval", "--out", "dir", ".", False),
    ("release", "--out", "file", "release.json", True), ("release", "--out", "file", "releases/v2.json", True),
    ("release", "--out", "file", "checkpoints/step-00000002/trainer_state.json", False),
    ("release", "--out", "file", "metrics.jsonl", False), ("release", "--out", "file", "run.json", False),
    ("release", "--out", "file", "eval/x.json", False), ("release", "--out", "file", "releases", False),
    ("merge", "OUT_DIR", "dir", "merged", False), ("export", "--hf", "dir", "export/hf", False),
    ("data synth", "OUT", "file", "data/more.jsonl", False), ("data prepare", "--out", "dir", "prepared", False),
    ("preflight", "--out", "dir", "samples.json", False), (None, "OUT", "dir", "hf", False)])
def test_inside_a_run_directory_a_command_writes_only_where_its_outputs_go(tmp_path, command, what, kind, place,
                                                                          allowed):
    run = _run_dir(tmp_path / "run")
    target = (run / place) if place != "." else run
    before = snapshot(tmp_path)
    if allowed:
        assert check_output(target, kind=kind, overwrite=True, command=command, what=what) == target
        return
    with pytest.raises(ValueError) as info:
        check_output(target, kind=kind, overwrite=True, command=command, what=what)
    message = str(info.value)
    where = "is a glmtune run directory" if place == "." else f"is inside the glmtune run directory {run}"
    assert message.startswith(f"{what} {target} {where} ({place}: the run's, and "), message
    assert message.endswith("(--overwrite never replaces a run's files)"), message
    assert changes(before, snapshot(tmp_path)) == []


def test_a_link_into_a_run_directory_is_the_run_directory(tmp_path):
    run = _run_dir(tmp_path / "run")
    (tmp_path / "alias").symlink_to(run)
    with pytest.raises(ValueError, match=f"is inside the glmtune run directory {run} \\(checkpoints: the run's, and "
                                         f"glmtune eval writes {run}/eval/NAME\\)"):
        check_output(tmp_path / "alias" / "checkpoints", overwrite=True, command="eval", what="--out")
    with pytest.raises(ValueError, match=r"\(eval: the run's, and glmtune eval writes"):  # RUN/eval itself
        check_output(run / "eval" / "x" / "..", overwrite=True, command="eval", what="--out")


def test_a_training_writes_its_own_outputs_while_it_holds_the_runs_lock(tmp_path):
    run = _run_dir(tmp_path / "run")
    for command in ("train", None):
        with pytest.raises(ValueError, match="the run's, and"):
            check_output(run / "hf", overwrite=True, command=command)  # no training holds the run
    lock = RunLock(run)
    lock.acquire()
    try:
        for command in ("train", "preflight", None):
            with output_dir(run / "hf", overwrite=True, command=command, what="path") as tmp:
                (tmp / "config.json").write_text("{}")
        with pytest.raises(ValueError, match="the run's, and glmtune eval writes"):
            check_output(run / "hf", overwrite=True, command="eval", what="--out")  # not the training
        with pytest.raises(ValueError, match="the run's, and"):
            check_output(run / "checkpoints", overwrite=True, command="train")  # the checkpoint manager's
    finally:
        lock.release()


def test_the_cli_names_the_command_that_writes(tmp_path):
    with outputs.running("data prepare"):
        with output_dir(tmp_path / "out", what="--out") as tmp:
            (tmp / "pii_report.json").write_text("{}")
    assert json.loads((tmp_path / "out" / RECORD).read_text())["command"] == "data prepare"
    with output_dir(tmp_path / "lib") as tmp:  # a library call names no command: no record, plain overwrite
        (tmp / "a").write_text("a")
    assert os.listdir(tmp_path / "lib") == ["a"]


@pytest.mark.parametrize("hidden", [".git/config", ".my-notes.md", "sets/.keep"])
def test_a_hidden_file_added_to_an_output_is_not_the_commands_to_replace(tmp_path, hidden):
    target = tmp_path / "out"
    _write(target, "eval")
    (target / hidden).parent.mkdir(parents=True, exist_ok=True)
    (target / hidden).write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"which glmtune eval did not write there"):
        _write(target, "eval", overwrite=True)
    assert changes(before, snapshot(tmp_path)) == []


@pytest.mark.parametrize("command, what, kind, make, foreign", [c for c in LEGACY if c[2] == "dir"],
                         ids=[c[0] + c[1] for c in LEGACY if c[2] == "dir"])
def test_an_output_without_a_record_holding_a_hidden_file_is_not_recognized(tmp_path, command, what, kind, make,
                                                                           foreign):
    make(tmp_path / "theirs", ".notes.md")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=f"did not write.*replaces only what glmtune {command} wrote"):
        check_output(tmp_path / "theirs", kind=kind, overwrite=True, command=command, what=what)
    assert changes(before, snapshot(tmp_path)) == []


def test_a_preflight_output_without_a_record_beside_a_hidden_entry_is_not_recognized(tmp_path):
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre" / "preflight.json").write_text("{}")
    check_output(tmp_path / "pre", overwrite=True, command="preflight", what="--out")
    (tmp_path / "pre" / ".git").mkdir()
    with pytest.raises(ValueError, match="did not write.*replaces only what glmtune preflight wrote"):
        check_output(tmp_path / "pre", overwrite=True, command="preflight", what="--out")
