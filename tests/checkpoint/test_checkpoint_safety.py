"""Checkpoints that are damaged, planted or cannot be written: named, never executed, never half-kept.

The trainer here is the model-agnostic loop on a tiny module (tests/train/test_trainer.py):
what is tested is the checkpoint manager's behaviour, not the GLM-5 model.
"""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

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


def _plant(path: Path, marker: Path) -> None:
    with open(path, "wb") as fh:
        pickle.dump({"python": _Payload(marker)}, fh)
    write_checksums(path.parent)  # an attacker rewrites the checksums too: they are no defence here


@pytest.mark.parametrize("target", ["rng-rank0.pt", "trainer_state.pt"])
def test_planted_pickle_never_runs(tmp_path, target):
    trainer, _ = _fit_with_checkpoints(tmp_path)
    newest = _newest(tmp_path)
    if target == "trainer_state.pt":  # the legacy name, still read (weights-only) when no JSON state exists
        (newest / "trainer_state.json").unlink()
    marker = tmp_path / "payload-ran"
    _plant(newest / target, marker)
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


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": ("__0_0.distcp", _truncate),
    "truncated metadata": (".metadata", _truncate),
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
