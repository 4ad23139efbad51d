"""A training checkpoint edited by hand or by an attacker: its listing, its trainer state, its RNG
states, its optimizer values and its stored items. Each edit is refused in one sentence naming the
file, before anything is applied or unpickled; the checksums are rewritten to match wherever that
would hide the edit (they detect damage, not tampering), so what refuses is the reader itself.

The trainer is the model-agnostic loop on a tiny module (tests/train/test_trainer.py); `glmtune
export` and `glmtune train --checkpoint.resume` run on a copy of one shared tiny run.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from glmtune.checkpoint.dcp_storage import METADATA_NAME
from glmtune.checkpoint.integrity import CHECKSUMS_NAME, write_checksums
from glmtune.checkpoint.manager import CheckpointManager, DamagedCheckpointError
from glmtune.cli import main
from tests.checkpoint.test_checkpoint_safety import _Payload, _fit_with_checkpoints, _flip, _newest, _splice, \
    _torch_saved
from tests.distributed.gloo_helpers import run_gloo
from tests.train.run_helpers import WITH_EXPORT, run, shared_run
from tests.train.test_trainer import _trainer
from tests.tree_snapshot import changes, snapshot


def _listing(checkpoint: Path) -> dict:
    return json.loads((checkpoint / CHECKSUMS_NAME).read_text())


def _write_listing(checkpoint: Path, listing) -> None:
    (checkpoint / CHECKSUMS_NAME).write_text(json.dumps(listing))


def _refused(tmp_path: Path, newest: Path, fragment: str) -> str:
    """An explicit resume of `newest` is refused in one line holding `fragment`; `auto` falls back."""
    with pytest.raises(DamagedCheckpointError) as caught:
        _trainer(tmp_path, micro=2, accum=1, steps=4, every=2).resume(str(newest))
    message = str(caught.value)
    assert "\n" not in message and str(newest) in message and fragment in message, message
    said = []
    fresh = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    fresh._print = said.append
    assert fresh.resume("auto") == 2, said
    return message


# ----------------------------------------------------------------------------- the listing covers every file


def _empty_listing_and_flipped_weights(checkpoint: Path) -> None:
    _write_listing(checkpoint, {"version": 1, "files": {}})
    _flip(checkpoint / "__0_0.distcp")


def _drop_from_listing(checkpoint: Path) -> None:
    listing = _listing(checkpoint)
    del listing["files"]["rng-rank0.pt"]
    _write_listing(checkpoint, listing)
    (checkpoint / "rng-rank0.pt").write_bytes(_torch_saved(checkpoint / "never"))


def _plant_beside(checkpoint: Path) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps({"x": 1}))


def _remove_listed(checkpoint: Path) -> None:
    (checkpoint / "rng-rank0.pt").unlink()


def _link_in_place(checkpoint: Path) -> None:
    target = checkpoint.parent.parent / "elsewhere.json"
    shutil.copy(checkpoint / "trainer_state.json", target)  # the same bytes: its recorded hash matches
    (checkpoint / "trainer_state.json").unlink()
    (checkpoint / "trainer_state.json").symlink_to(target)


LISTING_EDITS = {
    "empty listing, flipped weights": (_empty_listing_and_flipped_weights,
                                       "__0_0.distcp is in the checkpoint but not in checksums.json"),
    "a file dropped from the listing": (_drop_from_listing, "rng-rank0.pt is in the checkpoint but not in"),
    "a file planted beside": (_plant_beside, ".metadata is in the checkpoint but not in checksums.json"),
    "a listed file removed": (_remove_listed, "rng-rank0.pt is missing"),
    "a link in place of a file": (_link_in_place, "trainer_state.json is not a regular file"),
    "a directory planted": (lambda c: (c / "extra").mkdir(), "extra is in the checkpoint but not in"),
}


@pytest.mark.parametrize("case", list(LISTING_EDITS))
def test_the_listing_must_cover_exactly_the_checkpoints_files(tmp_path, case):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    edit, fragment = LISTING_EDITS[case]
    edit(newest)
    _refused(tmp_path, newest, fragment)


def _nested(depth: int) -> str:
    return '{"version": 1, "files": ' + "[" * depth + "]" * depth + "}"


HOSTILE_LISTINGS = {
    "nested": (_nested(100_000), "checksums.json: JSON nested deeper than 64 levels"),
    "files a list": ({"version": 1, "files": []}, "'files' is a list, not an object of file names"),
    "entry a number": ({"version": 1, "files": {"trainer_state.json": 5}}, "the entry of trainer_state.json is not"),
    "size a string": ({"version": 1, "files": {"x": {"size": "1", "sha256": "0" * 64}}}, "the entry of x is not"),
    "digest not hex": ({"version": 1, "files": {"x": {"size": 1, "sha256": "zz"}}}, "the entry of x is not"),
    "planted key": ({"version": 1, "files": {}, "hook": "x"}, "not a checksum listing of version 1"),
    "other version": ({"version": 2, "files": {}}, "not a checksum listing of version 1"),
    "a name outside": ({"version": 1, "files": {"../../../etc/passwd": {"size": 1, "sha256": "0" * 64}}},
                       "../../../etc/passwd is not the name of a file of the checkpoint"),
    "not JSON": (b"\x80\x04\x95 pickled", "checksums.json: not valid JSON"),
    "a list": ([1, 2], "not a checksum listing"),
}


@pytest.mark.parametrize("case", [*HOSTILE_LISTINGS, "huge"])
def test_a_hostile_listing_is_one_sentence(tmp_path, case):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    path = newest / CHECKSUMS_NAME
    if case == "huge":  # sparse: 300 MiB without writing them
        with open(path, "r+b") as fh:
            fh.truncate(300 << 20)
        fragment = "more than any checkpoint's listing"
    else:
        content, fragment = HOSTILE_LISTINGS[case]
        path.write_bytes(content if isinstance(content, bytes) else
                         (content if isinstance(content, str) else json.dumps(content)).encode())
    _refused(tmp_path, newest, fragment)


def test_the_listing_written_at_save_verifies(tmp_path):
    trainer, _ = _fit_with_checkpoints(tmp_path)
    manager = trainer.checkpoints
    assert all(manager.verify(c) == [] for c in manager.complete())


# ----------------------------------------------------------------------------- the trainer state


def _edit_state(edit):
    def apply(checkpoint: Path) -> None:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        edit(state)
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    return apply


STATE_EDITS = {
    "scheduler optimizer": (_edit_state(lambda s: s["scheduler"].update(optimizer="x")),
                            "trainer_state.scheduler.optimizer: not a field glmtune writes"),
    "scheduler lambda attributes": (_edit_state(lambda s: s["scheduler"].update(lr_lambdas=[{"__code__": 1}])),
                                    "trainer_state.scheduler.lr_lambdas[0]: is a dict, not null"),
    "learning rate not finite": (_edit_state(lambda s: s["scheduler"].update(base_lrs=[math.nan])),
                                 "trainer_state.scheduler.base_lrs[0]: is nan, not a finite number"),
    "two learning rates": (_edit_state(lambda s: s["scheduler"].update(_last_lr=[0.1, 0.1])),
                           "trainer_state.scheduler._last_lr: 2 items, glmtune writes 1 here"),
    "epoch a list": (_edit_state(lambda s: s["loader"].update(epoch=[0])),
                     "trainer_state.loader.epoch: is a list, not a number"),
    "cursor missing": (_edit_state(lambda s: s["loader"].pop("cursor")), "trainer_state.loader.cursor: missing"),
    "tokens negative": (_edit_state(lambda s: s.update(tokens_seen=-5)),
                        "trainer_state.tokens_seen: is -5, a negative number"),
    "tokens a float": (_edit_state(lambda s: s.update(tokens_seen=5.5)), "trainer_state.tokens_seen: is 5.5, not an"),
    "planted top-level key": (_edit_state(lambda s: s.update(hook={"x": 1})), "trainer_state.hook: not a field"),
    "step a string": (_edit_state(lambda s: s.update(step="4")), "trainer_state.json: step is '4'"),
    "step of another directory": (_edit_state(lambda s: s.update(step=9)), "step is 9, the checkpoint's directory"),
    "run id a number": (_edit_state(lambda s: s.update(run_id=5)), "trainer_state.json: run_id is a int"),
    "epoch far ahead": (_edit_state(lambda s: s["loader"].update(epoch=10 ** 6)),
                        "trainer_state.json: loader.epoch 1000000, loader.cursor 4 and tokens_seen 96 are not what 4 steps leave "
                        "(8 micro-batches of 2 rows an epoch, rows of 12 tokens); the trainer state was not written"),
    "cursor far ahead": (_edit_state(lambda s: s["loader"].update(cursor=10 ** 18)),
                         "loader.cursor 1000000000000000000 and tokens_seen"),
    "cursor zero": (_edit_state(lambda s: s["loader"].update(cursor=0)), "loader.cursor 0 and tokens_seen"),
    "tokens of other steps": (_edit_state(lambda s: s.update(tokens_seen=s["tokens_seen"] * 3)),
                              "are not what 4 steps leave"),
    "scheduler far ahead": (_edit_state(lambda s: s["scheduler"].update(last_epoch=10 ** 30)),
                            "trainer_state.json: scheduler.last_epoch 1000000000000000000000000000000 and "
                            "scheduler._step_count 5 are not what 4 steps leave (4 and 5)"),
    "nested": (lambda c: (c / "trainer_state.json").write_text("[" * 50_000 + "]" * 50_000),
               "trainer_state.json: JSON nested deeper"),
    "a list": (lambda c: (c / "trainer_state.json").write_text("[]"), "not a trainer state"),
}


@pytest.mark.parametrize("case", list(STATE_EDITS))
def test_a_hostile_trainer_state_is_refused_before_it_is_applied(tmp_path, case):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    edit, fragment = STATE_EDITS[case]
    edit(newest)
    write_checksums(newest)
    _refused(tmp_path, newest, fragment)


def test_the_trainer_state_a_run_writes_is_accepted_as_it_is(tmp_path):
    trainer, _ = _fit_with_checkpoints(tmp_path)
    resumed = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    assert resumed.resume(str(_newest(tmp_path))) == 4
    assert resumed.scheduler.state_dict() == trainer.scheduler.state_dict()
    assert resumed.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"]


def test_a_resume_trains_with_the_configured_hyperparameters_not_the_saved_ones(tmp_path):
    """A checkpoint's param groups and base learning rates would load over the config's: the resumed
    run's own settings (here lr and weight decay changed, a legitimate resume) are the ones that train."""
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    edit_base = _edit_state(lambda s: s["scheduler"].update(base_lrs=[1e300], _last_lr=[1e300]))
    edit_base(newest)
    write_checksums(newest)
    resumed = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2, lr=5e-3, weight_decay=0.0)
    assert resumed.resume(str(newest)) == 4
    group = resumed.optimizer.param_groups[0]
    assert (group["lr"], group["initial_lr"], group["weight_decay"]) == (5e-3, 5e-3, 0.0)
    assert resumed.scheduler.base_lrs == [5e-3] and resumed.scheduler.get_last_lr() == [5e-3]
    assert resumed.scheduler.last_epoch == 4


# ----------------------------------------------------------------------------- RNG states and optimizer values


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rng(**changes) -> bytes:
    return _saved({"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state(), **changes})


RNG_EDITS = {
    "python state a number": (_rng(python=5), "rng-rank0.pt: not a Python random state"),
    "torch state cut short": (_rng(torch=torch.zeros(3, dtype=torch.uint8)), "rng-rank0.pt: not the RNG states"),
    "a list": (_saved([1, 2]), "rng-rank0.pt: not the RNG states"),
    "planted payload": (_torch_saved(Path("/tmp/never")), "rng-rank0.pt: refused before unpickling"),
    "a bare pickle": (pickle.dumps({"python": 1}), "rng-rank0.pt: not a tensor archive as torch.save writes it"),
    "truncated": (_rng()[:300], "rng-rank0.pt: not a tensor archive as torch.save writes it"),
}


@pytest.mark.parametrize("case", list(RNG_EDITS))
def test_hostile_rng_states_are_refused_before_they_are_applied(tmp_path, case):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    content, fragment = RNG_EDITS[case]
    (newest / "rng-rank0.pt").write_bytes(content)
    write_checksums(newest)
    _refused(tmp_path, newest, fragment)


OPTIMIZER_EDITS = {
    "lr a string": (_saved("fast"), "param_groups[0].lr: is a str, not a number"),
    "lr not finite": (_saved(math.inf), "param_groups[0].lr: is inf, not a finite number"),
    "lr a tensor": (_saved(torch.ones(3)), "param_groups[0].lr: is a Tensor, not a number"),
    "lr a planted payload": (_torch_saved(Path("/tmp/never")), "refused before unpickling"),
}


@pytest.mark.parametrize("case", list(OPTIMIZER_EDITS))
def test_hostile_optimizer_values_are_refused_before_they_are_applied(tmp_path, case):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    content, fragment = OPTIMIZER_EDITS[case]
    _splice(newest, "optim.param_groups.0.lr", content)
    write_checksums(newest)
    _refused(tmp_path, newest, fragment)


# ----------------------------------------------------------------------------- stored items, through glmtune export


def _with_record(item: bytes, name: str, data: bytes) -> bytes:
    """A torch.save archive with one more record (its prefix, as torch names the others)."""
    buffer = io.BytesIO(item)
    with zipfile.ZipFile(buffer, "a", zipfile.ZIP_STORED) as archive:
        archive.writestr(archive.namelist()[0].split("/")[0] + "/" + name, data)
    return buffer.getvalue()


def _item(checkpoint: Path, fqn: str) -> bytes:
    layout = json.loads((checkpoint / METADATA_NAME).read_text())
    entry = next(e for e in layout["storage"] if e["fqn"] == fqn)
    data = (checkpoint / entry["file"]).read_bytes()
    return data[entry["file_offset"]: entry["file_offset"] + entry["length"]]


def _protocol_4(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer, pickle_protocol=4)
    return buffer.getvalue()


ITEM_EDITS = {  # (what replaces a stored weight, given its bytes; what the refusal says)
    "planted payload": (lambda item, marker: _torch_saved(marker), "refused before unpickling: its pickle names"),
    "a bare pickle": (lambda item, marker: pickle.dumps(_Payload(marker)), "not a tensor archive as torch.save"),
    "truncated": (lambda item, marker: item[: len(item) // 2], "not a tensor archive as torch.save writes it"),
    "an extra record": (lambda item, marker: _with_record(item, "constants.pkl", pickle.dumps(_Payload(marker))),
                        "record 'constants.pkl'"),
    "a stack global": (lambda item, marker: _protocol_4(torch.zeros(2)), "opcode STACK_GLOBAL"),
    "a plain value": (lambda item, marker: _saved({"a": 1}), "cannot be read"),
}


@pytest.fixture
def run_copy(shared_results, tmp_path) -> Path:
    """A copy of a finished tiny full fine-tuning run (checkpoints at steps 2 and 4), free to damage."""
    return Path(shutil.copytree(shared_run(shared_results, *WITH_EXPORT).run_dir, tmp_path / "run", symlinks=True))


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"glmtune {command}: error: "), err
    return err


@pytest.mark.parametrize("case", list(ITEM_EDITS))
def test_export_refuses_a_hostile_stored_weight_in_one_sentence(run_copy, tmp_path, capsys, case):
    newest = run_copy / "checkpoints" / "step-00000004"
    layout = json.loads((newest / METADATA_NAME).read_text())
    fqn = next(fqn for fqn, e in layout["state_dict"].items() if e["kind"] == "tensor" and fqn.startswith("model."))
    marker = tmp_path / "payload-ran"
    replace, fragment = ITEM_EDITS[case]
    _splice(newest, fqn, replace(_item(newest, fqn), marker))
    write_checksums(newest)
    before = snapshot(tmp_path)
    assert main(["export", str(run_copy), "--hf", str(tmp_path / "out")]) == 2
    err = _one_line_error(capsys, "export")
    assert f"checkpoint {newest} cannot be read" in err and fragment in err, err
    assert not marker.exists()
    assert changes(before, snapshot(tmp_path)) == []


def test_export_refuses_an_emptied_listing_over_flipped_weights(run_copy, tmp_path, capsys):
    newest = run_copy / "checkpoints" / "step-00000004"
    _empty_listing_and_flipped_weights(newest)
    assert main(["export", str(run_copy), "--hf", str(tmp_path / "out")]) == 2
    err = _one_line_error(capsys, "export")
    assert "is damaged: __0_0.distcp is in the checkpoint but not in checksums.json" in err, err
    assert not (tmp_path / "out").exists()


def test_train_resume_refuses_a_scheduler_state_that_sets_an_attribute(run_copy, tmp_path):
    step_2 = run_copy / "checkpoints" / "step-00000002"
    _edit_state(lambda s: s["scheduler"].update(optimizer="planted"))(step_2)
    write_checksums(step_2)
    done = run(run_copy, tmp_path / "cache", *WITH_EXPORT, "--checkpoint.resume", str(step_2))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [f"glmtune train: error: {step_2} cannot be read: trainer_state.scheduler.optimizer: "
                      "not a field glmtune writes"], done.stderr[-4000:]
    assert "Traceback" not in done.stdout + done.stderr


def test_a_manager_without_an_expected_state_still_checks_step_and_run(tmp_path):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    _edit_state(lambda s: s.update(step=[4]))(newest)
    trainer = _trainer(tmp_path, micro=2, accum=1)
    manager = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(DamagedCheckpointError, match=r"trainer_state.json: step is \[4\]"):
        manager.load(manager.latest(), trainer.model, trainer.optimizer)


def _two_ranks_one_planted_rng(rank: int, world_size: int, root: str) -> None:
    """Two ranks save a checkpoint; rank 1's RNG file is replaced; each rank's load must refuse it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(Path(root) / "ckpt")
    path = manager.save(1, model, optimizer, {})
    if rank == 1:
        (path / "rng-rank1.pt").write_bytes(_saved([1, 2]))
    torch.distributed.barrier()
    write_checksums(path)
    try:
        manager.load(manager.latest(), model, optimizer)
        outcome = "loaded"
    except DamagedCheckpointError as exc:
        outcome = str(exc)
    (Path(root) / f"rank{rank}.txt").write_text(outcome)


def test_one_ranks_hostile_rng_file_fails_every_rank_alike(tmp_path):
    """A rank's own RNG file is read by that rank alone: its refusal reaches every rank (none goes on
    to apply the checkpoint, or waits in a collective for one that stopped)."""
    run_gloo(_two_ranks_one_planted_rng, 2, tmp_path, str(tmp_path))
    for rank in (0, 1):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert said.endswith("cannot be read: " + str(tmp_path / "ckpt" / "step-00000001" / "rng-rank1.pt")
                             + ": not the RNG states glmtune writes (python, torch and CUDA generator states)"), said
