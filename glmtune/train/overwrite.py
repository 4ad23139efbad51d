"""`--overwrite` that loses nothing when the new run is refused: the previous run is set aside first.

A new run that replaces an earlier one in its run directory checks most of its inputs only
after it has claimed the directory (the model is built, the data read, checked against its
contract and packed, the trainer built). Removing the earlier run at the claim would lose it
to a typo in a data path. So the claim moves the earlier run's files aside, by rename on the
same filesystem:

  * its outputs (`RUN_OUTPUTS` of the run directory) into `RUN/.overwritten-<run id>/`;
  * its checkpoints (and its own leftovers) into `CKPT/.overwritten-<run id>/`;

after writing the list of moves into `RUN/.overwritten-<run id>/set_aside.json`. When the new
run has passed every check and is about to train its first step, `commit` removes them (and says
so); when it ends before that (a refusal, an error, Ctrl-C), `rollback` removes what the new run
wrote in their place and moves them back. A process killed in between leaves the list behind: the
next claim of the directory (`recover`) finishes a committed removal, or moves an uncommitted set
back, before it decides anything.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from glmtune.io.json_file import read_json_file
from glmtune.io.run_lock import RUN_ID

ASIDE_PREFIX = ".overwritten-"
_LIST = "set_aside.json"


class SetAside:
    """The earlier run's files moved aside by one `--overwrite` (see the module docstring)."""

    def __init__(self, run_dir: Path, checkpoint_dir: Path, run_id: str) -> None:
        assert RUN_ID.fullmatch(run_id), run_id  # read_run_record and recover check what they read
        self.run_dir, self.checkpoint_dir, self.run_id = Path(run_dir), Path(checkpoint_dir), run_id
        self.run_aside = self.run_dir / f"{ASIDE_PREFIX}{run_id}"
        self.checkpoint_aside = self.checkpoint_dir / f"{ASIDE_PREFIX}{run_id}"
        self.moves: list[tuple[Path, Path]] = []  # (original, aside)
        self.committed = False

    # -- set aside ---------------------------------------------------------------------
    def move(self, outputs: Iterable[Path], checkpoints: Iterable[Path]) -> None:
        """Move `outputs` (entries of the run directory) and `checkpoints` aside; the list first. A
        move the filesystem refuses puts back the ones made and raises ValueError naming the file."""
        self.moves = [(p, self.run_aside / p.name) for p in outputs]
        self.moves += [(p, self.checkpoint_aside / p.name) for p in checkpoints]
        self.run_aside.mkdir()
        self._write_list()
        for original, aside in self.moves:
            try:
                aside.parent.mkdir(exist_ok=True)
                os.rename(original, aside)
            except OSError as exc:
                self.rollback(new_outputs=())
                raise ValueError(f"--overwrite: {original} cannot be moved aside ({exc.strerror or exc}); "
                                 "nothing was changed: fix its permissions, or train in another "
                                 "--logging.run_dir") from None

    def bytes_held(self) -> dict[Path, int]:
        """Bytes set aside, by aside directory: the disk space `commit` gives back."""
        return {root: _tree_bytes(root) for root in (self.run_aside, self.checkpoint_aside) if root.is_dir()}

    # -- end ---------------------------------------------------------------------------
    def commit(self) -> list[str]:
        """Remove what was set aside; the names removed."""
        self.committed = True
        self._write_list()
        self._remove_asides()
        return [original.name for original, _ in self.moves]

    def rollback(self, new_outputs: Iterable[Path]) -> None:
        """Move every set-aside file back where it was, after removing what the new run wrote in its
        place, and remove `new_outputs` that were no file of the earlier run. An original whose aside
        copy is not there was never moved (a set-aside cut short) or is already back (a rollback cut
        short): it is the earlier run's and stays. So a rollback stopped anywhere can be run again."""
        planned = {original for original, _ in self.moves}
        for path in new_outputs:
            if path not in planned:
                _remove(path)
        for original, aside in reversed(self.moves):
            if os.path.lexists(aside):
                _remove(original)
                os.rename(aside, original)
        self._remove_asides()

    def _write_list(self) -> None:
        record = {"run_id": self.run_id, "committed": self.committed,
                  "moves": [[str(original), str(aside)] for original, aside in self.moves]}
        tmp = self.run_aside / f".{_LIST}.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(self.run_aside / _LIST)

    def _remove_asides(self) -> None:
        # the run directory's aside holds the list: removed last, so a kill leaves it behind
        for root in (self.checkpoint_aside, self.run_aside):
            if root.is_dir() and not root.is_symlink():
                shutil.rmtree(root)


def recover(run_dir: Path, checkpoint_dir: Path, new_outputs: Callable[[], Iterable[Path]],
            say: Callable[[str], None]) -> None:
    """Finish what an `--overwrite` killed between its set-aside and its end left in `run_dir`."""
    for listing in sorted(Path(run_dir).glob(f"{ASIDE_PREFIX}*/{_LIST}")):
        record = read_json_file(listing, "the --overwrite list")
        moves, run_id = record.get("moves"), record.get("run_id")
        # the run id names the two aside directories: one plain name, the listing's own directory's
        if not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id) and listing.parent.name == ASIDE_PREFIX + run_id
                and isinstance(record.get("committed"), bool) and isinstance(moves, list)
                and all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m) for m in moves)):
            raise ValueError(f"{listing}: not the list of an --overwrite's set-aside files; move the earlier "
                             f"run's files in {listing.parent} back by hand and remove it")
        aside = SetAside(run_dir, checkpoint_dir, run_id)
        aside.moves = [(Path(a), Path(b)) for a, b in moves]
        _check_inside(aside, listing)
        if record.get("committed") is True:
            aside._remove_asides()
            say(f"--overwrite: finished removing run {aside.run_id}'s files, set aside by an --overwrite that "
                "was stopped while removing them")
        else:
            aside.rollback(new_outputs())
            say(f"--overwrite: moved run {aside.run_id}'s files back from {listing.parent}: the --overwrite that "
                "set them aside was stopped before its run trained")


def _check_inside(aside: SetAside, listing: Path) -> None:
    """Every move of a list read back stays between the run's (or checkpoints') directory and its aside."""
    for original, moved in aside.moves:
        if not ((original.parent == aside.run_dir and moved.parent == aside.run_aside)
                or (original.parent == aside.checkpoint_dir and moved.parent == aside.checkpoint_aside)) \
                or original.name != moved.name:
            raise ValueError(f"{listing}: a move of {original} is not one an --overwrite makes; move the earlier "
                             f"run's files in {listing.parent} back by hand and remove it")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _tree_bytes(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                continue
    return total
