"""The file names of a safetensors index stay inside the checkpoint (glmtune/checkpoint/shard_paths.py):
a name that leaves it (`..`, an absolute path, a link out, something not a file) is refused in one
sentence naming the index and the entry, by every reader of the index (loading for train and eval,
`inspect`'s verifier, the base fingerprint), and the file outside is never opened. A file that is
not safetensors is said to be so. Names inside (a subdirectory, a Hugging Face cache snapshot's
links into its blobs/, preflight's truncated view's links to its source) load as before."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from glmtune.models.registry import hf_dir_identity
from glmtune import load_pretrained
from glmtune.checkpoint.hf_io import INDEX_NAME, checkpoint_files
from glmtune.checkpoint.hf_verify import verify_checkpoint
from glmtune.models.glm5.spec import GLM5
from tests.checkpoint_fixtures import Q_A, weight_map


def verify(path: Path):
    """`verify_checkpoint` of a GLM-5 directory (what `glmtune inspect --verify` runs for one)."""
    return verify_checkpoint(path, GLM5.hf_format)


def _rename_in_index(ckpt: Path, old: str, new) -> None:
    index = json.loads((ckpt / INDEX_NAME).read_text())
    index["weight_map"] = {k: (new if v == old else v) for k, v in index["weight_map"].items()}
    (ckpt / INDEX_NAME).write_text(json.dumps(index))


def _moved_out(ckpt: Path) -> tuple[str, Path]:
    """The shard holding Q_A, moved next to the checkpoint (a readable safetensors file outside)."""
    name = weight_map(ckpt)[Q_A]
    outside = ckpt.parent / "outside" / name
    outside.parent.mkdir()
    shutil.move(ckpt / name, outside)
    return name, outside


def _parent(ckpt: Path) -> None:
    name, _ = _moved_out(ckpt)
    _rename_in_index(ckpt, name, f"../outside/{name}")


def _absolute(ckpt: Path) -> None:
    name, outside = _moved_out(ckpt)
    _rename_in_index(ckpt, name, str(outside))


def _link_out(ckpt: Path) -> None:
    name, outside = _moved_out(ckpt)
    (ckpt / name).symlink_to(outside)


def _a_directory(ckpt: Path) -> None:
    name = weight_map(ckpt)[Q_A]
    (ckpt / name).unlink()
    (ckpt / name).mkdir()


EDITS = {
    "parent directory": (_parent, "which leaves the checkpoint directory through '..'"),
    "absolute path": (_absolute, "which is an absolute path, not a file of the checkpoint"),
    "link out": (_link_out, "which is a link that leads out of"),
    "a directory": (_a_directory, "which is not a regular file"),
    "a number": (lambda c: _rename_in_index(c, weight_map(c)[Q_A], 5), "which is not a file name"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_an_index_name_outside_the_checkpoint_is_refused_by_every_reader(ckpt, case):
    edit, fragment = EDITS[case]
    edit(ckpt)
    for read in (lambda: load_pretrained(ckpt, dtype=torch.float32), lambda: hf_dir_identity(ckpt)):
        with pytest.raises(ValueError) as caught:
            read()
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"{ckpt / INDEX_NAME}: the entry for "), message
        assert fragment in message, message
    report = verify(ckpt)  # `glmtune inspect`: one problem, against the index
    assert any(p.file == INDEX_NAME and fragment.removeprefix("which ") in p.message for p in report.problems), \
        report.problems


def test_a_file_that_is_not_safetensors_is_said_to_be_so(ckpt):
    name = weight_map(ckpt)[Q_A]
    text = b"root:x:0:0:root:/root:/bin/bash\n" * 8
    (ckpt / name).write_bytes(text)
    with pytest.raises(ValueError) as caught:
        load_pretrained(ckpt, dtype=torch.float32)
    message = str(caught.value)
    assert message.startswith(f"{ckpt / name}: not a safetensors file"), message
    assert str(int.from_bytes(text[:8], "little")) not in message  # no first 8 bytes as a number
    report = verify(ckpt)
    assert any(p.file == name and "not a safetensors file" in p.message for p in report.problems), report.problems


def test_names_inside_load_as_before(ckpt):
    reference = load_pretrained(ckpt, dtype=torch.float32).state_dict()
    name = weight_map(ckpt)[Q_A]
    (ckpt / "sub").mkdir()
    shutil.move(ckpt / name, ckpt / "sub" / name)
    _rename_in_index(ckpt, name, f"sub/{name}")
    loaded = load_pretrained(ckpt, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.items())
    assert verify(ckpt).ok


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(ckpt, tmp_path):
    repo = tmp_path / "models--zai-org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(ckpt.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    assert set(checkpoint_files(snapshot).values()) == {snapshot / n for n in set(weight_map(ckpt).values())}
    assert verify(snapshot).ok
    outside = tmp_path / "elsewhere.safetensors"  # a link out of the repository is still refused
    shutil.copy(ckpt / weight_map(ckpt)[Q_A], outside)
    (snapshot / weight_map(ckpt)[Q_A]).unlink()
    (snapshot / weight_map(ckpt)[Q_A]).symlink_to(outside)
    with pytest.raises(ValueError, match="which is a link that leads out of"):
        checkpoint_files(snapshot)


def test_a_truncated_view_links_only_to_its_sources_same_named_files(ckpt, tmp_path):
    """preflight's K-layer view (truncated_view.py) is a directory of links to the checkpoint it was
    cut from: loadable; a link of it to any other file (another shard of the source, a file outside
    the source) is refused, whatever its index claims."""
    view = GLM5.weights.truncated_view(ckpt, tmp_path / "view", 2)
    assert checkpoint_files(view) and not any("leads out" in p.message for p in verify(view).problems)
    names = sorted(set(json.loads((view / INDEX_NAME).read_text())["weight_map"].values()))
    others = sorted(set(weight_map(ckpt).values()) - set(names))
    (view / names[0]).unlink()
    (view / names[0]).symlink_to(ckpt / others[0])  # another shard of the source
    with pytest.raises(ValueError, match=f"names '{names[0]}', which is a link that leads out of {view}"):
        checkpoint_files(view)
    shutil.copy(ckpt / names[0], tmp_path / names[0])
    index = json.loads((view / INDEX_NAME).read_text())
    index["metadata"]["truncated_from"] = str(tmp_path)  # a copy outside the source, the index edited to match
    (view / INDEX_NAME).write_text(json.dumps(index))
    (view / names[0]).unlink()
    (view / names[0]).symlink_to(tmp_path / names[0])
    with pytest.raises(ValueError, match="which is a link that leads out of"):
        checkpoint_files(view)  # tmp_path has no config.json: not a checkpoint a view is cut from
