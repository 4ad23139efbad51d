"""Which paths a release may record, and which `glmtune release verify` may read.

A manifest names each artifact by a `root` (relative to the manifest's directory, or
absolute when the artifact lay outside it) and each of its files by a `path` inside that
root. A manifest is input: one that someone else wrote or edited could name
`../../home/me/.ssh/id_ed25519` or `/etc/shadow`, and verify would measure and hash it and
print what it found. So verify checks every path before it touches the disk:

  * lexically (`file_path_problem`, `root_problem`): a file path is relative, with no
    empty, `.` or `..` component, no backslash and no NUL; a relative root has no `..`;
    an absolute root is normalized. An absolute root is read only when the user vouches for
    the manifest (a signature checked with `--key`, or `--allow-outside`): docs/release.md.
  * on disk (`within`, `walk`): a path under a relative root, symlinks resolved, must lie
    inside the manifest's directory. A link that leads out is named and not followed.

`glmtune release` applies the same rule when it records (a relative root's files must
resolve inside the manifest's directory, and an artifact inside RUN_DIR inside RUN_DIR),
so a release it writes is one verify accepts. Links that stay inside are followed: their
content is recorded under the link's path.

An artifact is regular files (`walk`): a FIFO, a socket, a device, a link to nothing or a
subdirectory that cannot be listed in a directory artifact is never skipped in silence.
`glmtune release` refuses it (a release that left it out would ship an artifact without
that file, and reading a FIFO would block), `release verify` reports it (DRIFT). Hidden
entries (names starting with ".") are not part of an artifact and are not looked at.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from glmtune.io.regular import kind_of

_LINK = "(a link"  # how every refusal of a link leaving its tree or looping ends


def file_path_problem(rel: Any) -> str | None:
    """Why `rel` cannot be a file's path inside an artifact root, or None."""
    if not isinstance(rel, str) or not rel:
        return f"file path {rel!r} is not a relative path"
    if rel.startswith("/") or "\\" in rel or "\x00" in rel:
        return f"file path {rel!r} is absolute or has a backslash or NUL"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return f"file path {rel!r} has an empty, '.' or '..' component"
    return None


def root_problem(root: Any, allow_absolute: bool) -> str | None:
    """Why `root` cannot be read as an artifact root, or None."""
    if not isinstance(root, str) or not root or "\x00" in root:
        return f"root {root!r} is not a path"
    if os.path.isabs(root):
        if os.path.normpath(root) != root:
            return f"absolute root {root!r} is not normalized"
        if not allow_absolute:
            return ("absolute root, outside the manifest's directory: not read (pass --key to check a signed "
                    "release, or --allow-outside to trust its paths)")
        return None
    if ".." in root.replace("\\", "/").split("/"):
        return f"root {root!r} has a '..' component"
    return None


def within(path: str | os.PathLike[str], tree: str) -> bool:
    """Whether `path`, symlinks resolved, is `tree` or lies under it (`tree` already resolved)."""
    real = os.path.realpath(path)
    return real == tree or real.startswith(tree.rstrip("/") + "/")


def innermost(path: Path, trees: list[Path]) -> str | None:
    """The resolved innermost of `trees` that `path` lies in lexically (None if none does):
    the directory its links must not leave."""
    path = Path(os.path.abspath(path))
    found = [Path(os.path.abspath(t)) for t in trees]
    found = [t for t in found if t == path or t in path.parents]
    if not found:
        return None
    return os.path.realpath(max(found, key=lambda t: len(t.parts)))


def walk(root: Path, tree: str | None) -> tuple[list[str], dict[str, str]]:
    """(relative posix paths of the non-hidden regular files under `root`, sorted; {relative path:
    why} of what is not recorded: links that lead out of `tree` or loop back (not followed),
    entries that are not regular files, subdirectories that cannot be listed).

    Links are followed otherwise (an HF cache snapshot is a directory of links into blobs/).
    Hidden entries (names starting with ".") are skipped without being resolved.
    """
    root_text = str(root)
    files, refused, unlisted = [], {}, []
    chains = {root_text: frozenset({os.path.realpath(root_text)})}  # real directories above each walked one
    for directory, dirnames, filenames in os.walk(root_text, followlinks=True, onerror=unlisted.append):
        chain = chains.pop(directory)
        kept = []
        for name in sorted(d for d in dirnames if not d.startswith(".")):
            full = os.path.join(directory, name)
            real = os.path.realpath(full)
            rel = os.path.relpath(full, root_text).replace(os.sep, "/")
            if tree is not None and not within(real, tree):
                refused[rel] = f"{rel}/ leads out of {tree} (a link; not followed)"
            elif real in chain:
                refused[rel] = f"{rel}/ loops back to a directory above it (a link; not followed)"
            else:
                chains[full] = chain | {real}
                kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            if name.startswith("."):
                continue
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, root_text).replace(os.sep, "/")
            if tree is not None and not within(full, tree):
                refused[rel] = f"{rel} leads out of {tree} (a link; not read)"
                continue
            kind = kind_of(full)  # os.walk lists FIFOs, sockets, devices and dangling links as files
            if kind is None:
                files.append(rel)
            else:
                refused[rel] = not_regular(rel, kind)
    for error in unlisted:  # os.walk skips a directory it cannot list
        rel = os.path.relpath(error.filename, root_text).replace(os.sep, "/")
        refused[rel] = (f"{rel}/ cannot be listed ({error.strerror or error}): a release would leave its files "
                        "out; make it readable, or move it out")
    return sorted(files), dict(sorted(refused.items()))


def not_regular(rel: str, kind: str) -> str:
    """The phrase for an entry of an artifact that is not a regular file (`kind_of`'s `kind`)."""
    return (f"{rel} is {kind}, not a regular file (a release records regular files only: put the file itself "
            "there, or move it out)")


def is_link_refusal(why: str) -> bool:
    """Whether a `walk` refusal is a link leaving its tree or looping (else it names its own way out)."""
    return _LINK in why
