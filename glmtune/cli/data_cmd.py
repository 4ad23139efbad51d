"""`glmtune data validate|prepare|synth`: check, version and generate chat datasets.

  glmtune data validate PATH... [--schema S]    every contract violation as file:line: field: reason
  glmtune data prepare PATH... --out DIR         dedup, PII lint, group split, versioned JSONL + manifest
  glmtune data synth OUT [--rows N --seed S]     the bundled support-ticket task as JSONL
(prepare and synth refuse an existing non-empty output unless --overwrite; synth never replaces a directory)
"""

from __future__ import annotations

import argparse
from typing import Any


def _validate(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.contract import load_schema, validate_row
    from glmtune.data.sources import no_rows_message, read_rows

    schema = load_schema(args.schema) if args.schema else None
    num_rows = num_violations = num_bad_rows = 0
    for row in read_rows(args.paths):
        num_rows += 1
        violations = validate_row(row, schema)
        num_bad_rows += bool(violations)
        num_violations += len(violations)
        for violation in violations:
            print(violation)
    if not num_rows:  # an empty dataset would otherwise pass as "OK: 0 row(s)"
        raise ValueError(f"{no_rows_message(args.paths)}: nothing to validate")
    if num_violations:
        print(f"{num_violations} violation(s) in {num_bad_rows} of {num_rows} row(s)")
        return 1
    print(f"OK: {num_rows} row(s), 0 violations")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.prepare import prepare_dataset
    from glmtune.data.split import parse_ratios

    result = prepare_dataset(args.paths, args.out, ratios=parse_ratios(args.ratios), pii_action=args.pii,
                             schema_path=args.schema, split_seed=args.split_seed, overwrite=args.overwrite)
    counts, pii = result.manifest["counts"], result.manifest["pii"]
    print(f"read {counts['input_rows']} row(s); dropped {counts['exact_duplicates']} exact and "
          f"{counts['normalized_duplicates']} normalized duplicate(s), {counts['pii_dropped']} for PII "
          f"({pii['num_findings']} finding(s) in {pii['num_rows_with_findings']} row(s), see {pii['report']})")
    for name, entry in result.manifest["outputs"].items():
        print(f"  {name:10s} {entry['rows']:8d} rows  {result.out_dir / entry['file']}")
    print(f"data version {result.version}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.synthetic import SCHEMA_PATH, check_jsonl_target, generate_rows, write_jsonl

    check_jsonl_target(args.out, overwrite=args.overwrite)  # before generating the rows
    path = write_jsonl(generate_rows(args.rows, seed=args.seed), args.out, overwrite=args.overwrite)
    print(f"wrote {args.rows} row(s) to {path} (answer schema: {SCHEMA_PATH})")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("data", help="validate, prepare and synthesize chat datasets",
                                   description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION")
    parser.set_defaults(func=lambda _: parser.print_help() or 0)

    validate = actions.add_parser(
        "validate", help="check rows against the data contract",
        description="List every data-contract violation as `file:line: field: reason`. "
                    "Exit status 1 if there is any, 0 if the data is clean.")
    validate.add_argument("paths", nargs="+", metavar="PATH",
                          help=".jsonl / .parquet files, datasets save_to_disk directories, or folders of files")
    validate.add_argument("--schema", metavar="S", help="JSON Schema the final assistant answer (as JSON) must satisfy")
    validate.set_defaults(func=_validate)

    prepare = actions.add_parser(
        "prepare", help="dedup, lint, split and write a versioned dataset",
        description="Validate, lint for secrets/PII, dedup (exact and normalized text), split by group, and write "
                    "{split}-{sha256[:12]}.jsonl files plus manifest.json and pii_report.json into --out.")
    prepare.add_argument("paths", nargs="+", metavar="PATH", help="input files or directories")
    prepare.add_argument("--out", required=True, metavar="DIR", help="output directory")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace DIR if it exists and is not empty (never an input)")
    prepare.add_argument("--ratios", default="0.9,0.05,0.05", metavar="T,V,E",
                         help="train,validation,test fractions summing to 1 (default: 0.9,0.05,0.05)")
    prepare.add_argument("--pii", choices=("report", "drop", "fail"), default="report",
                         help="what to do with rows that contain secrets/PII (default: report)")
    prepare.add_argument("--schema", metavar="S", help="JSON Schema for final answers (contract check)")
    prepare.add_argument("--split-seed", type=int, default=0, help="salt of the group hash (default: 0)")
    prepare.set_defaults(func=_prepare)

    synth = actions.add_parser(
        "synth", help="write the bundled synthetic support-ticket dataset",
        description="Generate the deterministic support-ticket triage task (JSON answers, ~20%% tool calls).")
    synth.add_argument("out", metavar="OUT", help="output .jsonl path")
    synth.add_argument("--overwrite", action="store_true", help="replace OUT if it is an existing file (never a directory)")
    synth.add_argument("--rows", type=int, default=2000, help="number of rows (default: 2000)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    synth.set_defaults(func=_synth)
