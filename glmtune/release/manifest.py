"""`release.json`: one finished run, as evaluated, recorded as a versioned release (docs/release.md).

    from glmtune.release import ReleaseRequest, create_release
    manifest, path = create_release(ReleaseRequest(run_dir, eval_dir, engine="vllm==0.11.0"))

Everything cheap is checked before any file is hashed: the run (finished, not training
now), the eval directory (its scorecard, suite copy and sets intact), the gates (a failed
eval is refused unless `allow_failed_gates`, which the manifest records), the engine, the
approval, the rollback triggers' syntax, the previous release, and the output path (an
existing file needs `overwrite`; a path that is, is inside or contains anything the release
reads is refused). Then every artifact is hashed and the eval's candidate is matched with the
run's artifacts as they are now.

The release id is the first 16 hex digits of the sha256 of the manifest's canonical JSON
(sorted keys) without `id`, `created` and `signature`: the same inputs give the same id, and
`glmtune release verify` recomputes it to notice a manifest edited by hand. It proves
integrity, not authenticity: whoever edits a manifest can recompute it. `sign_key` adds an
HMAC-SHA256 signature that only a holder of the key can make (glmtune/release/signing.py).

Every JSON record read here (run.json, data_manifest.json, the scorecard, --previous) has
its size and nesting bounded (`artifacts.read_json`): a damaged or hostile file is a
one-line error naming it. A symlink inside RUN_DIR's recorded artifacts that leads out of
RUN_DIR is refused before anything is hashed (glmtune/release/paths.py).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from glmtune.config import JobConfig, config_from_dict
from glmtune.config.yaml_layers import load_yaml_text
from glmtune.data.tokenizer import resolve_tokenizer_dir
from glmtune.io import json_out
from glmtune.io.outputs import check_output, output_file
from glmtune.io.run_lock import RUN_FILE, lock_holder
from glmtune.io.text_limits import printable
from glmtune.models.registry import is_preset
from glmtune.release import model_card, signing, triggers
from glmtune.release.artifacts import MAX_JSON_BYTES, read_format_json, read_json, record_artifact, stored_root
from glmtune.release.base_model import BASE_DIR, record_base, record_hf_dir
from glmtune.release.deployment import deployment
from glmtune.release.eval_record import check_evaluated_base, eval_section, failed_gates, load_eval, released_candidate
from glmtune.release.fields import Fields
from glmtune.release.model_card_facts import release_facts
from glmtune.release.paths import innermost, is_link_refusal, walk, within
from glmtune.release.provenance import data_section, environment, tokenizer_section

FORMAT = "glmtune.release/1"
RELEASE_FILE = "release.json"
_ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_ENGINE_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+!-]*$")


@dataclass
class ReleaseRequest:
    """What `glmtune release RUN_DIR --eval EVAL_DIR ...` asks for (each field is its option)."""

    run_dir: Path
    eval_dir: Path
    engine: str | None = None  # "NAME==VERSION", or NAME with `engine_version`
    engine_version: str | None = None
    out: Path | None = None  # default RUN_DIR/release.json
    overwrite: bool = False
    previous: Path | None = None
    approved_by: str | None = None
    approval_note: str | None = None
    rollback: list[str] = field(default_factory=list)
    rollback_margin: float = triggers.DEFAULT_MARGIN
    allow_failed_gates: bool = False
    sign_key: Path | None = None  # a key file: sign the manifest (HMAC-SHA256)


def canonical_sha256(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k not in ("id", "created", "signature")}
    # as the file holds it: a non-finite number is written as its spelling (json_out), so hashed as one
    return hashlib.sha256(json.dumps(json_out.finite(body), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def release_id(manifest: dict[str, Any]) -> str:
    return canonical_sha256(manifest)[:16]


def load_release(path: str | Path, what: str = "release") -> tuple[dict[str, Any], str]:
    """(manifest, sha256 of the file) of a release.json; ValueError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    manifest, raw = read_format_json(path, FORMAT, f"{what} {path}", " (not a glmtune release)")
    return manifest, hashlib.sha256(raw).hexdigest()


def parse_engine(engine: str | None, version: str | None) -> dict[str, str]:
    if not engine:
        raise ValueError("--engine is required: the inference engine and version that will serve this release, "
                         "e.g. --engine vllm==0.11.0 (engines differ in how they read weights and templates)")
    name, sep, pinned = engine.partition("==")
    if sep and version:
        raise ValueError(f"--engine {engine} already names a version; drop --engine-version {version}")
    version = pinned if sep else version
    if not version:
        raise ValueError(f"--engine {engine}: give its version, --engine {engine}==VERSION or --engine-version VERSION")
    if not _ENGINE_NAME.match(name):
        raise ValueError(f"--engine {engine}: {name!r} is not an engine name (letters, digits, . _ + -)")
    if not _ENGINE_VERSION.match(version):
        raise ValueError(f"--engine {engine}: {version!r} is not a version (letters, digits, . _ + ! -)")
    return {"name": name, "version": version}


def _approval(by: str | None, note: str | None, at: str) -> dict[str, Any] | None:
    if note is not None and by is None:
        raise ValueError("--approval-note needs --approved-by (who approved the release)")
    if by is None:
        return None
    if not by.strip():
        raise ValueError("--approved-by is empty")
    return {"approved_by": by, "note": note, "at": at}


def _check_not_training(run_dir: Path) -> None:
    holder = lock_holder(run_dir)  # a training run holds its lock exclusively
    if holder is not None:
        raise ValueError(f"RUN_DIR {run_dir} is in use by {holder}: release the run once it has finished")


def _read_run(run_dir: Path):
    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR {run_dir}: no such directory")
    config_path, record_path = run_dir / "config.yaml", run_dir / RUN_FILE
    if not config_path.is_file():
        raise ValueError(f"RUN_DIR {run_dir}: no config.yaml (not a glmtune run directory)")
    if not record_path.is_file():
        raise ValueError(f"RUN_DIR {run_dir}: no run.json (not a glmtune run directory)")
    record, _ = read_json(record_path, str(record_path))
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise ValueError(f"{record_path}: not a glmtune run record (no run_id)")
    _check_not_training(run_dir)
    resolved = _read_yaml(config_path)
    cfg = config_from_dict(resolved, source=str(config_path))
    data_manifest = run_dir / "data_manifest.json"
    if not data_manifest.is_file():
        raise ValueError(f"RUN_DIR {run_dir}: no data_manifest.json (the run did not get past data preparation)")
    data, _ = read_json(data_manifest, str(data_manifest))
    if not isinstance(data, dict):
        raise ValueError(f"{data_manifest}: not a data manifest (a JSON object)")
    return cfg, record, resolved, data


def _read_yaml(path: Path) -> Any:
    """The resolved config, bounded like the JSON records: one line naming the file otherwise."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size:,} bytes, more than the {MAX_JSON_BYTES:,} a config may have")
    try:
        return load_yaml_text(path.read_text(encoding="utf-8"), str(path)) or {}
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not YAML ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") \
            from None


def _deployable(run_dir: Path, lora: bool) -> list[tuple[str, Path, str]]:
    """(artifact name, directory, what) of what ships: the adapters, or the full checkpoint."""
    if lora:
        if not (run_dir / "adapter").is_dir():
            raise ValueError(f"RUN_DIR {run_dir} has no adapter/: the LoRA run has not finished (the adapter is "
                             "written at its end)")
        found = [("adapter", run_dir / "adapter", "LoRA adapter (PEFT layout)")]
        if (run_dir / "adapter_per_expert").is_dir():
            found.append(("adapter_per_expert", run_dir / "adapter_per_expert",
                          "LoRA adapter (per-expert layout: vLLM, SGLang)"))
        return found
    if not (run_dir / "hf").is_dir():
        raise ValueError(f"RUN_DIR {run_dir} has no hf/: the run has not finished or did not export an HF "
                         "checkpoint (checkpoint.export_hf false)")
    return [("checkpoint", run_dir / "hf", "full fine-tuned HF checkpoint")]


def _previous(path: Path | None, manifest_dir: Path) -> dict[str, Any] | None:
    if path is None:
        return None
    previous, sha = load_release(path, "--previous")
    if previous.get("id") != release_id(previous):
        raise ValueError(f"--previous {path}: its content does not match its id {printable(previous.get('id'))} "
                         "(edited after it was written)")
    fields = Fields(previous, f"--previous {path}")  # a hand-made manifest may hold any type anywhere
    return {"path": stored_root(path, manifest_dir), "sha256": sha, "id": fields.str("id", required=True),
            "created": fields.scalar("created"), "run_id": fields.dict("run").scalar("run_id")}


def create_release(req: ReleaseRequest) -> tuple[dict[str, Any], Path]:
    """Build the manifest of `req` and write it atomically; returns (manifest, path)."""
    run_dir, eval_dir = Path(req.run_dir), Path(req.eval_dir)
    out = Path(req.out) if req.out is not None else run_dir / RELEASE_FILE
    manifest_dir = out.absolute().parent
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    engine = parse_engine(req.engine, req.engine_version)
    approval = _approval(req.approved_by, req.approval_note, created)
    key = signing.read_key(req.sign_key, "--sign-key") if req.sign_key is not None else None
    inputs = _read_inputs(run_dir, eval_dir, req.allow_failed_gates)
    engine.update(deployment(engine, inputs.cfg, run_dir, inputs.base_dir))
    tokenizer_dir = _tokenizer_dir(inputs.cfg, run_dir, inputs.lora, inputs.base_dir)
    recorded = _recorded_inputs(run_dir, eval_dir, inputs.deployable, inputs.base_dir, tokenizer_dir)
    reads = recorded + ([("--previous", Path(req.previous))] if req.previous is not None else [])
    check_output(out, kind="file", overwrite=req.overwrite, sources=reads, what="--out", command="release")
    card = model_card.release_card_path(out)
    check_output(card, kind="file", overwrite=req.overwrite, sources=reads, what="model card", command="release")
    _check_links(recorded, run_dir, manifest_dir)
    if req.sign_key is not None:
        _check_key_outside(Path(req.sign_key), recorded)
    previous = _previous(req.previous, manifest_dir)

    manifest = _hashed_manifest(req, inputs, tokenizer_dir, manifest_dir, created=created, engine=engine,
                                approval=approval, previous=previous)
    model_dir = inputs.base_dir if inputs.lora else run_dir / "hf"  # whose config.json describes what ships
    facts = release_facts(manifest, inputs.cfg, run_dir, model_dir)
    manifest["artifacts"].append(model_card.write_release_card(card, facts, out.name, manifest_dir,
                                                               overwrite=req.overwrite, sources=reads))
    manifest["id"] = release_id(manifest)
    if key is not None:
        manifest["signature"] = signing.sign(manifest, key)
    with output_file(out, overwrite=req.overwrite, sources=reads, what="--out", command="release") as tmp:
        tmp.write_text(json_out.dumps(manifest, indent=2) + "\n", encoding="utf-8")  # RFC 8259: no bare NaN
    return manifest, out


@dataclass
class _Inputs:
    """The run and the eval a release reads, as the cheap checks found them (nothing hashed yet)."""

    run_dir: Path
    eval_dir: Path
    cfg: JobConfig
    run_record: dict[str, Any]
    resolved: Any  # config.yaml as read, recorded as it is
    data_manifest: dict[str, Any]
    lora: bool
    deployable: list[tuple[str, Path, str]]
    scorecard: dict[str, Any]
    scorecard_sha: str
    base_dir: Path


def _read_inputs(run_dir: Path, eval_dir: Path, allow_failed_gates: bool) -> _Inputs:
    """Read the finished run, what it ships and the eval that scored it; a failed eval is refused
    unless `allow_failed_gates`."""
    cfg, run_record, resolved, data_manifest = _read_run(run_dir)
    lora = cfg.peft.method == "lora"
    deployable = _deployable(run_dir, lora)
    scorecard, scorecard_sha = load_eval(eval_dir)
    if not scorecard["passed"] and not allow_failed_gates:
        raise ValueError(f"--eval {eval_dir}: the eval failed its release gates: {'; '.join(failed_gates(scorecard))}"
                         " (--allow-failed-gates releases anyway and records it)")
    base_dir = (run_dir / BASE_DIR) if is_preset(cfg.model.name_or_path) else Path(cfg.model.name_or_path)
    return _Inputs(run_dir, eval_dir, cfg, run_record, resolved, data_manifest, lora, deployable, scorecard,
                   scorecard_sha, base_dir)


def _hashed_manifest(req: ReleaseRequest, inputs: _Inputs, tokenizer_dir: Path, manifest_dir: Path, *,
                     created: str, engine: dict[str, Any], approval: dict[str, Any] | None,
                     previous: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest but for its model card, id and signature: every artifact hashed, and the eval's
    candidate matched with the run's artifacts as they are now."""
    run_dir, eval_dir, cfg, scorecard = inputs.run_dir, inputs.eval_dir, inputs.cfg, inputs.scorecard
    # The deployable artifacts first (the candidate check needs them), then the rest.
    artifacts, shipped = _record_deployable(inputs.deployable, manifest_dir)
    candidate, evaluated = released_candidate(scorecard, run_dir, shipped, eval_dir)
    rollback, untriggered = triggers.resolve_triggers(scorecard, candidate["label"], list(req.rollback),
                                                      req.rollback_margin)
    base, base_artifact = record_base(cfg, run_dir, inputs.run_record, manifest_dir, inputs.lora)
    check_evaluated_base(candidate, base, eval_dir)
    if base_artifact is not None:
        artifacts.append(base_artifact)
    tokenizer, tokenizer_artifact = tokenizer_section(tokenizer_dir, manifest_dir)
    _check_template(tokenizer, scorecard, eval_dir)
    data, data_artifacts = data_section(cfg, run_dir, inputs.data_manifest, manifest_dir, approval)
    artifacts += [tokenizer_artifact, *data_artifacts]
    for name, path, what in (("config", run_dir / "config.yaml", "the resolved training config"),
                             ("run_record", run_dir / RUN_FILE, "the run's id (run.json)")):
        artifacts.append(record_artifact(name, path, "file", what, manifest_dir)[0])
    artifacts.append(record_artifact("eval", eval_dir, "dir", "the eval directory (scorecard, suite, sets)",
                                     manifest_dir)[0])
    by_name = {a["name"]: a for a in artifacts}
    return {
        "format": FORMAT,
        "id": None,
        "created": created,
        "run": {"path": stored_root(run_dir, manifest_dir), "run_id": inputs.run_record["run_id"],
                "run_created": inputs.run_record.get("created"), "name": cfg.name,
                "method": "lora" if inputs.lora else "full", "shipped": [name for name, _, _ in inputs.deployable]},
        "base": base,
        "engine": engine,
        "tokenizer": tokenizer,
        "prompt": dict(scorecard.get("prompt") or {}),  # system prompt, tool schema, template hashes
        "eval": eval_section(scorecard, inputs.scorecard_sha, candidate, evaluated, req.allow_failed_gates,
                             by_name["eval"]["root"]),
        "data": data,
        "config": {"artifact": "config", "sha256": by_name["config"]["files"][0]["sha256"],
                   "resolved": inputs.resolved},
        "environment": environment(),
        "previous": previous,
        "rollback": {"margin": req.rollback_margin, "to": previous["id"] if previous else None,
                     "triggers": rollback, "untriggered": untriggered},
        "artifacts": artifacts,
        "signature": None,
    }


def _recorded_inputs(run_dir: Path, eval_dir: Path, deployable: list[tuple[str, Path, str]], base_dir: Path,
                     tokenizer_dir: Path) -> list[tuple[str, Path]]:
    """(label, path) of everything the release records as an artifact."""
    found = [("RUN_DIR artifact", p) for _, p, _ in deployable] + [
        ("EVAL_DIR", eval_dir), ("the base model", base_dir), ("the tokenizer", tokenizer_dir),
        ("RUN_DIR data", run_dir / "data"), ("RUN_DIR config", run_dir / "config.yaml"),
        ("RUN_DIR record", run_dir / RUN_FILE), ("RUN_DIR data manifest", run_dir / "data_manifest.json")]
    if (run_dir / "pii_report.json").is_file():
        found.append(("RUN_DIR PII report", run_dir / "pii_report.json"))
    return found


def _record_deployable(deployable: list[tuple[str, Path, str]],
                       manifest_dir: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """(the shipped artifacts' entries, {name: the hashes the scorecard names candidates by})."""
    artifacts, shipped = [], {}
    for name, path, what in deployable:
        if name == "checkpoint":
            artifact, identity = record_hf_dir(name, path, what, manifest_dir)
            shipped[name] = {k: identity[k] for k in ("config_sha256", "weights_sha256")}
        else:
            artifact, _ = record_artifact(name, path, "dir", what, manifest_dir)
            files = {f["path"]: f["sha256"] for f in artifact["files"]}
            shipped[name] = {"config_sha256": files.get("adapter_config.json"),
                             "weights_sha256": files.get("adapter_model.safetensors")}
        artifacts.append(artifact)
    return artifacts, shipped


def _check_links(recorded: list[tuple[str, Path]], run_dir: Path, manifest_dir: Path) -> None:
    """Refuse, before anything is hashed, a link in what the release records that leads out of
    RUN_DIR (for what lies in it) or out of the release file's directory (for what is recorded
    relative to it): verify would refuse to read it, and the release would record files that
    are not the run's. Links that stay inside are followed. An entry that is not a regular file
    (a FIFO, a socket, a device, a link to nothing) is refused too (paths.walk)."""
    run_tree = os.path.realpath(run_dir)
    for what, path in recorded:
        tree = innermost(path, [run_dir, manifest_dir])
        if tree is None or not os.path.lexists(path):
            continue  # outside both: recorded by absolute path, links followed; missing: named later
        if not within(path, tree):
            refused = {path.name: f"{path.name} leads out of {tree} (a link)"}
        else:
            refused = walk(path, tree)[1] if path.is_dir() else {}
        if refused:
            inside = "RUN_DIR" if tree == run_tree else "the release file's directory"
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            first = next(iter(refused.values()))
            hint = (f": a release follows links only where they stay inside {inside}; copy the target in"
                    if is_link_refusal(first) else "")
            raise ValueError(f"{what} {path}: {first}{more}{hint}")


def _check_key_outside(key: Path, recorded: list[tuple[str, Path]]) -> None:
    real = os.path.realpath(key)
    for what, path in recorded:
        if within(real, os.path.realpath(path)):
            raise ValueError(f"--sign-key {key} lies in {what} {path}: the release would record it and it would "
                             "ship with the model; keep the key outside what you release")


def _tokenizer_dir(cfg, run_dir: Path, lora: bool, base_dir: Path) -> Path:
    """The tokenizer that ships: the full checkpoint's copy, else the one the run trained with."""
    if not lora:
        return run_dir / "hf"
    return resolve_tokenizer_dir(cfg.data.tokenizer or base_dir)


def _check_template(tokenizer: dict[str, Any], scorecard: dict[str, Any], eval_dir: Path) -> None:
    evaluated = (scorecard.get("prompt") or {}).get("chat_template_sha256")
    shipped = tokenizer["chat_template"]["sha256"]
    if evaluated and evaluated != shipped:
        raise ValueError(f"--eval {eval_dir}: the eval rendered prompts with chat template {evaluated[:12]}…, but "
                         f"the release ships {shipped[:12]}… ({tokenizer['chat_template']['source']} in "
                         f"{tokenizer['path']}): evaluate with the template that will serve")
