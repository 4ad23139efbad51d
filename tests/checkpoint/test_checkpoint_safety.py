"""Checkpoints that are damaged, planted or cannot be written: named, never executed, never half-kept.

The trainer here is the model-agnostic loop on a tiny module (tests/train/test_trainer.py):
what is tested is the checkpoint manager's behaviour, not the GLM-5 model.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from glmtune.checkpoint.dcp_storage import METADATA_NAME, JsonMetadataReader
from glmtune.checkpoint.integrity import CHECKSUMS_NAME, write_checksums
from glmtune.checkpoint.manager import CheckpointManager, CheckpointWriteError, DamagedCheckpointError
from tests.train.test_trainer import _trainer


def _fit_with_checkpoints(root: Path, steps: int = 4, every: int = 2):
    trainer = _trainer(root, micro=2, accum=1, steps=steps, every=every)
    result = trainer.fit()
    return trainer, result


def _newest(root: Path) -> Path:
    return sorted((root / "ckpt").glob("step-*"))[-1]


class _Payload:
    """Unpickling this creates `marker`: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.mkdir, (self.marker,))


def _pickled(marker: Path) -> bytes:
    return pickle.dumps({"python": _Payload(marker)})


def _torch_saved(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"lr": _Payload(marker)}, buffer)
    return buffer.getvalue()


def _splice(checkpoint: Path, fqn: str, payload: bytes) -> None:
    """Replace the stored value of `fqn` inside its .distcp file by `payload`, moving later items."""
    layout_file = checkpoint / METADATA_NAME
    layout = json.loads(layout_file.read_text())
    entry = next(e for e in layout["storage"] if e["fqn"] == fqn)
    shard = checkpoint / entry["file"]
    data = shard.read_bytes()
    start, end = entry["file_offset"], entry["file_offset"] + entry["length"]
    shard.write_bytes(data[:start] + payload + data[end:])
    for other in layout["storage"]:
        if other["file"] == entry["file"] and other["file_offset"] > start:
            other["file_offset"] += len(payload) - entry["length"]
    entry["length"] = len(payload)
    layout_file.write_text(json.dumps(layout))


def _plant_optimizer_value(checkpoint: Path, marker: Path) -> None:
    _splice(checkpoint, "optim.param_groups.0.lr", _torch_saved(marker))


def _plant_tensor(checkpoint: Path, marker: Path) -> None:
    layout = json.loads((checkpoint / METADATA_NAME).read_text())
    tensor_fqn = next(fqn for fqn, e in layout["state_dict"].items() if e["kind"] == "tensor")
    _splice(checkpoint, tensor_fqn, _torch_saved(marker))


def _plant_legacy_layout(checkpoint: Path, marker: Path) -> None:
    (checkpoint / METADATA_NAME).unlink()  # what a checkpoint of an older glmtune looked like
    (checkpoint / ".metadata").write_bytes(_pickled(marker))


def _plant_legacy_state(checkpoint: Path, marker: Path) -> None:
    (checkpoint / "trainer_state.json").unlink()
    (checkpoint / "trainer_state.pt").write_bytes(_pickled(marker))


def _overwrite_with_pickle(name: str):
    return lambda checkpoint, marker: (checkpoint / name).write_bytes(_pickled(marker))


# Every file a checkpoint holds (and the two an older glmtune wrote), each replaced by code.
PLANTS = {
    "rng-rank0.pt": _overwrite_with_pickle("rng-rank0.pt"),
    "trainer_state.json": _overwrite_with_pickle("trainer_state.json"),
    "dcp_metadata.json": _overwrite_with_pickle(METADATA_NAME),
    "optimizer value in __0_0.distcp": _plant_optimizer_value,
    "tensor in __0_0.distcp": _plant_tensor,
    "legacy pickled .metadata": _plant_legacy_layout,
    "legacy trainer_state.pt": _plant_legacy_state,
}


@pytest.mark.parametrize("case", list(PLANTS))
def test_planted_payload_never_runs_even_with_rewritten_checksums(tmp_path, case):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    marker = tmp_path / "payload-ran"
    PLANTS[case](newest, marker)
    write_checksums(newest)  # an attacker rewrites the checksums too: they are no defence here
    fresh = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    with pytest.raises(DamagedCheckpointError, match="step-00000004 cannot be read"):
        fresh.resume(str(newest))
    assert not marker.exists()
    messages = []
    fresh = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    fresh._print = messages.append
    assert fresh.resume("auto") == 2  # falls back to the intact checkpoint before it
    assert not marker.exists()
    assert any("step-00000004" in m and "damaged" in m for m in messages), messages


def test_a_legacy_layout_is_refused_with_a_sentence(tmp_path):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    _plant_legacy_layout(newest, tmp_path / "payload-ran")
    write_checksums(newest)
    with pytest.raises(DamagedCheckpointError, match="older glmtune: its layout is a pickle"):
        _trainer(tmp_path, micro=2, accum=1, steps=4, every=2).resume(str(newest))


def test_no_checkpoint_file_is_a_pickle_but_the_weights_only_rng(tmp_path):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    names = sorted(p.name for p in newest.iterdir())
    assert names == ["__0_0.distcp", CHECKSUMS_NAME, METADATA_NAME, "rng-rank0.pt", "trainer_state.json"]
    for name in (CHECKSUMS_NAME, METADATA_NAME, "trainer_state.json"):
        json.loads((newest / name).read_text())


def test_missing_checksums_is_damage_not_an_unchecked_checkpoint(tmp_path):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    (newest / CHECKSUMS_NAME).unlink()
    with pytest.raises(DamagedCheckpointError, match=f"{newest} is damaged: {CHECKSUMS_NAME} is missing"):
        _trainer(tmp_path, micro=2, accum=1, steps=4, every=2).resume(str(newest))
    messages = []
    fresh = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    fresh._print = messages.append
    assert fresh.resume("auto") == 2


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": ("__0_0.distcp", _truncate),
    "truncated layout": (METADATA_NAME, _truncate),
    "truncated trainer state": ("trainer_state.json", _truncate),
    "truncated rng": ("rng-rank0.pt", _truncate),
    "same-size byte flip": ("__0_0.distcp", _flip),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_and_resumes_exactly(tmp_path, case):
    straight = _trainer(tmp_path / "straight", micro=2, accum=1, steps=6).fit()
    _fit_with_checkpoints(tmp_path / "run")
    name, damage = DAMAGE[case]
    newest = _newest(tmp_path / "run")
    damage(newest / name)

    explicit = _trainer(tmp_path / "run", micro=2, accum=1, steps=6, every=2)
    with pytest.raises(DamagedCheckpointError, match=f"{newest} is damaged: {name}"):
        explicit.resume(str(newest))

    messages = []
    resumed = _trainer(tmp_path / "run", micro=2, accum=1, steps=6, every=2)
    resumed._print = messages.append
    assert resumed.resume("auto") == 2
    assert any(f"checkpoint {newest} is damaged ({name}" in m for m in messages), messages
    assert any("set aside newer checkpoint" in m for m in messages), messages
    assert resumed.fit().losses == straight.losses[2:]  # exactly the uninterrupted run from step 2 on


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    _fit_with_checkpoints(tmp_path)
    for checkpoint in (tmp_path / "ckpt").glob("step-*"):
        _flip(checkpoint / "__0_0.distcp")
    trainer = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    trainer._print = lambda _: None
    with pytest.raises(DamagedCheckpointError, match="every checkpoint in .* is damaged"):
        trainer.resume("auto")


def test_resume_auto_says_when_it_finds_nothing(tmp_path):
    messages = []
    trainer = _trainer(tmp_path, micro=2, accum=1)
    trainer._print = messages.append
    assert trainer.resume("auto") == 0
    assert messages == [f"checkpoint.resume auto: no checkpoint in {tmp_path / 'ckpt'}; starting at step 0"]


def test_checksums_cover_every_file(tmp_path):
    _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    recorded = json.loads((newest / CHECKSUMS_NAME).read_text())["files"]
    assert sorted(recorded) == sorted(p.name for p in newest.iterdir() if p.name != CHECKSUMS_NAME)
    assert not any(p.suffix == ".pt" and p.name.startswith("trainer_state") for p in newest.iterdir())


def test_retention_never_touches_another_runs_checkpoints(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    a = CheckpointManager(tmp_path, keep_last=1, run_id="run-a")
    b = CheckpointManager(tmp_path, keep_last=1, run_id="run-b")
    for step in (1, 2):
        a.save(step, model, opt, {})
    for step in (3, 4, 5):
        b.save(step, model, opt, {})
    assert [c.step for c in a.owned()] == [2]
    assert [c.step for c in b.owned()] == [5]
    assert b.latest().step == 5 and a.latest().step == 2  # neither resumes the other's


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=64k"):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    yield disk
    subprocess.run(["umount", str(disk)], check=False)


def test_disk_full_save_removes_its_partial_and_says_so(tmp_path, small_disk):
    trainer = _trainer(tmp_path, micro=2, accum=1, steps=4, every=1)
    trainer.checkpoints = CheckpointManager(small_disk / "ckpt", keep_last=0)
    (small_disk / "filler").write_bytes(b"\0" * 40_000)  # leaves room for the first checkpoint's start only
    with pytest.raises(CheckpointWriteError, match=f"no space left on {small_disk}") as caught:
        trainer.fit()
    assert "removed the partial checkpoint" in str(caught.value)
    assert not list((small_disk / "ckpt").glob(".step-*"))
    assert not list((small_disk / "ckpt").glob("step-*"))


def test_the_planted_optimizer_value_would_run_under_dcps_default_planner(tmp_path):
    """The plant above is real: DCP's own planner unpickles it fully when the items are not checked
    first; with the check (JsonMetadataReader), even that full unpickler never sees it."""
    trainer, _ = _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    marker = tmp_path / "payload-ran"
    _plant_optimizer_value(newest, marker)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    with pytest.raises(CheckpointException, match="refused before unpickling"):
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=JsonMetadataReader(newest),
                 planner=DefaultLoadPlanner())
    assert not marker.exists()

    class Unchecked(JsonMetadataReader):
        _slice_file = FileSystemReader._slice_file

    dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=Unchecked(newest), planner=DefaultLoadPlanner())
    assert marker.exists()


def test_runs_sharing_a_directory_keep_their_own_step_and_partial_saves(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    a = CheckpointManager(tmp_path, keep_last=0, run_id="aaaa")
    b = CheckpointManager(tmp_path, keep_last=0, run_id="bbbb")
    a.save(2, model, opt, {})
    a_bytes = {p.name: p.read_bytes() for p in (tmp_path / "step-00000002").iterdir()}
    in_progress = tmp_path / ".step-00000004.aaaa.partial"  # run a saving step 4 right now
    in_progress.mkdir()
    (in_progress / "__0_0.distcp").write_bytes(b"half written")
    b.save(2, model, opt, {})  # the same step number
    b.save(4, model, opt, {})
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-00000002").iterdir()} == a_bytes
    assert [c.path.name for c in b.owned()] == ["step-00000002-bbbb", "step-00000004"]
    assert [c.path.name for c in a.owned()] == ["step-00000002"]
    assert (in_progress / "__0_0.distcp").read_bytes() == b"half written"
    assert a.owned_leftovers() == [in_progress] and b.owned_leftovers() == []
    assert b.load(b.latest(), model, opt)["run_id"] == "bbbb"
