"""The output directory of `glmtune distill generate`, written so that a kill loses at most the row
in flight and a rerun resumes:

  rows.jsonl      the kept rows (chat rows the data contract accepts, `id` first), one a line,
                  each flushed and fsynced as it is written;
  rejected.jsonl  {"id", "reasons"} of the prompts whose every sample the verifier (or the length
                  cut) rejected: decided, so a rerun does not ask again;
  topk/           the top-K sidecar (`topk_store`), with --top-logprobs;
  manifest.json   what made the rows (teacher, tokenizer, decoding, inputs), the counts and the
                  status; replaced atomically.

A row's sidecar record is written before its row: a kill between the two leaves a record whose row
is missing, which the rerun removes (`TopKWriter.drop_trailing`) before it answers that prompt
again. A last line cut short by a kill is truncated away on reopen. A directory this command did
not write (no manifest.json naming it) is refused, and so is a rerun whose settings differ from the
manifest's (naming the first that differs): the rows of one directory come from one teacher setup.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from glmtune.distill.topk_store import TopKWriter
from glmtune.io.json_file import read_json_file
from glmtune.io.text_limits import parse_json

COMMAND = "distill generate"
MANIFEST, ROWS, REJECTED, TOPK = "manifest.json", "rows.jsonl", "rejected.jsonl", "topk"


def _ids_of_lines(path: Path) -> list[str]:
    """The `id`s of a JSON-lines file we write, after truncating a last line cut short."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete = raw.rfind(b"\n") + 1
    if complete != len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(complete)
            os.fsync(fh.fileno())
    ids = []
    for number, line in enumerate(raw[:complete].splitlines(), 1):
        value = parse_json(line, f"{path}:{number}")
        if not isinstance(value, dict) or not isinstance(value.get("id"), str):
            raise ValueError(f"{path}:{number}: not a row this command wrote (no string id)")
        ids.append(value["id"])
    return ids


def write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def differing_setting(stored: dict[str, Any], settings: dict[str, Any]) -> str | None:
    for key in sorted(set(stored) | set(settings)):
        if stored.get(key) != settings.get(key):
            return key
    return None


class Output:
    """The directory (module docstring): what is done, and the appends."""

    def __init__(self, out: Path, settings: dict[str, Any], k: int | None, vocab_size: int | None,
                 logprob_dtype: str) -> None:
        self.out = out
        manifest_path = out / MANIFEST
        self.resumed = manifest_path.exists()
        if self.resumed:
            stored = read_json_file(manifest_path, "distill manifest")
            if stored.get("command") != COMMAND:
                raise ValueError(f"--out {out}: {manifest_path} was not written by glmtune {COMMAND}; not touched")
            key = differing_setting(stored.get("settings") or {}, settings)
            if key is not None:
                raise ValueError(f"--out {out} holds rows made with another {key} "
                                 f"({json.dumps((stored.get('settings') or {}).get(key))[:80]}, now "
                                 f"{json.dumps(settings.get(key))[:80]}); choose another --out to change it")
            self.manifest = stored
        else:
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise ValueError(f"--out {out} exists and is not a glmtune {COMMAND} output (no {MANIFEST}); "
                                 "not overwritten: choose another directory")
            out.mkdir(parents=True, exist_ok=True)
            self.manifest = {"command": COMMAND, "format": "glmtune-distill", "version": 1, "settings": settings}
        self.done = set(_ids_of_lines(out / ROWS))
        self.rejected = set(_ids_of_lines(out / REJECTED))
        self.topk = TopKWriter(out / TOPK, k, vocab_size, logprob_dtype=logprob_dtype) if k else None
        if self.topk is not None:
            self.topk.drop_trailing(self.done)
            stray = [row for row in self.topk.row_ids if row not in self.done]
            if stray:
                raise ValueError(f"{out / TOPK}: a record for row {stray[0]!r}, which {ROWS} does not hold, before "
                                 "the last record: the directory was edited; not resumed")
        self._rows = open(out / ROWS, "ab")  # noqa: SIM115 - held until close()
        self._rejected = open(out / REJECTED, "ab")  # noqa: SIM115

    def write_manifest(self, **fields: Any) -> None:
        self.manifest.update(fields)
        write_json_atomic(self.out / MANIFEST, self.manifest)

    def add_row(self, row: dict[str, Any], topk) -> None:
        if topk is not None and self.topk is not None:
            self.topk.append(row["id"], topk.ids, topk.logprobs, generated=topk.generated)
        _append_line(self._rows, row)
        self.done.add(row["id"])

    def add_rejected(self, row_id: str, reasons: list[str]) -> None:
        _append_line(self._rejected, {"id": row_id, "reasons": reasons[:8]})
        self.rejected.add(row_id)

    def close(self) -> None:
        for fh in (self._rows, self._rejected):
            fh.close()
        if self.topk is not None:
            self.topk.close()


def _append_line(fh, value: dict[str, Any]) -> None:
    fh.write(json.dumps(value, ensure_ascii=False).encode() + b"\n")
    fh.flush()
    os.fsync(fh.fileno())
