"""`glmtune publish` through huggingface_hub against a local Hub endpoint (tests/release/hub_endpoint.py,
HF_ENDPOINT pointing at it): the repository is created, the release's files arrive byte for byte in
one commit (the card as README.md, validated as the Hub validates metadata), the token is sent and
written nowhere; no token, a drifted release or a bad repo id is one line and nothing is sent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import huggingface_hub.constants
import pytest

from glmtune.cli import main
from tests.release.hub_endpoint import LocalHub

TOKEN = "hf_glmtuneTestToken0123456789"


@pytest.fixture
def released(lora_run, capsys) -> Path:
    run, eval_dir = lora_run
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0
    capsys.readouterr()
    return run


@pytest.fixture
def hub(monkeypatch, tmp_path):
    # the suite runs with HF_HUB_OFFLINE=1 (make test), which huggingface_hub reads once at import and
    # then refuses every request: publishing to this local endpoint is the one place a test goes online
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with LocalHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # where a client would store a token
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield hub


def _all_files(*roots: Path) -> list[Path]:
    return [Path(d, f) for root in roots if root.exists() for d, _, names in os.walk(root) for f in names]


def test_publish_uploads_the_release_in_one_commit(released, hub, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MY_HUB_TOKEN", TOKEN)
    assert main(["publish", str(released / "release.json"), "--repo", "acme/tiny-lora", "--token-env",
                 "MY_HUB_TOKEN", "--private"]) == 0
    out = capsys.readouterr()
    assert "published" in out.out and TOKEN not in out.out + out.err
    repo = hub.state.repos["acme/tiny-lora"]
    assert repo["private"] is True and not hub.state.unknown and len(hub.state.commits) == 1
    manifest = json.loads((released / "release.json").read_text())
    expected = {"release.json": (released / "release.json").read_bytes()}
    for name, folder in (("adapter", ""), ("adapter_per_expert", "per_expert/")):
        for f in next(a for a in manifest["artifacts"] if a["name"] == name)["files"]:
            expected[folder + f["path"]] = (released / name / f["path"]).read_bytes()
    # the adapter's own card (the training run's export card) gives way to the release's
    assert b"Not evaluated" in expected["README.md"]
    expected["README.md"] = (released / "release.md").read_bytes()
    assert repo["files"] == expected
    assert hub.state.validated == [expected["README.md"].decode()]  # the card passed the metadata check
    assert manifest["id"] in hub.state.commits[0]["summary"]
    assert {auth for _, _, auth in hub.state.requests} == {f"Bearer {TOKEN}"}
    for path in _all_files(tmp_path, Path.home() / ".cache" / "huggingface"):
        if path.is_file() and path.stat().st_size < 1 << 26:
            assert TOKEN.encode() not in path.read_bytes(), path

    # again: the repository exists (409 answered, exist_ok), a second commit
    assert main(["publish", str(released / "release.json"), "--repo", "acme/tiny-lora", "--token-env",
                 "MY_HUB_TOKEN"]) == 0
    assert len(hub.state.commits) == 2
    capsys.readouterr()


def test_publish_refuses_before_anything_is_sent(released, hub, monkeypatch, capsys):
    release = str(released / "release.json")
    assert main(["publish", release, "--repo", "acme/x"]) == 2
    assert "no Hugging Face token: $HF_TOKEN is not set" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["publish", release, "--repo", "not a repo"]) == 2
    assert "not a repository id" in capsys.readouterr().err
    card = released / "release.md"
    card.write_text(card.read_text() + "edited\n")
    assert main(["publish", release, "--repo", "acme/x"]) == 2
    err = capsys.readouterr().err
    assert "artifact model_card is DRIFT" in err and TOKEN not in err
    assert hub.state.requests == []  # nothing reached the endpoint


def test_dry_run_needs_no_token(released, hub, capsys):
    assert main(["publish", str(released / "release.json"), "--repo", "acme/x", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would upload") and "README.md" in out and "per_expert/adapter_config.json" in out
    assert hub.state.requests == []
