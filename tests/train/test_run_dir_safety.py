"""One run per run directory, as a hostile user meets it: mixed runs, a second process, a
read-only or full disk, Ctrl-C while starting. Each refusal is one sentence on stderr,
exit status 2 (130 for Ctrl-C), no traceback, and changes nothing on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from glmtune.config import RECIPES_DIR, load_config
from glmtune.train.run import _check_disk_space
from glmtune.train.run_dir import RunDirectory
from tests.train.run_helpers import TWO_STEPS, WITH_EXPORT, losses, printed, run, shared_run, start
from tests.tree_snapshot import changes, snapshot

QUICK = TWO_STEPS


@pytest.fixture(scope="module")
def finished(shared_results) -> Path:
    """A finished two-step run: run directory `run/` and tokenization cache `cache/`."""
    return shared_run(shared_results, *QUICK).run_dir.parent


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    shutil.copytree(finished, tmp_path / "w")
    return tmp_path / "w"


def _refused(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("glmtune train: error: ")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_fresh_start_into_a_finished_run_is_refused(copy):
    before = snapshot(copy)
    result = run(copy / "run", copy / "cache", *QUICK)
    _refused(result, f"logging.run_dir {copy / 'run'} already holds another run",
             "checkpoints up to step 2", "--checkpoint.resume auto", "--overwrite")
    assert changes(before, snapshot(copy)) == []


def test_different_config_without_checkpoints_is_refused(copy):
    shutil.rmtree(copy / "run" / "checkpoints")
    before = snapshot(copy)
    result = run(copy / "run", copy / "cache", *QUICK, "--optim.lr", "2e-4")
    _refused(result, "a different config (optim.lr: 0.001 -> 0.0002)")
    assert changes(before, snapshot(copy)) == []


def test_overwrite_replaces_the_earlier_run_and_keeps_foreign_files(copy):
    (copy / "run" / "notes.txt").write_text("the user's own file\n")
    old_id = json.loads((copy / "run" / "run.json").read_text())["run_id"]
    result = run(copy / "run", copy / "cache", *QUICK, "--optim.lr", "2e-4", "--overwrite")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--overwrite: removed the previous run's files" in result.stdout
    assert (copy / "run" / "notes.txt").read_text() == "the user's own file\n"
    new_id = json.loads((copy / "run" / "run.json").read_text())["run_id"]
    assert new_id != old_id
    states = [json.loads((c / "trainer_state.json").read_text()) for c in (copy / "run" / "checkpoints").glob("step-*")]
    assert [s["run_id"] for s in states] == [new_id]
    assert sorted(losses(copy / "run")) == [1, 2]


LOCK_AND_RECORD = (".glmtune.lock",)  # a refused claim marks the lock released; nothing else may change


@pytest.mark.parametrize("refused_by", ["missing data", "data policy"])
def test_overwrite_refused_after_the_claim_puts_the_earlier_run_back(copy, refused_by):
    """--overwrite set the earlier run aside; the new run is refused while it reads its data (a typo in
    a path; rows the PII policy 'fail' refuses, later still): the earlier run is back, as it was, and
    the refusal is one line."""
    flags = {"missing data": ["--data.train", '["/nonexistent/rows.jsonl"]'],
             "data policy": ["--data.pii", "fail", "--data.train", f'["{_rows_with_a_secret(copy)}"]']}[refused_by]
    before = snapshot(copy / "run", ignore=LOCK_AND_RECORD)
    result = run(copy / "run", copy / "cache", *QUICK, *flags, "--overwrite")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    said = " ".join(result.stdout.split())
    assert "set the previous run's files aside" in said and "files back into" in said, said
    assert changes(before, snapshot(copy / "run", ignore=LOCK_AND_RECORD)) == []
    assert not list((copy / "run").glob(".overwritten-*"))


def _rows_with_a_secret(copy: Path) -> Path:
    path = copy / "secret.jsonl"
    row = {"messages": [{"role": "user", "content": "my key is AKIAIOSFODNN7EXAMPLE"},
                        {"role": "assistant", "content": "{}"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("key", ["model.name_or_path", "data.train"])
def test_overwrite_never_removes_an_input_of_the_new_run(copy, key):
    """The new run reads a file of the run it would replace: refused before anything moves."""
    inside = {"model.name_or_path": str(copy / "run" / "base"),  # the preset base the earlier run wrote
              "data.train": f'["{copy / "run" / "checkpoints" / "step-00000002" / "trainer_state.json"}"]'}[key]
    before = snapshot(copy / "run", ignore=LOCK_AND_RECORD)
    result = run(copy / "run", copy / "cache", *QUICK, f"--{key}", inside, "--overwrite")
    _refused(result, f"{key} ", "is among the files of the earlier run", "copy it out of the run directory")
    assert changes(before, snapshot(copy / "run", ignore=LOCK_AND_RECORD)) == []


def test_an_overwrite_killed_before_its_run_trained_is_undone_by_the_next_claim(copy):
    """A process killed between the set-aside and the commit: the next claim of the directory moves
    the earlier run back (then decides as for that run), and a committed one finishes its removal."""
    run_dir = copy / "run"
    before = snapshot(run_dir, ignore=LOCK_AND_RECORD)
    first = RunDirectory(run_dir, run_dir / "checkpoints", print)
    first.lock()
    first.claim("name: x\n", "none", overwrite=True)  # sets the earlier run aside, writes its own run.json
    (run_dir / "config.yaml").write_text("the killed run's config\n")
    first._lock.release()  # the process dies: no rollback, the lock's flock goes
    assert list(run_dir.glob(".overwritten-*")) and not (run_dir / "checkpoints" / "step-00000002").exists()
    said: list[str] = []
    second = RunDirectory(run_dir, run_dir / "checkpoints", said.append)
    second.lock()
    with pytest.raises(ValueError, match="already holds another run"):  # the earlier run, back in place
        second.claim("name: y\n", "none", overwrite=False)
    second.release()
    assert any("moved run" in line and "back" in line for line in said), said
    assert changes(before, snapshot(run_dir, ignore=LOCK_AND_RECORD)) == []
    assert not list(run_dir.glob(".overwritten-*"))


class _Killed(BaseException):
    """The process dies here: no handler, no rollback runs."""


def _rename_killed_at(monkeypatch, call: int, error: BaseException | None = None) -> None:
    """os.rename dies (or fails with `error`) at its `call`-th use from now on."""
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == call:
            raise error if error is not None else _Killed()
        return real(src, dst)
    monkeypatch.setattr(os, "rename", rename)


def _claim(run_dir: Path, overwrite: bool, said: list[str] | None = None, resume: str = "none") -> RunDirectory:
    claim = RunDirectory(run_dir, run_dir / "checkpoints", (said if said is not None else []).append)
    claim.lock()
    claim.claim("name: new\n", resume, overwrite=overwrite)
    return claim


@pytest.mark.parametrize("call", [1, 2, 5, 7])
def test_an_overwrite_killed_while_setting_aside_loses_nothing(copy, monkeypatch, call):
    """Killed after `call` - 1 of its moves: the next claim puts back what moved and keeps what did not
    (it removed the files not yet moved as if the new run had written them)."""
    run_dir = copy / "run"
    before = snapshot(run_dir, ignore=LOCK_AND_RECORD)
    _rename_killed_at(monkeypatch, call)
    with pytest.raises(_Killed):
        _claim(run_dir, overwrite=True)
    monkeypatch.undo()
    said: list[str] = []
    with pytest.raises(ValueError, match="already holds another run"):
        _claim(run_dir, overwrite=False, said=said)
    assert changes(before, snapshot(run_dir, ignore=LOCK_AND_RECORD)) == [], said


@pytest.mark.parametrize("call", [1, 3, 6])
def test_an_overwrite_killed_while_putting_back_loses_nothing(copy, monkeypatch, call):
    """The new run was refused and is putting the earlier run back when it dies: the next claim
    finishes it (it removed what was already back, as if the new run had written it)."""
    run_dir = copy / "run"
    before = snapshot(run_dir, ignore=LOCK_AND_RECORD)
    claim = _claim(run_dir, overwrite=True)
    (run_dir / "config.yaml").write_text("the refused run's config\n")
    (run_dir / "trainable.json").write_text("{}\n")
    _rename_killed_at(monkeypatch, call)
    with pytest.raises(_Killed):
        claim.release()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="already holds another run"):
        _claim(run_dir, overwrite=False)
    assert changes(before, snapshot(run_dir, ignore=LOCK_AND_RECORD)) == []


def test_an_overwrite_the_filesystem_refuses_midway_changes_nothing(copy, monkeypatch):
    run_dir = copy / "run"
    before = snapshot(run_dir, ignore=LOCK_AND_RECORD)
    _rename_killed_at(monkeypatch, 4, PermissionError(1, "Operation not permitted"))
    with pytest.raises(ValueError, match="cannot be moved aside .Operation not permitted.; nothing was changed"):
        _claim(run_dir, overwrite=True)
    monkeypatch.undo()
    assert changes(before, snapshot(run_dir, ignore=LOCK_AND_RECORD)) == []


@pytest.mark.parametrize("run_id", ["x/../../victim", "..", ""])
def test_a_set_aside_list_naming_a_path_is_refused_and_removes_nothing(copy, run_id):
    victim = copy / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep\n")
    listing = copy / "run" / ".overwritten-x" / "set_aside.json"
    listing.parent.mkdir()
    listing.write_text(json.dumps({"run_id": run_id, "committed": True, "moves": []}))
    with pytest.raises(ValueError, match="not the list of an --overwrite's set-aside files"):
        _claim(copy / "run", overwrite=False)
    assert (victim / "keep.txt").read_text() == "keep\n"


def test_a_resume_refused_before_it_trains_keeps_the_runs_config_and_record(copy):
    """config.yaml held the refused settings (and the next resume compared against them)."""
    # every start writes the preset's base again: the same weights, its output record's time new
    unchanged = (".glmtune.lock", "base/.glmtune-output.json")
    before = snapshot(copy / "run", ignore=unchanged)
    result = run(copy / "run", copy / "cache", *QUICK, "--train.max_steps", "3", "--optim.lr", "0.5",
                 "--data.train", '["/nonexistent/rows.jsonl"]', "--checkpoint.resume", "auto")
    _refused(result, "/nonexistent/rows.jsonl")
    assert changes(before, snapshot(copy / "run", ignore=unchanged)) == []


@pytest.mark.parametrize("inside", ["hf", "tensorboard/ckpt"])
def test_checkpoints_inside_a_file_the_run_replaces_whole_are_refused(tmp_path, inside):
    result = run(tmp_path / "run", tmp_path / "cache", *QUICK, "--checkpoint.dir", str(tmp_path / "run" / inside))
    _refused(result, "checkpoint.dir", "which the run replaces whole")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_resume_auto_continues_and_reports_changed_settings(copy):
    result = run(copy / "run", copy / "cache", "--train.max_steps", "3", "--checkpoint.every_steps", "2",
                 "--checkpoint.resume", "auto")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming with changed settings: train.max_steps: 2 -> 3" in result.stdout
    assert printed(result.stdout, "resumed from")
    assert sorted(losses(copy / "run")) == [1, 2, 3]


def test_resume_auto_with_nothing_to_resume_keeps_a_finished_runs_outputs(shared_results, tmp_path):
    """A finished run whose checkpoints are gone (trained with checkpoint.save_at_end false, or
    removed) still holds its trained weights: a resume that finds no checkpoint must not start
    again at step 0 over them (it replaced hf/ and metrics.jsonl without --overwrite)."""
    exported = shared_run(shared_results, *WITH_EXPORT).run_dir.parent
    shutil.copytree(exported, tmp_path / "w")
    shutil.rmtree(tmp_path / "w" / "run" / "checkpoints")
    before = snapshot(tmp_path / "w")
    result = run(tmp_path / "w" / "run", tmp_path / "w" / "cache", *WITH_EXPORT, "--train.max_steps", "6",
                 "--checkpoint.resume", "auto")
    _refused(result, "checkpoint.resume auto: no checkpoint of the run", "(hf)", "--overwrite",
             "another --logging.run_dir")
    assert changes(before, snapshot(tmp_path / "w")) == []


def test_second_run_into_a_running_directory_is_refused(tmp_path):
    first = start(tmp_path / "run", tmp_path / "cache", "--train.max_steps", "200")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "run.json").is_file():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        before = snapshot(tmp_path, ignore=("run", "cache"))
        second = run(tmp_path / "run", tmp_path / "cache2", "--checkpoint.resume", "auto")
        _refused(second, f"logging.run_dir {tmp_path / 'run'} is in use by glmtune train (pid {first.pid}")
        assert changes(before, snapshot(tmp_path, ignore=("run", "cache"))) == []
    finally:
        first.kill()
        first.wait()


def _mount(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True).returncode == 0


@pytest.fixture
def mounts(tmp_path):
    made = []

    def mount(name: str, options: str) -> Path:
        where = tmp_path / name
        if not _mount(where, options):
            pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
        made.append(where)
        return where

    yield mount
    for where in made:
        subprocess.run(["umount", str(where)], check=False)


def test_read_only_run_dir_is_one_sentence(tmp_path, mounts):
    readonly = mounts("ro", "ro,size=1m")
    result = run(readonly / "run", tmp_path / "cache", *QUICK)
    _refused(result, f"logging.run_dir {readonly / 'run'} is not writable (Read-only file system)")


def test_read_only_checkpoint_dir_is_found_before_training(tmp_path, mounts):
    readonly = mounts("ro", "ro,size=1m")
    result = run(tmp_path / "run", tmp_path / "cache", *QUICK, "--checkpoint.dir", str(readonly / "ckpt"))
    _refused(result, f"checkpoint.dir {readonly / 'ckpt'} is not writable (Read-only file system)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


def test_too_little_disk_for_a_checkpoint_is_found_before_training(tmp_path, mounts):
    small = mounts("small", "size=1m")
    result = run(tmp_path / "run", tmp_path / "cache", *QUICK, "--checkpoint.dir", str(small / "ckpt"))
    _refused(result, f"not enough disk space for {small / 'ckpt'}", "this run needs")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert list(small.iterdir()) == []


def test_no_checkpoint_space_is_needed_without_any_save(tmp_path, monkeypatch):
    """every_steps 0 and save_at_end false: a full disk refuses only what is still written (the HF export)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=1, used=0, free=1))
    model = torch.nn.Linear(64, 64)
    tiny = RECIPES_DIR / "tiny" / "sft_support_json.yaml"
    base = [f"--logging.run_dir={tmp_path / 'run'}", "--checkpoint.every_steps=0", "--checkpoint.export_hf=false"]
    with pytest.raises(ValueError, match="one checkpoint"):
        _check_disk_space(load_config(tiny, base), model, Console(), {})
    _check_disk_space(load_config(tiny, [*base, "--checkpoint.save_at_end=false"]), model, Console(), {})
    with pytest.raises(ValueError, match=r"this run needs .* \(the HF export"):
        _check_disk_space(load_config(tiny, [*base, "--checkpoint.save_at_end=false", "--checkpoint.export_hf=true"]),
                          model, Console(), {})


def test_ctrl_c_while_starting_is_one_line(tmp_path):
    # 400 steps: the run cannot finish before the signal lands, which stops it while starting or,
    # the test process being slow to send it, in training ("SIGINT: saved")
    proc = start(tmp_path / "run", tmp_path / "cache", "--train.max_steps", "400", "--checkpoint.every_steps", "400")
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "config.yaml").is_file():  # past the claim, before training
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert "finished step" not in output, output
    assert proc.returncode == 130, output
    assert "Traceback" not in output, output
    assert "glmtune train: interrupted" in output or "SIGINT: saved" in output, output


def test_triton_adapter_kernel_without_cuda_is_refused_before_anything_is_written(tmp_path):
    before = snapshot(tmp_path)
    result = run(tmp_path / "run", tmp_path / "cache", *QUICK, "--peft.adapter_kernel", "triton",
                 recipe="tiny/lora_support_json")
    _refused(result, "peft.adapter_kernel: triton needs triton and a CUDA device")
    assert changes(before, snapshot(tmp_path)) == []


# -- what --overwrite may remove: exactly what a run created ---------------------------------

def _foreign_home(root: Path) -> Path:
    """A directory that never held a run but has files with the names a run writes."""
    root.mkdir()
    (root / "config.yaml").write_text("editor: vim\n")
    (root / "metrics.jsonl").write_text('{"weight_kg": 71}\n')
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text('{"model_type": "llama"}\n')
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text('{"r": 4}\n')
    (root / "notes.txt").write_text("the user's own file\n")
    return root


@pytest.mark.parametrize("flags", [["--overwrite"], []])
def test_a_directory_that_never_held_a_run_is_refused_with_or_without_overwrite(tmp_path, flags):
    home = _foreign_home(tmp_path / "home")
    before = snapshot(tmp_path)
    result = run(home, tmp_path / "cache", *QUICK, *flags)
    _refused(result, f"logging.run_dir {home} does not hold a glmtune run (no run.json)",
             "config.yaml, metrics.jsonl, hf, adapter", "choose another --logging.run_dir, or move those files away")
    assert "--overwrite" not in result.stderr  # not recommended: it would not help
    assert changes(before, snapshot(tmp_path)) == []


def test_a_run_record_without_the_runs_lock_is_not_a_run(tmp_path):
    home = _foreign_home(tmp_path / "home")
    (home / "run.json").write_text('{"run_id": "someone-elses-tool"}\n')
    before = snapshot(tmp_path)
    result = run(home, tmp_path / "cache", *QUICK, "--overwrite")
    _refused(result, "does not hold a glmtune run (a run.json but no .glmtune.lock: a copy of a run directory "
                     "needs both)", "config.yaml, run.json, metrics.jsonl, hf, adapter")
    assert changes(before, snapshot(tmp_path)) == []


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["run_id"]


def _leftover(path: Path, run_id: str | None) -> Path:
    """A fake partial save or set-aside checkpoint (one shard; a trainer state naming `run_id`)."""
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"\x00shard of a save\x01" * 64)
    if run_id is not None:
        (path / "trainer_state.json").write_text(json.dumps({"step": 4, "run_id": run_id}))
    return path


def test_overwrite_in_a_shared_checkpoint_dir_removes_only_its_own_runs_checkpoints(tmp_path):
    shared = tmp_path / "ckpt"
    for name in ("a", "b"):
        done = run(tmp_path / name, tmp_path / "cache", *QUICK, "--checkpoint.dir", str(shared))
        assert done.returncode == 0, done.stdout + done.stderr
    a_id, b_id = _run_id(tmp_path / "a"), _run_id(tmp_path / "b")
    assert len([p for p in shared.iterdir() if p.name.startswith("step-")]) == 2  # one each, neither replaced
    # A's save in progress (the manager names a partial save by its run), one of unknown origin
    # (an older glmtune), a set-aside checkpoint of A; and B's own leftovers, which go.
    _leftover(shared / f".step-00000004.{a_id}.partial", None)
    _leftover(shared / ".step-00000006.partial", None)
    _leftover(shared / "abandoned-step-00000004-20260101-000000", a_id)
    _leftover(shared / f".step-00000004.{b_id}.partial", None)
    _leftover(shared / "abandoned-step-00000004-20260102-000000", b_id)
    before = snapshot(tmp_path, ignore=("cache",))

    result = run(tmp_path / "b", tmp_path / "cache", *QUICK, "--checkpoint.dir", str(shared), "--overwrite")
    assert result.returncode == 0, result.stdout + result.stderr
    new_b_id = _run_id(tmp_path / "b")
    assert new_b_id != b_id
    # Nothing but B's run directory and B's checkpoints (old id or new) changed.
    unexpected = [c for c in changes(before, snapshot(tmp_path, ignore=("cache",)))
                  if not c[2:].startswith("b/") and b_id not in c and new_b_id not in c
                  and "abandoned-step-00000004-20260102-000000" not in c]
    assert unexpected == []
    assert not (shared / f".step-00000004.{b_id}.partial").exists()
    assert not (shared / "abandoned-step-00000004-20260102-000000").exists()
    states = [json.loads((c / "trainer_state.json").read_text()) for c in shared.glob("step-*")]
    assert sorted(s["run_id"] for s in states) == sorted([a_id, new_b_id])
    output = " ".join(result.stdout.split())  # rich wraps long lines
    assert "--overwrite: removed the previous run's files" in output
    assert f"left .step-00000004.{a_id}.partial, .step-00000006.partial, abandoned-step-00000004-20260101-000000" \
           in output
    assert "not provably this run's" in output


# -- the lock: released when a run ends, a stale one taken over ------------------------------

def test_a_finished_or_failed_run_marks_its_lock_released(finished, tmp_path):
    assert (finished / "run" / ".glmtune.lock").read_text().startswith("released: glmtune train (pid ")
    failed = run(tmp_path / "run", tmp_path / "cache", *QUICK, "--data.train", f"[{tmp_path / 'missing.jsonl'}]")
    _refused(failed, "data path not found")  # after the claim: run.json was written
    assert (tmp_path / "run" / "run.json").is_file()
    assert (tmp_path / "run" / ".glmtune.lock").read_text().startswith("released: glmtune train (pid ")


def test_a_refused_run_leaves_no_lock_file_behind(tmp_path):
    home = _foreign_home(tmp_path / "home")
    _refused(run(home, tmp_path / "cache", *QUICK), "does not hold a glmtune run")
    assert not (home / ".glmtune.lock").exists()


def test_a_lock_left_by_a_killed_run_is_taken_over(copy):
    stale = "glmtune train (pid 999999 on elsewhere, started 2026-01-01 00:00:00)"
    (copy / "run" / ".glmtune.lock").write_text(stale + "\n")  # its process is gone: nobody holds the flock
    result = run(copy / "run", copy / "cache", *QUICK, "--checkpoint.resume", "auto")
    assert result.returncode == 0, result.stdout + result.stderr
    output = " ".join(result.stdout.split())
    assert f"taking over the stale lock of {stale} (that process ended without releasing it)" in output
    assert "in use" not in result.stdout + result.stderr
    assert (copy / "run" / ".glmtune.lock").read_text().startswith("released: glmtune train (pid ")


def test_absorbed_triton_where_auto_finds_no_gpu_is_refused_before_anything_is_written(tmp_path):
    """train.device: auto resolves to the CPU here: the Triton attention is refused at launch (the tiny
    recipes say cpu, which the config refuses by itself)."""
    if torch.cuda.is_available():
        pytest.skip("auto finds a GPU here")
    before = snapshot(tmp_path)
    result = run(tmp_path / "run", tmp_path / "cache", *QUICK, "--model.attention_backend", "absorbed_triton",
                 "--train.device", "auto", "--model.dtype", "bfloat16")
    _refused(result, "model.attention_backend: absorbed_triton runs Triton kernels on a CUDA GPU",
             "train.device: auto found none here")
    assert changes(before, snapshot(tmp_path)) == []
