"""The JSON layout of a DCP checkpoint: equal to DCP's own Metadata, and strict about what it reads."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader

from glmtune.checkpoint.dcp_storage import (
    METADATA_NAME,
    JsonMetadataReader,
    JsonMetadataWriter,
    LegacyCheckpointError,
    WeightsOnlyLoadPlanner,
    decode_metadata,
)


def _state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    return {"model": model.state_dict(), "extra": {"step": torch.tensor(7), "names": ["a", "b"], "lr": 1e-5,
                                                    "betas": (0.9, 0.95), "flag": None}}


def test_layout_equals_what_dcp_pickles(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "pickled"), no_dist=True)
    dcp.save(state, storage_writer=JsonMetadataWriter(tmp_path / "json"), no_dist=True)
    assert not (tmp_path / "json" / ".metadata").exists()
    theirs = FileSystemReader(tmp_path / "pickled").read_metadata()
    ours = JsonMetadataReader(tmp_path / "json").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert ours.storage_data == theirs.storage_data
    assert ours.version == theirs.version


def test_round_trip_with_non_tensor_values(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=JsonMetadataWriter(tmp_path), no_dist=True)
    target = _state()
    for tensor in target["model"].values():
        tensor.zero_()
    target["extra"] = {"step": torch.tensor(0), "names": [], "lr": 0.0, "betas": (0.0, 0.0), "flag": 1}
    dcp.load(target, storage_reader=JsonMetadataReader(tmp_path), planner=WeightsOnlyLoadPlanner(), no_dist=True)
    for key, tensor in state["model"].items():
        assert torch.equal(target["model"][key], tensor)
    assert target["extra"]["names"] == ["a", "b"] and target["extra"]["lr"] == 1e-5
    assert tuple(target["extra"]["betas"]) == (0.9, 0.95) and target["extra"]["flag"] is None
    assert int(target["extra"]["step"]) == 7


def _layout(tmp_path):
    dcp.save(_state(), storage_writer=JsonMetadataWriter(tmp_path), no_dist=True)
    return json.loads((tmp_path / METADATA_NAME).read_text())


def _broken(layout, edit):
    layout = copy.deepcopy(layout)
    edit(layout)
    return layout


EDITS = {
    "file outside": (lambda m: m["storage"][0].update(file="../other.distcp"), "not a file name inside"),
    "absolute file": (lambda m: m["storage"][0].update(file="/etc/passwd"), "not a file name inside"),
    "unknown dtype": (lambda m: next(e for e in m["state_dict"].values() if e["kind"] == "tensor")
                      .update(dtype="Tensor"), "is not a torch dtype"),
    "negative size": (lambda m: next(e for e in m["state_dict"].values() if e["kind"] == "tensor")
                      .update(size=[-1]), "non-negative integers"),
    "unknown kind": (lambda m: m["state_dict"].update(x={"kind": "object"}), "neither 'tensor' nor 'bytes'"),
    "string offset": (lambda m: m["storage"][0].update(file_offset="0"), "expected int"),
    "other format": (lambda m: m.update(format="pickle"), "not a glmtune DCP layout"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_malformed_layout_is_refused_by_field(tmp_path, case):
    edit, message = EDITS[case]
    with pytest.raises(ValueError, match=message):
        decode_metadata(_broken(_layout(tmp_path), edit), METADATA_NAME)


def test_a_pickled_layout_alone_is_refused_unread(tmp_path):
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    with pytest.raises(LegacyCheckpointError, match="no longer unpickles"):
        JsonMetadataReader(tmp_path).read_metadata()


def test_deep_layout_json_is_a_value_error(tmp_path):
    (tmp_path / METADATA_NAME).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="not valid JSON"):
        JsonMetadataReader(tmp_path).read_metadata()
