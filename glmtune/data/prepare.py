"""`glmtune data prepare`: raw rows in, versioned train/validation/test JSONL out.

Pipeline, in order:
  1. read every input (sources.py) and enforce the data contract (contract.py, or
     preferences.py for preference rows: the kind is detected, one for all inputs);
     rows are normalized to the canonical form; no rows at all is an error, raised
     before anything is written;
  2. secrets/PII lint (pii.py), written to `pii_report.json`; the action decides
     what happens to rows with findings: `report` keeps them, `drop` removes them,
     `fail` raises after writing the report;
  3. exact then normalized-text dedup (dedup.py; preference rows by prompt, chosen
     and rejected), before splitting so a duplicate can never sit in both train and test;
  4. group-aware split (split.py; preference rows without a group by their prompt);
  5. each split is written as `{split}-{sha256[:12]}.jsonl` (named by its content
     hash, so a file name pins its exact contents) and `manifest.json` records
     the kind ("chat" or "preference"), input hashes, counts, dedup/lint stats and
     the output files.
The data version is the sha256 of the output files' hashes: identical outputs give
the same version whatever the inputs' paths or order of runs. The manifest has no
timestamps, so re-running on the same inputs rewrites the same bytes.

The output directory is written whole (`glmtune.io.outputs.output_dir`): staged beside
--out and put in place in one step; an existing non-empty --out is replaced only with
`overwrite`, and never one that is, is inside or contains an input.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.io.version import __version__
from glmtune.data.contract import load_schema
from glmtune.data.dedup import dedup_rows
from glmtune.data.pii import PII_ACTIONS, build_report, lint_rows
from glmtune.data.preferences import check_rows_or_raise
from glmtune.data.sources import Row, expand_inputs, file_sha256, no_rows_message, read_rows
from glmtune.data.split import DEFAULT_RATIOS, SPLITS, check_ratios, split_rows
from glmtune.data.tokenizer import GLM5_CONTROL_TOKENS
from glmtune.io.contained import inside
from glmtune.io.json_file import read_json_file
from glmtune.io.outputs import check_output, output_dir

MANIFEST_NAME = "manifest.json"
PII_REPORT_NAME = "pii_report.json"


@dataclass
class PrepareResult:
    version: str
    out_dir: Path
    manifest: dict[str, Any]


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _serialize(rows: list[Row]) -> bytes:
    return "".join(json.dumps(row.data, ensure_ascii=False) + "\n" for row in rows).encode()


def prepare_dataset(inputs: list[str | Path], out_dir: str | Path, *,
                    ratios: tuple[float, float, float] = DEFAULT_RATIOS, pii_action: str = "report",
                    schema_path: str | Path | None = None, split_seed: int = 0,
                    overwrite: bool = False, control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS
                    ) -> PrepareResult:
    """Validate, lint, dedup, split and write a dataset version (see module docstring).

    Args:
        inputs: JSONL/Parquet files, `datasets` save_to_disk directories, or
            directories of JSONL/Parquet files; chat rows or preference rows, one kind.
        out_dir: created if missing; split files, the manifest and the PII report go here.
            Must not be, be inside or contain an input.
        ratios: train/validation/test fractions summing to 1.
        pii_action: "report", "drop" or "fail" (see module docstring).
        schema_path: optional JSON Schema for final answers (contract check; for
            preference rows, chosen answers).
        split_seed: salt of the group hash; change it to draw a different split.
        overwrite: replace an existing non-empty `out_dir`.
        control_tokens: the text no string of a row may hold (the contract's; GLM-5's by default,
            `chat_template.control_tokens` for another model's template and tokenizer).

    Returns:
        The data version, the output directory and the manifest dict.
    """
    if pii_action not in PII_ACTIONS:
        raise ValueError(f"pii action must be one of {PII_ACTIONS}, got {pii_action!r}")
    ratios = check_ratios(ratios)
    schema = load_schema(schema_path) if schema_path is not None else None
    out_dir = Path(out_dir)
    target = {"overwrite": overwrite, "sources": [("input", path) for path in inputs], "what": "--out"}
    check_output(out_dir, **target)  # before the inputs are read

    input_records, rows = _read_inputs(inputs)
    kind, rows = check_rows_or_raise(rows, schema, control_tokens=control_tokens)
    report, kept = _apply_pii_action(rows, pii_action, out_dir, target)
    unique, dedup_stats = dedup_rows(kept)
    outputs, payloads, version = _split_payloads(split_rows(unique, ratios, split_seed))

    manifest = {
        "version": version,
        "glmtune_version": __version__,
        "kind": kind,
        "inputs": input_records,
        "options": _options(ratios, pii_action, split_seed, schema_path),
        "counts": {
            "input_rows": len(rows),
            "pii_dropped": len(rows) - len(kept),
            "exact_duplicates": dedup_stats.num_exact_duplicates,
            "normalized_duplicates": dedup_stats.num_normalized_duplicates,
            "output_rows": len(unique),
            **{name: outputs[name]["rows"] for name in SPLITS},
        },
        "pii": {key: report[key] for key in ("num_rows_with_findings", "num_findings", "by_kind")}
               | {"report": PII_REPORT_NAME},
        "outputs": outputs,
    }
    _write_version(out_dir, target, report, payloads, manifest)
    return PrepareResult(version=version, out_dir=out_dir, manifest=manifest)


def _read_inputs(inputs: list[str | Path]) -> tuple[list[dict[str, Any]], list[Row]]:
    """Every row of the inputs, in order, and one manifest record (path, sha256, rows) per file read."""
    input_records, rows = [], []
    for unit in expand_inputs(inputs):
        unit_rows = list(read_rows(unit))
        input_records.append({"path": str(unit), "sha256": file_sha256(unit), "rows": len(unit_rows)})
        rows.extend(unit_rows)
    if not rows:  # refused before anything is written: an empty version is never what was meant
        raise ValueError(f"{no_rows_message(inputs)}: nothing to prepare")
    return input_records, rows


def _apply_pii_action(rows: list[Row], pii_action: str, out_dir: Path,
                      target: dict[str, Any]) -> tuple[dict[str, Any], list[Row]]:
    """The PII report of `rows` and the rows kept under `pii_action`; with "fail" and any finding,
    `out_dir` receives the report alone and a ValueError follows."""
    per_row_findings = lint_rows(rows)
    report = build_report(per_row_findings, pii_action)
    if pii_action == "fail" and report["num_findings"]:
        with output_dir(out_dir, **target) as tmp:  # the report alone: the user needs it to fix the data
            _write_json(tmp / PII_REPORT_NAME, report)
        raise ValueError(f"{report['num_findings']} secret/PII finding(s) in {report['num_rows_with_findings']} "
                         f"row(s); see {out_dir / PII_REPORT_NAME}")
    clean = [row for row, findings in zip(rows, per_row_findings) if not findings]
    return report, clean if pii_action == "drop" else rows


def _split_payloads(splits: dict[str, list[Row]]) -> tuple[dict[str, dict[str, Any]], dict[str, bytes], str]:
    """Each split's manifest entry (file, sha256, rows) and file bytes by file name, and the data
    version: the sha256 of the splits' hashes, so it follows the outputs alone."""
    outputs: dict[str, dict[str, Any]] = {}
    payloads: dict[str, bytes] = {}
    for name in SPLITS:
        payload = _serialize(splits[name])
        digest = hashlib.sha256(payload).hexdigest()
        file_name = f"{name}-{digest[:12]}.jsonl"
        payloads[file_name] = payload
        outputs[name] = {"file": file_name, "sha256": digest, "rows": len(splits[name])}
    version = hashlib.sha256("".join(f"{name}:{outputs[name]['sha256']}\n" for name in SPLITS).encode()).hexdigest()
    return outputs, payloads, version


def _options(ratios: tuple[float, float, float], pii_action: str, split_seed: int,
             schema_path: str | Path | None) -> dict[str, Any]:
    """The manifest's record of the options that shaped the version (the schema by path and hash)."""
    return {
        "ratios": dict(zip(SPLITS, ratios)),
        "pii_action": pii_action,
        "split_seed": split_seed,
        "schema": None if schema_path is None else {"path": str(schema_path), "sha256": file_sha256(schema_path)},
    }


def _write_version(out_dir: Path, target: dict[str, Any], report: dict[str, Any], payloads: dict[str, bytes],
                   manifest: dict[str, Any]) -> None:
    """`out_dir` whole, in one step: the PII report, the split files and the manifest."""
    with output_dir(out_dir, **target) as tmp:
        _write_json(tmp / PII_REPORT_NAME, report)
        for file_name, payload in payloads.items():
            (tmp / file_name).write_bytes(payload)
        _write_json(tmp / MANIFEST_NAME, manifest)


def split_files(out_dir: str | Path) -> dict[str, Path]:
    """The split files a prepared directory's manifest points at, each a file of that directory
    (`glmtune.io.contained`); a manifest that is not what `prepare_dataset` writes is one
    ValueError naming it."""
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST_NAME
    if not manifest_path.exists():
        raise FileNotFoundError(f"no {MANIFEST_NAME} in {out_dir}; run `glmtune data prepare` first")
    manifest = read_json_file(manifest_path, "prepared data manifest")
    outputs = manifest.get("outputs")
    where = f"prepared data manifest {manifest_path}"
    if not (isinstance(outputs, dict) and set(outputs) == set(SPLITS)
            and all(isinstance(entry, dict) for entry in outputs.values())):
        raise ValueError(f"{where}: its outputs are not one object per split ({', '.join(SPLITS)}); "
                         "not a manifest `glmtune data prepare` writes")
    return {name: inside(out_dir, entry.get("file"), f"{where}: outputs.{name}.file")
            for name, entry in outputs.items()}
