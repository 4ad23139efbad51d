"""format: the answer parses as JSON and validates against a JSON Schema.

Options: `schema`, a JSON Schema file (relative to the suite file; null checks parsing only),
and `critical`, which failures count as critical: "schema" (default: an answer that does not
parse or does not validate, either of which breaks the program that consumes it) or "parse"
(only answers that do not parse). Metrics: `valid_json` and `schema_valid` (ratios) and
`critical_failures` (a count: the release gate "zero critical format failures"). A schema file
over MAX_SCHEMA_BYTES is refused when the suite loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jsonschema

from glmtune.data.contract import load_schema
from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore, parse_json

MAX_SCHEMA_BYTES = 4 << 20


class Format:
    name = "format"
    row_kind = "chat"  # the rows it scores: chat rows, answered by generation

    @dataclass
    class Options:
        schema: str | None = None  # JSON Schema file, relative to the suite file; null: parse only
        critical: Literal["schema", "parse"] = "schema"  # which failures count as critical

    def __init__(self, options: "Format.Options", suite_dir: Path) -> None:
        self.options = options
        self.validator = None
        if options.schema is not None:
            path = suite_dir / options.schema
            if path.is_file() and path.stat().st_size > MAX_SCHEMA_BYTES:
                raise ValueError(f"schema file {path} is {path.stat().st_size:,} bytes, more than "
                                 f"{MAX_SCHEMA_BYTES:,} (MAX_SCHEMA_BYTES)")
            schema = load_schema(path)  # FileNotFoundError / ValueError name the file
            self.validator = jsonschema.validators.validator_for(schema)(schema)

    @staticmethod
    def metrics(options: "Format.Options") -> list[MetricDef]:
        defs = [MetricDef("valid_json", "answer parses as JSON", "ratio", True)]
        if options.schema is not None:
            defs.append(MetricDef("schema_valid", "answer parses and satisfies the JSON Schema", "ratio", True))
        what = "does not parse" + (" or violates the schema" if options.critical == "schema" else "")
        defs.append(MetricDef("critical_failures", f"answers that {what}", "count", False, "sum"))
        return defs

    def check_row(self, row: EvalRow) -> list[str]:
        return []

    def score(self, row: EvalRow, output: ModelOutput) -> RowScore:
        answer, error = parse_json(output.text)
        values: dict[str, float | None] = {"valid_json": float(error is None)}
        failures = [error] if error else []
        schema_ok = error is None
        if self.validator is not None:
            if error is None:
                problems = sorted(self.validator.iter_errors(answer), key=lambda e: list(e.absolute_path))
                failures += [f"schema: {p.message}" + (f" at {p.json_path}" if p.absolute_path else "")
                             for p in problems[:3]]
                schema_ok = not problems
            values["schema_valid"] = float(schema_ok)
        critical = error is not None or (self.options.critical == "schema" and not schema_ok)
        values["critical_failures"] = float(critical)
        return RowScore(values, failures)
