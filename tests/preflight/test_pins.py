"""Check 1: what is pinned and a model that cannot be pinned (where a download's revision is read
from: tests/io/test_revisions.py)."""

from __future__ import annotations

from glmtune.preflight.pins import check_pins, recipe_pins
from tests.preflight.conftest import LORA, SFT


def test_pins_of_a_passing_run(sft_done):
    evidence = sft_done.check(1)["evidence"]
    assert evidence["libraries"]["torch"] and evidence["libraries"]["transformers"]
    assert evidence["model"]["preset"] == "tiny" and len(evidence["model"]["config_sha256"]) == 64
    assert evidence["glmtune"]["commit"] is None or len(evidence["glmtune"]["commit"]) == 40


def test_recipe_pins_follow_extends():
    assert [p["path"] for p in recipe_pins(LORA)] == [str(SFT), str(LORA)]


def test_unreadable_model_config_fails(ckpt, fresh):
    (ckpt / "config.json").write_text("{ not json")
    result = check_pins(fresh(SFT, "--model.name_or_path", str(ckpt)))
    assert result.status == "fail"
    assert "config cannot be pinned" in result.message and "config.json:1: invalid JSON" in result.message


def test_declared_requirements_from_a_source_tree_parse_with_their_own_markers(monkeypatch):
    """Run from a checkout without installed metadata (PYTHONPATH), the optional groups come
    from pyproject.toml; a requirement that has a marker of its own (triton's platform) must
    still parse once the extra is added (on a GPU host this raised InvalidRequirement)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    from glmtune.preflight import pins

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", missing)
    texts = pins._declared_requirements()
    parsed = [Requirement(t) for t in texts]
    triton = [r for r in parsed if r.name == "triton"]
    assert triton and all(r.marker.evaluate({"extra": "dev", "platform_system": "Linux"}) for r in triton)
    assert not any(r.marker.evaluate({"extra": "dev", "platform_system": "Windows"}) for r in triton)
    problems, found = pins.dependency_problems({"dev"})
    assert "torch" in found and not [p for p in problems if "torch" in p]
