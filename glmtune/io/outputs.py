"""Write a command's output directory or file without destroying what the command did not create.

    with output_dir("out/merged", overwrite=ns.overwrite, sources=[("BASE_DIR", base)], what="OUT_DIR") as tmp:
        ...write files into tmp...

The rules (`check_output`), for the command writing (`command`: the `glmtune` subcommand
the CLI runs, set by `running`, or passed):
  * a target equal to, inside or containing a source the command reads (symlinks
    resolved) is refused even with `overwrite`: replacing it would destroy the input;
  * a target inside a glmtune run directory (the target or an ancestor holds run.json and
    .glmtune.lock) may only be where that command's own outputs go (`RUN_PLACES`: eval
    under RUN/eval/, release at RUN/release.json or under RUN/releases/; every other
    command nowhere). The run's own files and directories (checkpoints/, data/, hf/, base/,
    adapter*/, tensorboard/, metrics.jsonl, config.yaml, ...) are written by its training
    only: `TRAINER_PLACES`, while the run's lock is held (glmtune train and the preflight's
    runs; glmtune/train/run_dir.py decides what its `--overwrite` removes). Refused even
    with `overwrite`;
  * an existing target that holds something (a directory with entries, a file, a link)
    is refused unless `overwrite`; an empty directory is fine for a directory output;
  * with `overwrite`, an existing target is replaced only when it is that command's own
    output: its `.glmtune-output.json` record (written into every output directory here)
    names the command and output option, or, without a record (a single file; a directory
    written before records existed), its content is what that command writes
    (glmtune/io/output_owner.py). Anything else (a user's file or directory, another
    command's output, a link, a FIFO) is refused, naming what it is. A call outside the
    CLI that names no command (the library API; a training writing its own outputs) keeps
    the plain `overwrite`.

The output is built in a temporary sibling (`.NAME.tmp-XXXX`, same filesystem), its
files are fsynced and given the user's normal permissions (0o666 / 0o777 minus the
umask: mkstemp, mkdtemp and some writers create owner-only files, which a serving
engine running as another user cannot read), and only then made visible, in one step:
  * a new target, or an empty directory: rename(2);
  * a file over a file: os.replace;
  * anything over a directory (or a directory over a file): renameat2(RENAME_EXCHANGE)
    swaps the two atomically and the old content, now under the temporary name, is
    deleted. Where the kernel or filesystem has no exchange, the old target is renamed
    aside, the new one renamed in, and the old one deleted; if the second rename fails
    the old target is put back.
On any exception inside the `with` block the temporary is deleted and the target is
untouched (parent directories this call created are removed again).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from glmtune.io.output_owner import owner_problem, write_record
from glmtune.io.run_lock import LOCK_FILE, RUN_FILE, lock_holder

# (label, path) of an input the command reads, e.g. ("BASE_DIR", "/models/glm5").
Source = tuple[str, "str | os.PathLike[str]"]

# Where in a run directory each command writes: "NAME" is RUN/NAME, "NAME/" anything under RUN/NAME.
RUN_PLACES: dict[str | None, tuple[str, ...]] = {"eval": ("eval/",),
                                                  "release": ("release.json", "release.md", "releases/")}
# What a training writes into its own run directory through output_dir (run.py: hf/, base/, the
# adapters; run_data.py: data/), allowed only while the run's lock is held.
TRAINER_PLACES = ("hf", "base", "adapter", "adapter_per_expert", "data")
_TRAINERS = ("train", "preflight", None)  # the commands that train (the preflight in its own process)
_command: str | None = None  # the glmtune subcommand this process runs (`running`)


@contextlib.contextmanager
def running(command: str | None) -> Iterator[None]:
    """Within the block, the outputs written belong to `glmtune COMMAND` (e.g. "eval", "data prepare")."""
    global _command
    previous, _command = _command, command
    try:
        yield
    finally:
        _command = previous

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def check_output(target: str | os.PathLike[str], *, kind: str = "dir", overwrite: bool = False,
                 sources: Iterable[Source] = (), what: str = "OUT", option: str = "--overwrite",
                 command: str | None = None) -> Path:
    """Raise a one-line ValueError if writing `target` could destroy data (see module docstring).

    Call it before expensive work, so a refused command fails at once; `output_dir` and
    `output_file` check again right before they replace anything.

    Args:
        kind: "dir" or "file", what the command writes at `target`.
        sources: (label, path) of every input the command reads.
        what: how the message names the target, e.g. "OUT_DIR" or "--out"; with the command,
            it names the output in the record (`output_owner`).
        option: how the message names the overwrite switch.
        command: the glmtune subcommand writing; default the one `running` names.
    """
    assert kind in ("dir", "file"), kind
    target = Path(target)
    command = command if command is not None else _command
    noun = "directory" if kind == "dir" else "path"
    resolved = target.resolve()
    for label, source in sources:
        src = Path(source).resolve()
        relation = ("is" if resolved == src else "is inside" if src in resolved.parents
                    else "contains" if resolved in src.parents else None)
        if relation:
            raise ValueError(f"{what} {target} {relation} {label} {source}, which this command reads; "
                             f"choose another {noun} ({option} never replaces an input)")
    trains_here = _check_run_place(target, command, what, noun, option)
    if not os.path.lexists(target):
        return target
    is_dir = target.is_dir() and not target.is_symlink()
    if kind == "dir" and is_dir and not any(target.iterdir()):
        return target
    owned = trains_here or command is None
    problem = None if owned else owner_problem(target, kind, command, what)
    if problem is not None:  # --overwrite would not help: say what the target is
        state = ("" if overwrite else "already exists and is not empty, and " if kind == "dir" and is_dir
                 else "already exists, and ")
        raise ValueError(f"{what} {target} {state}{problem}; {option} replaces only what glmtune {command} wrote: "
                         f"choose another {noun}, or move it away")
    if overwrite:
        return target
    if kind == "dir" and is_dir:
        state = "already exists and is not empty"
    elif kind == "dir":
        state = "is an existing file, not a directory"
    else:
        state = "is an existing directory, not a file" if is_dir else "already exists"
    raise ValueError(f"{what} {target} {state}; pass {option} to replace it (or choose another {noun})")


def _replaced(target: Path) -> Path:
    """The path writing `target` replaces (`..` taken as `_staged` takes it): its parent's links
    resolved, not a link at `target` itself."""
    path = Path(os.path.abspath(target))
    return Path(os.path.realpath(path.parent)) / path.name


def run_directory_of(path: str | os.PathLike[str]) -> Path | None:
    """The innermost glmtune run directory (run.json and .glmtune.lock) that is or holds what
    writing `path` would replace."""
    path = _replaced(Path(path))
    for directory in (path, *path.parents):
        if (directory / RUN_FILE).is_file() and (directory / LOCK_FILE).is_file():
            return directory
    return None


def _check_run_place(target: Path, command: str | None, what: str, noun: str, option: str) -> bool:
    """Refuse a target inside a run directory that is not where `command` writes (module docstring);
    True when it is a training's own output (its lock held), which the run directory's rules govern."""
    run_dir = run_directory_of(target)
    if run_dir is None:
        return False
    rel = _replaced(target).relative_to(run_dir).parts
    if rel and command in _TRAINERS and rel[0] in TRAINER_PLACES and lock_holder(run_dir) is not None:
        return True
    places = RUN_PLACES.get(command, ())
    if any(rel[:1] == (place.rstrip("/"),) and (len(rel) > 1 if place.endswith("/") else len(rel) == 1)
           for place in places):
        return False
    writes = (" or ".join(f"{run_dir}/{place}{'NAME' if place.endswith('/') else ''}" for place in places)
              if places else "nothing inside a run directory")
    who = f"glmtune {command} writes {writes}" if command else "only its training writes its files"
    where = "is a glmtune run directory" if not rel else f"is inside the glmtune run directory {run_dir}"
    raise ValueError(f"{what} {target} {where} ({'/'.join(rel) or '.'}: the run's, and {who}); choose another "
                     f"{noun} ({option} never replaces a run's files)")


def output_dir(target: str | os.PathLike[str], **options) -> contextlib.AbstractContextManager[Path]:
    """A context manager yielding an empty temporary directory that becomes `target` on a clean exit.

    Args:
        options: `overwrite`, `sources`, `what`, `option`, `command`, as `check_output` takes them.
    """
    return _staged(target, "dir", **options)


def output_file(target: str | os.PathLike[str], **options) -> contextlib.AbstractContextManager[Path]:
    """A context manager yielding an empty temporary file to write, which becomes `target` on a clean exit.

    Args:
        options: `overwrite`, `sources`, `what`, `option`, `command`, as `check_output` takes them.
    """
    return _staged(target, "file", **options)


@contextlib.contextmanager
def _staged(target, kind: str, *, overwrite: bool = False, sources: Iterable[Source] = (), what: str = "OUT",
            option: str = "--overwrite", command: str | None = None) -> Iterator[Path]:
    command = command if command is not None else _command
    check = functools.partial(check_output, target, kind=kind, overwrite=overwrite, sources=tuple(sources),
                              what=what, option=option, command=command)
    check()
    path = Path(os.path.abspath(target))  # not resolved: a link at `target` is replaced, not followed
    created = _make_parents(path.parent, what, target)
    tmp, published = None, False
    try:
        prefix = f".{path.name}.tmp-"
        if kind == "dir":
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, dir=path.parent)
            os.close(fd)
            tmp = Path(name)
        yield tmp
        if kind == "dir" and command is not None:
            write_record(tmp, command, what)  # what lets a later --overwrite know it for this command's
        _finish(tmp)
        check()  # the target may have appeared (or filled) while the output was written
        _publish(tmp, path)
        published = True
    finally:
        if tmp is not None:
            _remove(tmp)  # the unpublished output, or the old target after an exchange
        if not published:
            for directory in created:
                with contextlib.suppress(OSError):
                    directory.rmdir()


def _make_parents(parent: Path, what: str, target) -> list[Path]:
    """Create the missing directories above the target; returns them, deepest first."""
    missing = []
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {target}: {parent} is not a directory")
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
    return missing


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _finish(tmp: Path) -> None:
    """User permissions on everything under `tmp`, and its data on disk before it is published."""
    umask = _umask()
    if not tmp.is_dir():
        _chmod_fsync(tmp, 0o666 & ~umask)
        return
    for root, _, files in os.walk(tmp):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            file = Path(root, name)
            if not file.is_symlink():  # chmod would follow the link out of the output
                _chmod_fsync(file, 0o666 & ~umask)
        _fsync(Path(root))


def _chmod_fsync(file: Path, mode: int) -> None:
    os.chmod(file, mode)
    _fsync(file)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path) -> None:
    """Make `tmp` visible as `path` in one step (see module docstring); an old `path` ends up at `tmp`."""
    target_is_dir = path.is_dir() and not path.is_symlink()
    if not os.path.lexists(path) or (tmp.is_dir() and target_is_dir and not any(path.iterdir())):
        os.rename(tmp, path)
    elif not tmp.is_dir() and not target_is_dir:
        os.replace(tmp, path)
    elif not _exchange(tmp, path):
        _rename_aside(tmp, path)
    _fsync(path.parent)


def _rename_aside(tmp: Path, path: Path) -> None:
    aside = path.with_name(f".{path.name}.old-{secrets.token_hex(4)}")
    os.rename(path, aside)
    try:
        os.rename(tmp, path)
    finally:
        if os.path.lexists(path):
            _remove(aside)
        else:  # the new output could not be put in place: the old one goes back
            os.rename(aside, path)


@functools.cache
def _renameat2():
    try:
        func = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError, TypeError):  # not Linux/glibc
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` atomically; False where the kernel or filesystem cannot."""
    func = _renameat2()
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()
