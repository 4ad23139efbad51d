"""Signed releases (--sign-key, verify --key): the content id alone is fooled by an edited manifest
with a recomputed id; the HMAC signature is not. A wrong key, a stripped signature and bad key
files fail in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.io import json_out
from glmtune.release import release_id
from glmtune.release.signing import check_signature, key_id, sign
from tests.release.eval_fixture import make_eval_dir

ENGINE = ["--engine", "vllm==0.11.0"]


def _key(path: Path, size: int = 32, mode: int = 0o600) -> Path:
    path.write_bytes(os.urandom(size))
    path.chmod(mode)
    return path


def _verify(capsys, release: Path, *options: str) -> tuple[int, str]:
    code = main(["release", "verify", str(release), *options])
    return code, capsys.readouterr().out


def _rewrite(release: Path, edit) -> None:
    """Edit the manifest as someone without the key would: change it, recompute its id."""
    manifest = json.loads(release.read_text())
    edit(manifest)
    manifest["id"] = release_id(manifest)
    release.write_text(json.dumps(manifest, indent=2))


def test_signed_release_edited_with_recomputed_id(sft_run, tmp_path, capsys):
    run, _ = sft_run
    eval_dir = make_eval_dir(run / "eval", run)  # inside the run: every root relative
    key, other = _key(tmp_path / "release.key"), _key(tmp_path / "other.key")
    assert main(["release", str(run), "--eval", str(eval_dir), *ENGINE, "--sign-key", str(key)]) == 0
    kid = key_id(key.read_bytes())
    assert f"signed    hmac-sha256, key id {kid}" in capsys.readouterr().out
    release = run / "release.json"
    text = release.read_text()
    signature = json.loads(text)["signature"]
    assert signature["algorithm"] == "hmac-sha256" and signature["key_id"] == kid
    assert key.read_bytes().hex() not in text  # the key id names the key, never holds it

    code, out = _verify(capsys, release, "--key", str(key))
    assert code == 0 and f"signature valid (key id {kid})" in out, out
    code, out = _verify(capsys, release)
    assert code == 0 and f"signed (key id {kid}), signature not checked: pass --key" in out, out
    code, out = _verify(capsys, release, "--key", str(other))
    assert code == 1 and f"signed with key id {kid}, but --key is key id {key_id(other.read_bytes())}" in out

    # A threshold loosened and the id recomputed: the id alone cannot tell, the signature can.
    _rewrite(release, lambda m: m["rollback"]["triggers"][0].update(threshold=0.0))
    code, out = _verify(capsys, release)
    assert code == 0 and "signature not checked: pass --key" in out, out
    code, out = _verify(capsys, release, "--key", str(key))
    assert code == 1 and "FAILED" in out and "signature does not match" in out, out
    # The signature removed as well: without --key it reads as unsigned; with --key it fails.
    _rewrite(release, lambda m: m.update(signature=None))
    code, out = _verify(capsys, release)
    assert code == 0 and "unsigned: integrity only" in out
    code, out = _verify(capsys, release, "--key", str(key))
    assert code == 1 and "not signed, but --key was given" in out, out


def test_valid_signature_vouches_for_absolute_roots(sft_run, tmp_path, capsys):
    """The fixture's eval directory lies beside the run (an absolute root): read once the
    signature checks, refused unread without it."""
    run, eval_dir = sft_run
    key = _key(tmp_path / "release.key")
    assert main(["release", str(run), "--eval", str(eval_dir), *ENGINE, "--sign-key", str(key)]) == 0
    assert "outside   eval: recorded by absolute path" in capsys.readouterr().out
    code, out = _verify(capsys, run / "release.json", "--key", str(key))
    assert code == 0, out
    code, out = _verify(capsys, run / "release.json")
    eval_line = next(line for line in out.splitlines() if line.startswith("eval "))
    assert code == 1 and "REFUSED" in eval_line and "pass --key" in eval_line, out


def test_bad_key_files_and_misplaced_options(sft_run, tmp_path, capsys):
    run, eval_dir = sft_run
    release = ["release", str(run), "--eval", str(eval_dir), *ENGINE]
    cases = [(_key(tmp_path / "short.key", size=5), "5 bytes; a signing key needs at least 32"),
             (_key(tmp_path / "shared.key", mode=0o644), "group or others may read or write it (mode 0644)"),
             (tmp_path / "missing.key", "cannot open the key file"),
             (tmp_path, "not a regular file")]
    for path, needle in cases:
        for argv in ([*release, "--sign-key", str(path)],
                     ["release", "verify", str(tmp_path / "r.json"), "--key", str(path)]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and needle in err and str(path) in err, err
    # A key inside what the release records would ship with the model.
    inside = _key(run / "hf" / "release.key")
    assert main([*release, "--sign-key", str(inside)]) == 2
    assert "lies in RUN_DIR artifact" in capsys.readouterr().err
    inside.unlink()
    for argv, needle in (([*release, "--key", str(tmp_path / "k")], "--key applies to `glmtune release verify`"),
                         (["release", "diff", "a.json", "b.json", "--allow-outside"], "not to `glmtune release diff`"),
                         (["release", "verify", "r.json", "--sign-key", "k"], "--sign-key applies to")):
        assert main(argv) == 2 and needle in capsys.readouterr().err
    assert not (run / "release.json").exists()


def test_signature_is_over_canonical_content():
    """Indentation and key order do not change the signature; any value does."""
    key = b"k" * 32
    manifest = {"format": "glmtune.release/1", "id": "x", "b": [1.5, 1e-07, "é"], "a": {"z": None, "y": 2}}
    manifest["signature"] = sign(manifest, key)
    reordered = json.loads(json.dumps(dict(reversed(list(manifest.items()))), indent=4))
    assert check_signature(reordered, key)["status"] == "valid"
    reordered["b"][1] = 1e-06
    assert check_signature(reordered, key)["status"] == "failed"
    assert check_signature({}, None)["status"] == "unsigned"
    assert check_signature({}, key)["status"] == "failed"
    forged = dict(manifest, signature={**manifest["signature"], "algorithm": "sha256"})
    assert "malformed or not hmac-sha256" in check_signature(forged, None)["problem"]


def test_a_non_finite_score_hashes_and_signs_as_the_file_holds_it():
    """A diverged loss (NaN) or an infinite ratio is written as a string ("NaN": RFC 8259 JSON, which
    jq reads); the id and the signature computed before writing hold for the file read back."""
    key = b"k" * 32
    manifest = {"format": "glmtune.release/1", "scores": {"loss": float("nan"), "ratio": float("inf")}}
    manifest["id"] = release_id(manifest)
    manifest["signature"] = sign(manifest, key)
    written = json_out.dumps(manifest, indent=2)
    read_back = json.loads(written, parse_constant=lambda name: pytest.fail(f"bare {name} in the file"))
    assert read_back["scores"] == {"loss": "NaN", "ratio": "Infinity"}
    assert release_id(read_back) == manifest["id"]
    assert check_signature(read_back, key)["status"] == "valid"
