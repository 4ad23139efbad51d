"""What a model card says, gathered from what glmtune already recorded (no prose per run).

    facts = run_facts(cfg, run_dir, model_dir, kind="hf")      # an export: the run's records
    facts = release_facts(manifest, run_dir, model_dir)         # a release: its manifest on top

The facts are a plain dict the card template (model_card.md.jinja) renders and the front
matter (model_card.py) is built from:

  * run: name, description, run id, method (full / lora), objective (sft / dpo), what ships;
  * base: name or path, its hub id when one is known (an HF cache snapshot's
    `models--OWNER--NAME/snapshots/COMMIT`, or a `model.name_or_path` of the form OWNER/NAME
    that is not a local directory), its revision and where that was read, its weight identity,
    and the licence its own model card declares (README.md front matter), if any;
  * training: steps, batch, sequence length, learning rate, dtype; LoRA rank, alpha, the targets
    the run's trainable.json resolved; DPO's beta and loss;
  * data: the sources (files, hub datasets, the synthetic generator), the conversation counts,
    what the filters dropped (the data manifest's notes), the PII policy, the JSON schema, and
    the data contract (glmtune/data/contract.py, by sha256);
  * model: the architecture (config.json of what ships, else the base) and its kept MTP layer;
  * eval (releases): the suite, the candidate's scores of category "all" beside the base's, every
    gate and its verdict, as the release manifest copied them from the scorecard;
  * serving: the engine, version and serve command a release recorded (release/deployment.py),
    with its caveats.

Every file read here is read bounded (`artifacts.read_json`), as the release reads it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import glmtune.data.contract as contract
from glmtune.io.revisions import glmtune_pin, model_revision
from glmtune.models.registry import is_preset
from glmtune.release.artifacts import read_json

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_CACHE_DIR = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9._-]*)--([A-Za-z0-9][A-Za-z0-9._-]*)$")


def hub_id(name_or_path: str, base_dir: Path | None) -> str | None:
    """The hub repository id of the base, when the path or name says it; None otherwise."""
    if base_dir is not None and base_dir.is_dir():
        resolved = base_dir.resolve()
        if resolved.parent.name == "snapshots":
            match = _CACHE_DIR.match(resolved.parent.parent.name)
            if match:
                return f"{match.group(1)}/{match.group(2)}"
        return None  # a local directory: no hub id, the hashes are the pin
    return name_or_path if _HUB_ID.match(name_or_path) else None


def _base_licence(base_dir: Path | None) -> str | None:
    """The licence the base's own model card declares (its README.md front matter)."""
    readme = None if base_dir is None else base_dir / "README.md"
    if readme is None or not readme.is_file() or readme.stat().st_size > 1 << 20:
        return None
    # lazily: huggingface_hub is transformers' dependency, needed only when a base carries a card
    from huggingface_hub import ModelCard

    try:
        licence = ModelCard(readme.read_text(encoding="utf-8"), ignore_metadata_errors=True).data.license
    except (ValueError, UnicodeDecodeError):
        return None
    return licence if isinstance(licence, str) else None


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    found = read_json(path, str(path))[0]
    return found if isinstance(found, dict) else {}


def base_facts(cfg, run_dir: Path, run_record: dict[str, Any]) -> dict[str, Any]:
    """The base as the run recorded it (run.json) and as its directory says (revision, licence)."""
    name = cfg.model.name_or_path
    base_dir = run_dir / "base" if is_preset(name) else Path(name)
    revision, source = model_revision(base_dir) if base_dir.is_dir() and not is_preset(name) else (None, None)
    recorded = run_record.get("base") or {}
    return {"name_or_path": name, "preset": is_preset(name), "hub_id": None if is_preset(name) else hub_id(name, base_dir),
            "revision": revision, "revision_source": source or ("built-in preset: RUN_DIR/base holds its weights"
                                                                if is_preset(name) else None),
            "weights_sha256": recorded.get("weights_sha256"), "config_sha256": recorded.get("config_sha256"),
            "license": _base_licence(base_dir if base_dir.is_dir() else None)}


def _lora_targets(run_dir: Path) -> list[str]:
    groups = _json(run_dir / "trainable.json").get("groups") or {}
    return [t for group in groups.values() if isinstance(group, dict) for t in group.get("targets") or []
            if isinstance(t, str)]


def training_facts(cfg, run_dir: Path) -> dict[str, Any]:
    t, p = cfg.train, cfg.peft
    facts = {"objective": t.objective, "max_steps": t.max_steps, "global_batch_size": t.global_batch_size,
             "packed_sequence_size": cfg.data.packed_sequence_size, "lr": cfg.optim.lr, "dtype": cfg.model.dtype,
             "mtp_loss_weight": t.mtp_loss_weight, "lora": None, "dpo": None}
    if p.method == "lora":
        facts["lora"] = {"rank": p.rank, "alpha": p.alpha, "rslora": p.rslora, "dropout": p.dropout,
                         "targets": _lora_targets(run_dir) or list(p.target_modules or []),
                         "exclude": list(p.exclude_modules)}
    if t.objective == "dpo":
        facts["dpo"] = {"beta": cfg.dpo.beta, "loss": cfg.dpo.loss, "reference": cfg.dpo.reference}
    return facts


def data_facts(cfg, run_dir: Path) -> dict[str, Any]:
    d = cfg.data
    manifest = _json(run_dir / "data_manifest.json")
    hub = [s for s in [*d.train, *d.validation] if not Path(s).exists() and _HUB_ID.match(s)]
    return {"train": list(d.train), "validation": list(d.validation), "hub_datasets": hub,
            "synthetic": None if d.synthetic is None else
            {"kind": d.synthetic.kind, "rows": d.synthetic.rows, "seed": d.synthetic.seed},
            "train_conversations": manifest.get("train_conversations"),
            "validation_conversations": manifest.get("validation_conversations"),
            "filters": manifest.get("filters") or {}, "notes": [n for n in manifest.get("notes") or []
                                                                 if isinstance(n, str)],
            "train_tokens": (manifest.get("train_packing") or {}).get("num_tokens"),
            "pii": d.pii, "json_schema": d.json_schema, "loss_on": d.loss_on,
            "contract_sha256": hashlib.sha256(Path(contract.__file__).read_bytes()).hexdigest()}


def model_facts(model_dir: Path | None) -> dict[str, Any]:
    """The architecture of what ships (its config.json), with its MTP layers' on-disk index."""
    config = _json(model_dir / "config.json") if model_dir is not None else {}
    layers, mtp = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers") or 0
    return {"model_type": config.get("model_type"), "architectures": config.get("architectures") or [],
            "num_hidden_layers": layers, "mtp_layers": mtp if isinstance(mtp, int) else 0}


def run_facts(cfg, run_dir: Path, model_dir: Path | None, kind: str) -> dict[str, Any]:
    """The card's facts for an export of the run (`kind`: hf, merged or adapter)."""
    record = _json(run_dir / "run.json")
    method = "lora" if cfg.peft.method == "lora" else "full"
    return {"kind": kind, "glmtune": glmtune_pin().get("version"),
            "run": {"name": cfg.name, "description": cfg.description, "run_id": record.get("run_id"),
                    "run_dir": str(run_dir.resolve()),
                    "method": method, "objective": cfg.train.objective},
            "base": base_facts(cfg, run_dir, record), "training": training_facts(cfg, run_dir),
            "data": data_facts(cfg, run_dir), "model": model_facts(model_dir), "eval": None, "serving": None}


def run_dir_of_adapter(adapter_dir: Path) -> Path | None:
    """The run directory an adapter came from: its parent (RUN_DIR/adapter, RUN_DIR/adapter_per_expert),
    or the run its glmtune model card names (an export: `glmtune.run_dir`) when that directory still
    holds the run of the card's run id; None otherwise."""
    candidates = [adapter_dir.parent]
    card = adapter_dir / "README.md"
    if card.is_file() and card.stat().st_size < 1 << 20:
        # lazily: huggingface_hub reads the card's front matter only when there is a card
        from huggingface_hub import ModelCard

        try:
            block = ModelCard(card.read_text(encoding="utf-8"), ignore_metadata_errors=True).data.to_dict()
        except (ValueError, UnicodeDecodeError):
            block = {}
        recorded = (block.get("glmtune") or {}) if isinstance(block.get("glmtune"), dict) else {}
        if isinstance(recorded.get("run_dir"), str):
            candidates.append(Path(recorded["run_dir"]))
        wanted = recorded.get("run_id")
    else:
        wanted = None
    for run_dir in candidates:
        record = _json(run_dir / "run.json") if (run_dir / "config.yaml").is_file() else {}
        if record.get("run_id") and (wanted is None or record["run_id"] == wanted):
            return run_dir
    return None


def _eval_facts(section: dict[str, Any]) -> dict[str, Any]:
    """The release's eval section as the card shows it: the candidate's scores beside the base's."""
    labels = {m.get("role"): m.get("label") for m in section.get("models") or []}
    candidate, base = section.get("candidate"), labels.get("base")
    rows = []
    for score in section.get("scores") or []:
        values = score.get("values") or {}
        if values.get(candidate) is None:
            continue
        rows.append({"metric": score["id"], "candidate": values.get(candidate), "base": values.get(base),
                     "delta": (score.get("delta") or {}).get(candidate), "n": score.get("n"),
                     "higher_is_better": score.get("higher_is_better")})
    suite = section.get("suite") or {}
    return {"suite": suite.get("name"), "version": suite.get("version"), "suite_sha256": suite.get("sha256"),
            "sets": suite.get("sets") or [], "candidate": candidate, "base": base, "scores": rows,
            "gates": section.get("gates") or [], "passed": section.get("passed"),
            "allowed_failed_gates": section.get("allowed_failed_gates")}


def release_facts(manifest: dict[str, Any], cfg, run_dir: Path, model_dir: Path | None) -> dict[str, Any]:
    """The card's facts for a release: the run's, with the manifest's base, eval and engine."""
    facts = run_facts(cfg, run_dir, model_dir, kind="release")
    base = manifest["base"]
    facts["base"].update({k: base.get(k) for k in ("revision", "revision_source", "weights_sha256",
                                                   "config_sha256") if base.get(k) is not None})
    facts["eval"] = _eval_facts(manifest["eval"])
    engine = manifest["engine"]
    facts["serving"] = {"engine": engine.get("name"), "version": engine.get("version"),
                        "serve_command": engine.get("serve_command"), "caveats": engine.get("caveats") or [],
                        "note": engine.get("note")}
    facts["run"]["shipped"] = manifest["run"].get("shipped") or []
    return facts
