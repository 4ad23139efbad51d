"""`Fields`, the typed view of a hand-editable manifest, and the `--previous` manifest read through
it: a wrong type is one ValueError naming the record and the field (never an AttributeError)."""

from __future__ import annotations

import json

import pytest

from glmtune.release.fields import Fields
from glmtune.release.manifest import FORMAT, _previous, release_id


def test_reads_check_the_type_and_name_the_path():
    fields = Fields({"a": {"b": [{"c": "x", "n": 1}, None]}, "t": True, "s": "1"}, "release X x.json")
    assert fields.dict("missing").items() == [] and fields.list("missing") == []
    with pytest.raises(ValueError, match=r"^release X x\.json: a\.b\[1\] is null, expected an object$"):
        fields.dict("a").list("b")
    with pytest.raises(ValueError, match=r"^release X x\.json: t is a boolean, expected a number$"):
        fields.number("t")
    with pytest.raises(ValueError, match=r": s is a string, expected a number$"):
        fields.number("s")
    with pytest.raises(ValueError, match=r": a is an object, expected a string$"):
        fields.str("a")
    with pytest.raises(ValueError, match=r": missing is null, expected a string$"):
        fields.str("missing", required=True)
    assert fields.scalar("t") is True and fields.str("missing") is None
    with pytest.raises(ValueError, match=r"^r: the record is a list, expected an object$"):
        Fields([], "r")


@pytest.mark.parametrize("run, message", [
    ([], "run is a list, expected an object"),
    ({"run_id": {"x": 1}}, "run.run_id is an object, expected a string, a number, a boolean or null"),
])
def test_previous_release_with_a_wrong_type_is_refused_naming_the_field(tmp_path, run, message):
    manifest = {"format": FORMAT, "id": None, "created": "2026", "run": run, "artifacts": [], "signature": None}
    manifest["id"] = release_id(manifest)  # a consistent hand-made manifest: its id matches
    path = tmp_path / "previous.json"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"^--previous {path}: {message}$"):
        _previous(path, tmp_path)
