"""glmtune.io.outputs: refuse what would destroy data, replace atomically, leave nothing hidden,
write with the user's permissions; glmtune.io.sizes: sizes or one clear sentence."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from glmtune.io import outputs
from glmtune.io.outputs import check_output, output_dir, output_file
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
