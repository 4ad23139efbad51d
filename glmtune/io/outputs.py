"""Write a command's output directory or file without destroying what the command did not create.

    with output_dir("out/merged", overwrite=ns.overwrite, sources=[("BASE_DIR", base)], what="OUT_DIR") as tmp:
        ...write files into tmp...

The rules (`check_output`):
  * an existing target that holds something (a directory with entries, a file, a link)
    is refused unless `overwrite`; an empty directory is fine for a directory output;
  * a target equal to, inside or containing a source the command reads (symlinks
    resolved) is refused even with `overwrite`: replacing it would destroy the input;
  * a directory where a file goes, or a file where a directory goes, needs `overwrite`.

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

# (label, path) of an input the command reads, e.g. ("BASE_DIR", "/models/glm5").
Source = tuple[str, "str | os.PathLike[str]"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def check_output(target: str | os.PathLike[str], *, kind: str = "dir", overwrite: bool = False,
                 sources: Iterable[Source] = (), what: str = "OUT", option: str = "--overwrite") -> Path:
    """Raise a one-line ValueError if writing `target` could destroy data (see module docstring).

    Call it before expensive work, so a refused command fails at once; `output_dir` and
    `output_file` check again right before they replace anything.

    Args:
        kind: "dir" or "file", what the command writes at `target`.
        sources: (label, path) of every input the command reads.
        what: how the message names the target, e.g. "OUT_DIR" or "--out".
        option: how the message names the overwrite switch.
    """
    assert kind in ("dir", "file"), kind
    target = Path(target)
    noun = "directory" if kind == "dir" else "path"
    resolved = target.resolve()
    for label, source in sources:
        src = Path(source).resolve()
        relation = ("is" if resolved == src else "is inside" if src in resolved.parents
                    else "contains" if resolved in src.parents else None)
        if relation:
            raise ValueError(f"{what} {target} {relation} {label} {source}, which this command reads; "
                             f"choose another {noun} ({option} never replaces an input)")
    if not os.path.lexists(target):
        return target
    is_dir = target.is_dir() and not target.is_symlink()
    if overwrite or (kind == "dir" and is_dir and not any(target.iterdir())):
        return target
    if kind == "dir" and is_dir:
        state = "already exists and is not empty"
    elif kind == "dir":
        state = "is an existing file, not a directory"
    else:
        state = "is an existing directory, not a file" if is_dir else "already exists"
    raise ValueError(f"{what} {target} {state}; pass {option} to replace it (or choose another {noun})")


def output_dir(target: str | os.PathLike[str], **options) -> contextlib.AbstractContextManager[Path]:
    """A context manager yielding an empty temporary directory that becomes `target` on a clean exit.

    Args:
        options: `overwrite`, `sources`, `what`, `option`, as `check_output` takes them.
    """
    return _staged(target, "dir", **options)


def output_file(target: str | os.PathLike[str], **options) -> contextlib.AbstractContextManager[Path]:
    """A context manager yielding an empty temporary file to write, which becomes `target` on a clean exit.

    Args:
        options: `overwrite`, `sources`, `what`, `option`, as `check_output` takes them.
    """
    return _staged(target, "file", **options)


@contextlib.contextmanager
def _staged(target, kind: str, *, overwrite: bool = False, sources: Iterable[Source] = (), what: str = "OUT",
            option: str = "--overwrite") -> Iterator[Path]:
    check = functools.partial(check_output, target, kind=kind, overwrite=overwrite, sources=tuple(sources),
                              what=what, option=option)
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
