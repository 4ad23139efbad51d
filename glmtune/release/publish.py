"""`glmtune publish RELEASE.json --repo OWNER/NAME`: a release's files to a Hugging Face Hub model
repository, through huggingface_hub (`HfApi.create_repo`, `HfApi.create_commit`), in one commit.

What is uploaded (`publish_plan`), each file exactly as the manifest records it:

    the shipped artifact      checkpoint (full fine-tune: config, shards, tokenizer) or adapter
                              (LoRA, PEFT layout) at the repository's root; adapter_per_expert
                              (the vLLM / SGLang layout) under per_expert/
    the model card            the release's card (release.md, artifact model_card) as README.md
    the manifest              release.json

The base, the data and the eval directory stay where they are: the card and the manifest name
them by hash. Before anything is sent, the manifest's id must match its content and every
uploaded artifact must re-hash to what the manifest records (`release verify` for those
artifacts): a drifted release is refused, naming the first difference.

The token: read from an environment variable (HF_TOKEN, or the one `token_env` names), passed to
HfApi in memory and never written anywhere: no login, no token file, no option holding it (a
command line is visible to other users in `ps` and kept in shell history). No token: refused
before anything is read over the network. The endpoint is huggingface_hub's, or HF_ENDPOINT's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi

from glmtune.io.text_limits import printable
from glmtune.release.artifacts import check_artifact, resolve_root
from glmtune.release.manifest import load_release, release_id

DEFAULT_TOKEN_ENV = "HF_TOKEN"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# artifact name -> the folder it goes to in the repository ("" = its root)
_PUBLISHED = {"checkpoint": "", "adapter": "", "adapter_per_expert": "per_expert/"}
CARD_IN_REPO, MANIFEST_IN_REPO = "README.md", "release.json"


@dataclass
class PublishedFile:
    path_in_repo: str
    local: Path
    size: int


def read_token(token_env: str = DEFAULT_TOKEN_ENV) -> str:
    """The token in environment variable `token_env`; ValueError when it is not set."""
    if not _ENV_NAME.match(token_env):
        raise ValueError(f"--token-env {printable(token_env)}: not an environment variable name")
    token = os.environ.get(token_env, "").strip()
    if not token:
        raise ValueError(f"no Hugging Face token: ${token_env} is not set. Export a write token "
                         f"(https://huggingface.co/settings/tokens) as {token_env}, or name the variable holding "
                         "it with --token-env NAME; glmtune reads it from the environment only and never writes it")
    return token


def check_repo_id(repo: str) -> str:
    if not _REPO_ID.match(repo) or ".." in repo or repo.endswith((".git", ".")):
        raise ValueError(f"--repo {printable(repo)}: not a repository id OWNER/NAME (letters, digits, . _ -)")
    return repo


def publish_plan(release: str | Path, allow_outside: bool = False) -> tuple[dict[str, Any], list[PublishedFile]]:
    """(the manifest, the files to upload) after checking the manifest and re-hashing them."""
    path = Path(release)
    manifest, _ = load_release(path)
    if manifest.get("id") != release_id(manifest):
        raise ValueError(f"release {path}: its content does not match its id {printable(manifest.get('id'))} "
                         "(edited after it was written): `glmtune release verify` says more")
    manifest_dir = path.absolute().parent
    entries = {a.get("name"): a for a in manifest.get("artifacts") or [] if isinstance(a, dict)}
    if "model_card" not in entries:
        raise ValueError(f"release {path} has no model card (written before glmtune wrote one): release the run "
                         "again (glmtune release RUN_DIR ... --overwrite) to publish it with its card")
    files: dict[str, PublishedFile] = {}
    for name in [*(n for n in _PUBLISHED if n in entries), "model_card"]:
        entry = entries[name]
        status, problems = check_artifact(entry, manifest_dir, allow_absolute=allow_outside)
        if status != "ok":
            hint = " (recorded by absolute path: --allow-outside reads it)" if status == "REFUSED" else ""
            raise ValueError(f"release {path}: artifact {printable(name)} is {status}: {printable(problems[0])}{hint}; "
                             "`glmtune release verify` lists every difference")
        root = resolve_root(entry["root"], manifest_dir)
        for f in entry["files"]:
            local = root if entry["kind"] == "file" else root / f["path"]
            target = CARD_IN_REPO if name == "model_card" else _PUBLISHED[name] + f["path"]
            files[target] = PublishedFile(target, local, f["size"])  # the release's card wins over any README
    files[MANIFEST_IN_REPO] = PublishedFile(MANIFEST_IN_REPO, path, path.stat().st_size)
    return manifest, sorted(files.values(), key=lambda f: f.path_in_repo)


def publish(release: str | Path, repo: str, token: str, *, private: bool = False, revision: str | None = None,
            allow_outside: bool = False) -> tuple[str, list[PublishedFile]]:
    """Create `repo` if needed and upload the release's files in one commit; (commit URL, files)."""
    check_repo_id(repo)
    manifest, files = publish_plan(release, allow_outside)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
    operations = [CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local)) for f in files]
    run = manifest.get("run") or {}
    commit = api.create_commit(
        repo, operations, revision=revision, repo_type="model",
        commit_message=f"glmtune release {manifest['id']} ({run.get('method')}, run {run.get('run_id')})",
        commit_description="Uploaded by `glmtune publish`: the shipped artifact, the model card (README.md) and "
                           "the release manifest (release.json: every file's sha256; docs/release.md).")
    return commit.commit_url, files
