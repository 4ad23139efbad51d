"""`glmtune data validate|prepare|synth`: check, version and generate chat and preference datasets.

  glmtune data validate PATH... [--schema S] [--tokenizer DIR]   every contract violation as file:line: field: reason
  glmtune data prepare PATH... --out DIR         dedup, PII lint, group split, versioned JSONL + manifest
  glmtune data synth OUT [--kind K --rows N --seed S]   the bundled support-ticket task as JSONL (its
                                                       documents as a folder: --kind support_docs; a raw-text
                                                       domain corpus as a folder: --kind domain_text)
(prepare and synth refuse an existing non-empty output unless --overwrite; synth replaces a directory only by
support_docs' or domain_text's own)
Each file's kind is detected from its rows: chat rows (`messages`) or preference rows
(`prompt`/`chosen`/`rejected`); validate and prepare print it, prepare's manifest records it.
The control tokens no string may hold are GLM-5's, or with `--tokenizer DIR` those of the template
and tokenizer in DIR (the model that will train on the data: ChatML's, Llama-3's, ...), as
`glmtune train` checks them.
"""

from __future__ import annotations

import argparse
from typing import Any

TOKENIZER_HELP = ("the model or tokenizer directory that will train on the data: its template's and tokenizer's "
                  "control tokens are refused in any string (default: GLM-5's)")
SYNTH_KINDS = ("support_tickets", "support_preferences", "support_docs", "support_doc_questions", "domain_text")


def _validate(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.contract import load_schema
    from glmtune.data.preferences import validate_any_rows
    from glmtune.data.sources import no_rows_message, read_rows

    schema = load_schema(args.schema) if args.schema else None
    forbidden = _control_tokens(args.tokenizer)
    num_rows = num_violations = num_bad_rows = 0
    kinds: dict[str, int] = {}
    for row, kind, violations in validate_any_rows(read_rows(args.paths), schema, forbidden):
        num_rows += 1
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
        num_bad_rows += bool(violations)
        num_violations += len(violations)
        for violation in violations:
            print(violation)
    if not num_rows:  # an empty dataset would otherwise pass as "OK: 0 row(s)"
        raise ValueError(f"{no_rows_message(args.paths)}: nothing to validate")
    if num_violations:
        print(f"{num_violations} violation(s) in {num_bad_rows} of {num_rows} row(s)")
        return 1
    print(f"OK: {num_rows} row(s), 0 violations ({', '.join(f'{n} {kind}' for kind, n in kinds.items())})")
    return 0


def _control_tokens(tokenizer_dir: str | None) -> tuple[str, ...]:
    """The contract's control tokens: GLM-5's, or the template's and tokenizer's in `tokenizer_dir`."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.chat_template import control_tokens, load_chat_template
    from glmtune.data.tokenizer import GLM5_CONTROL_TOKENS, load_tokenizer, resolve_tokenizer_dir

    if tokenizer_dir is None:
        return GLM5_CONTROL_TOKENS
    directory = resolve_tokenizer_dir(tokenizer_dir)
    return control_tokens(load_chat_template(directory), load_tokenizer(directory))


def _prepare(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.prepare import prepare_dataset
    from glmtune.data.split import parse_ratios

    result = prepare_dataset(args.paths, args.out, ratios=parse_ratios(args.ratios), pii_action=args.pii,
                             schema_path=args.schema, split_seed=args.split_seed, overwrite=args.overwrite,
                             control_tokens=_control_tokens(args.tokenizer))
    counts, pii, kind = result.manifest["counts"], result.manifest["pii"], result.manifest["kind"]
    print(f"read {counts['input_rows']} {kind} row(s); dropped {counts['exact_duplicates']} exact and "
          f"{counts['normalized_duplicates']} normalized duplicate(s), {counts['pii_dropped']} for PII "
          f"({pii['num_findings']} finding(s) in {pii['num_rows_with_findings']} row(s), see {pii['report']})")
    for name, entry in result.manifest["outputs"].items():
        print(f"  {name:10s} {entry['rows']:8d} rows  {result.out_dir / entry['file']}")
    print(f"data version {result.version}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.synthetic import SCHEMA_PATH, check_jsonl_target, generate_rows, write_jsonl
    from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
    from glmtune.data.synthetic_preferences import generate_preference_rows
    from glmtune.data.synthetic_text import CORPUS_FILE, HELDOUT_FILE, write_domain_text

    if args.kind in ("support_docs", "support_doc_questions") and args.rows is not None:
        raise ValueError(f"--rows: --kind {args.kind} is a fixed set per seed (6 products; 5 questions each)")
    if args.kind == "domain_text":  # a directory: the corpus and its held-out sources
        path, num_corpus, num_heldout = write_domain_text(args.out, seed=args.seed, overwrite=args.overwrite,
                                                          **({} if args.rows is None else {"num_sources": args.rows}))
        print(f"wrote {num_corpus} documents to {path / CORPUS_FILE} and {num_heldout} documents of held-out "
              f"sources to {path / HELDOUT_FILE} (train with data.kind: text, data.source_field: source)")
        return 0
    if args.kind == "support_docs":
        path = write_documents(args.out, seed=args.seed, overwrite=args.overwrite)
        print(f"wrote the support documents (triage policy and product catalog) to {path}/")
        return 0
    check_jsonl_target(args.out, overwrite=args.overwrite)  # before generating the rows
    generate = {"support_preferences": generate_preference_rows, "support_tickets": generate_rows,
                "support_doc_questions": lambda rows, seed: generate_doc_questions(seed)}[args.kind]
    rows = generate(2000 if args.rows is None else args.rows, seed=args.seed)
    path = write_jsonl(rows, args.out, overwrite=args.overwrite)
    what = {"support_preferences": "preference row(s)", "support_doc_questions": "question row(s)"}.get(args.kind,
                                                                                                        "row(s)")
    note = (f"answered only by the support_docs of seed {args.seed}" if args.kind == "support_doc_questions"
            else f"answer schema: {SCHEMA_PATH}")
    print(f"wrote {len(rows)} {what} to {path} ({note})")
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
    validate.add_argument("--tokenizer", metavar="DIR", default=None, help=TOKENIZER_HELP)
    validate.set_defaults(func=_validate)

    prepare = actions.add_parser(
        "prepare", help="dedup, lint, split and write a versioned dataset",
        description="Validate, lint for secrets/PII, dedup (exact and normalized text), split by group, and write "
                    "{split}-{sha256[:12]}.jsonl files plus manifest.json and pii_report.json into --out.")
    prepare.add_argument("paths", nargs="+", metavar="PATH", help="input files or directories")
    prepare.add_argument("--out", required=True, metavar="DIR", help="output directory")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace DIR if it is an earlier data prepare output (never anything else, "
                              "never an input, never inside a run directory)")
    prepare.add_argument("--ratios", default="0.9,0.05,0.05", metavar="T,V,E",
                         help="train,validation,test fractions summing to 1 (default: 0.9,0.05,0.05)")
    prepare.add_argument("--pii", choices=("report", "drop", "fail"), default="report",
                         help="what to do with rows that contain secrets/PII (default: report)")
    prepare.add_argument("--schema", metavar="S", help="JSON Schema for final answers (contract check)")
    prepare.add_argument("--split-seed", type=int, default=0, help="salt of the group hash (default: 0)")
    prepare.add_argument("--tokenizer", metavar="DIR", default=None, help=TOKENIZER_HELP)
    prepare.set_defaults(func=_prepare)

    synth = actions.add_parser(
        "synth", help="write the bundled synthetic support-ticket dataset",
        description="Generate the deterministic support-ticket triage task (JSON answers, ~20%% tool calls), "
                    "as chat rows or as preference pairs (chosen = the reference answer, rejected = a wrong "
                    "severity, a wrong next action or invalid JSON).")
    synth.add_argument("out", metavar="OUT", help="output .jsonl path (a directory for support_docs and domain_text)")
    synth.add_argument("--kind", choices=SYNTH_KINDS, default=SYNTH_KINDS[0],
                       help="support_tickets: chat rows; support_preferences: prompt/chosen/rejected rows; "
                            "support_docs: the task's documents (triage policy, product catalog: Markdown files); "
                            "support_doc_questions: questions only those documents answer (a facts set); "
                            "domain_text: a raw-text domain corpus (contracts and manuals) for continued "
                            "pretraining, OUT/corpus.jsonl and OUT/heldout.jsonl of held-out sources "
                            "(default: support_tickets)")
    synth.add_argument("--overwrite", action="store_true", help="replace OUT if it is an earlier data synth output "
                       "(never anything else; a directory only by support_docs' or domain_text's own)")
    synth.add_argument("--rows", type=int, default=None, help="number of rows (default: 2000; not for the "
                       "documents and their questions; domain_text: number of sources, default 160)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    synth.set_defaults(func=_synth)
