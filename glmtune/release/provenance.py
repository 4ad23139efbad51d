"""Where a release's model came from besides its weights: data, tokenizer, code and libraries.

  * data: the run's data manifest (hashed, with its counts and the notes of what the filters
    dropped), the training and validation files the run wrote (RUN_DIR/data, an artifact),
    the sources the config names, the data contract (the sha256 of the module that defines
    it, glmtune/data/contract.py, or text_contract.py for raw text: its rules are code), the
    JSON Schema answers were checked against (`data.json_schema`), the PII policy and report,
    and the approval record;
  * tokenizer: the tokenizer files that ship with the model (RUN_DIR/hf for a full
    fine-tune, else the tokenizer the run trained with: `data.tokenizer` or the base's) and
    the chat template they resolve to, hashed as the text `glmtune eval` renders with;
  * environment: glmtune's version and git commit (glmtune/io/revisions.py), the python,
    torch, transformers, peft, safetensors and triton versions installed where the release
    was written.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

import glmtune.data.contract as contract
import glmtune.data.text_contract as text_contract
from glmtune.config import JobConfig
from glmtune.data.chat_template import load_chat_template
from glmtune.data.tokenizer import TOKENIZER_FILES
from glmtune.io.revisions import glmtune_pin
from glmtune.release.artifacts import hash_file, read_json, record_artifact, stored_root

_MANIFEST_KEYS = ("train_conversations", "validation_conversations", "tokenization_key", "filters", "notes")
_LIBRARIES = ("torch", "transformers", "peft", "safetensors", "triton", "tokenizers")


def _sha256_file(path: Path) -> str:
    return hash_file(path)[1]


def data_section(cfg: JobConfig, run_dir: Path, data_manifest: dict[str, Any], manifest_dir: Path,
                 approval: dict[str, Any] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the manifest's `data` section, the data artifacts: data_manifest.json, data/, pii_report.json)."""
    d = cfg.data
    artifacts = [record_artifact("data_manifest", run_dir / "data_manifest.json", "file",
                                 "the run's data manifest", manifest_dir)[0],
                 record_artifact("data", run_dir / "data", "dir", "training and validation files the run wrote",
                                 manifest_dir)[0]]
    pii_report = run_dir / "pii_report.json"
    if pii_report.is_file():
        artifacts.append(record_artifact("pii_report", pii_report, "file", "secrets/PII findings in the data",
                                         manifest_dir)[0])
    schema = None
    if d.json_schema:
        schema_path = Path(d.json_schema)
        if not schema_path.is_file():
            raise ValueError(f"{run_dir / 'config.yaml'}: data.json_schema {schema_path} is missing")
        schema = {"path": str(schema_path.resolve()), "sha256": _sha256_file(schema_path)}
    packing = data_manifest.get("train_packing") or {}
    section = {
        "manifest": {"artifact": "data_manifest", "sha256": artifacts[0]["files"][0]["sha256"],
                     **{k: data_manifest.get(k) for k in _MANIFEST_KEYS},
                     "train_rows": packing.get("num_rows"), "train_tokens": packing.get("num_tokens")},
        "files": {"artifact": "data", "names": [f["path"] for f in artifacts[1]["files"]]},
        "sources": {"train": list(d.train), "validation": list(d.validation),
                    "synthetic": None if d.synthetic is None else
                    {"kind": d.synthetic.kind, "rows": d.synthetic.rows, "seed": d.synthetic.seed},
                    "split": dict(d.split), "split_seed": cfg.train.seed},
        "contract": _contract(d.kind),
        "json_schema": schema,
        "pii": {"policy": d.pii, "report_sha256": artifacts[2]["files"][0]["sha256"] if len(artifacts) > 2 else None},
        "approval": approval,
    }
    return section, artifacts


def _contract(kind: str) -> dict[str, str]:
    """The module whose rules the run's data went through (raw text has its own), by sha256."""
    module = Path((text_contract if kind == "text" else contract).__file__)
    return {"module": f"glmtune/data/{module.name}", "sha256": _sha256_file(module)}


def tokenizer_section(tokenizer_dir: Path, manifest_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the manifest's `tokenizer` section, the tokenizer artifact) for the directory that ships."""
    # present in any form: a FIFO in a tokenizer file's place is refused by record_artifact, not left out
    names = [n for n in TOKENIZER_FILES if os.path.lexists(tokenizer_dir / n)]
    if not names:
        raise ValueError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    artifact, _ = record_artifact("tokenizer", tokenizer_dir, "files", "tokenizer and chat template files",
                                  manifest_dir, files=names)
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = read_json(config_file, str(config_file))[0] if config_file.is_file() else {}  # bounded, before
    template = load_chat_template(tokenizer_dir)  # load_chat_template parses it again
    if (tokenizer_dir / "chat_template.jinja").is_file():
        source = "chat_template.jinja"
    elif isinstance(config, dict) and config.get("chat_template"):
        source = "tokenizer_config.json"
    else:  # load_chat_template's fallback
        source = "bundled GLM-5 template (the directory has none)"
    section = {"path": stored_root(tokenizer_dir, manifest_dir), "artifact": "tokenizer",
               "files": {f["path"]: f["sha256"] for f in artifact["files"]},
               "chat_template": {"source": source, "sha256": hashlib.sha256(template.encode("utf-8")).hexdigest()}}
    return section, artifact


def environment() -> dict[str, Any]:
    """glmtune's version and commit, and the library versions installed here."""
    libraries: dict[str, str | None] = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            libraries[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            libraries[name] = None
    return {"glmtune": glmtune_pin(), "libraries": libraries}
