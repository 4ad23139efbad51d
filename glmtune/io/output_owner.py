"""Whose output an existing target is: what lets `--overwrite` replace only what that command wrote.

Every directory a command writes through `glmtune.io.outputs.output_dir` holds a record of it,
`.glmtune-output.json` (hidden: a release, the serving engines and transformers never read it):

    {"format": "glmtune.output/1", "command": "eval", "output": "--out", "created": "2027-01-05T10:00:00+00:00",
     "entries": ["scorecard.html", "scorecard.json", "scorecard.md", "sets", "sets/tickets.jsonl", "suite.yaml"]}

An existing target is the output of COMMAND's OUTPUT option when its record names both and it
holds nothing but the entries recorded (a file someone added since, a notebook or notes, is not
the command's to replace). A target without a record is recognized by its content (`CONTENT`): a
single file has no room for one (release.json, a synthetic JSONL), and a directory written before
records existed has none. What each output is, recognized by content:

  * eval --out: scorecard.json (a scorecard, `format` glmtune.scorecard/...), scorecard.md,
    scorecard.html, suite.yaml and sets/*.jsonl, nothing else;
  * release --out: the file is a release manifest (`format` glmtune.release/1);
  * export --adapter: adapter_config.json and adapter_model.safetensors (glmtune_adapter.json
    beside them), nothing else;
  * export --hf, merge OUT_DIR: config.json and model*.safetensors, besides them only the index
    and the tokenizer and template files glmtune copies (`HF_SIDE_FILES`), nothing else (a model
    downloaded from a hub carries a README, a licence: not recognized);
  * an export's model card, README.md holding `CARD_MARKER`, is part of its export (any other
    README.md is not);
  * data prepare --out: pii_report.json, with manifest.json and the split files (NAME-HASH.jsonl)
    it writes, nothing else;
  * data synth OUT: every line a synthetic row (an `id` synth-SEED-NNNNNN or pref-SEED-NNNNNN, a
    `group`), at least one;
  * preflight --out: preflight.json, the report (the scratch runs beside it are the preflight's).

Anything else is not that command's output: a user's file or directory, another command's output
(its record names that command), a directory whose record is damaged, a symbolic link, a FIFO or a
device. `owner_problem` says which, in a phrase for the refusal. Every file read here is read
bounded and only if it is a regular file (`glmtune.io.json_file`); an unreadable one is simply not
recognized.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from glmtune.io.json_file import json_lines, read_json_file
from glmtune.io.regular import kind_of

RECORD = ".glmtune-output.json"
FORMAT = "glmtune.output/1"
# The line right after a model card's front matter that says glmtune wrote it (glmtune/release/model_card.py):
# what lets `glmtune release --overwrite` replace its own card and never a README.md someone else wrote.
CARD_MARKER = "<!-- glmtune model card: generated from the run's records; edits are replaced by the next one -->"
# What glmtune's HF writer puts beside config.json and the shards: checkpoint/hf_io.py's
# TOKENIZER_FILES (io/ imports nothing above it; tests/io/test_output_owner.py checks they agree).
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_HF_NAMES = frozenset({"config.json", "model.safetensors.index.json", *HF_SIDE_FILES})
_HF_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_ADAPTER_NAMES = frozenset({"adapter_config.json", "adapter_model.safetensors", "glmtune_adapter.json"})
_PREPARED_NAMES = frozenset({"manifest.json", "pii_report.json"})
_EVAL_NAMES = frozenset({"scorecard.json", "scorecard.md", "scorecard.html", "suite.yaml", "sets"})
_SPLIT_FILE = re.compile(r"^[a-z]+-[0-9a-f]{12}\.jsonl$")
_SYNTHETIC_ID = re.compile(r"^(synth|pref)-\d+-\d{6}$")


def write_record(directory: Path, command: str, output: str) -> None:
    """Record in `directory` (an output being built) that `command`'s `output` option wrote it and what."""
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {"format": FORMAT, "command": command, "output": output, "created": created,
              "entries": _tree(directory)}
    (directory / RECORD).write_text(json.dumps(record) + "\n", encoding="utf-8")


def record_added_file(directory: Path, name: str) -> None:
    """Add `name`, a file the command itself wrote into its finished output `directory` (an export's
    model card), to the directory's record, rewritten atomically; a directory without a record is
    left as it is."""
    record, damaged = _read_record(directory)
    if record is None or damaged:
        return
    record["entries"] = sorted(set(record["entries"]) | {name})
    tmp = directory / f"{RECORD}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    os.replace(tmp, directory / RECORD)


def _tree(directory: Path) -> list[str]:
    """The relative paths of everything under `directory` but its record, hidden entries included (a
    user's .git or .notes.md is as much theirs as any other file), links not followed."""
    found = []
    for root, dirnames, filenames in os.walk(directory):
        rel = os.path.relpath(root, directory)
        found += [os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/") for name in (*dirnames, *filenames)]
    return sorted(path for path in found if path != RECORD)


def owner_problem(target: Path, kind: str, command: str, output: str) -> str | None:
    """None when the existing `target` is `command`'s `output` (module docstring), else what it
    is instead, a phrase such as "is a directory glmtune eval did not write (...)"."""
    if os.path.islink(target):
        return "is a symbolic link (glmtune writes none there)"
    found = kind_of(target)
    if kind == "dir" and found == "a directory":
        record, damaged = _read_record(target)
        if damaged:
            return f"holds a damaged {RECORD} ({damaged})"
        if record is not None:
            if (record["command"], record["output"]) != (command, output):
                return f"holds the output of glmtune {record['command']} ({record['output']}, says its {RECORD})"
            added = sorted(set(_tree(target)) - set(record["entries"]))
            if not added:
                return None
            more = f" (and {len(added) - 1} more)" if len(added) > 1 else ""
            return f"holds {added[0]}{more}, which glmtune {command} did not write there (its {RECORD} lists no such)"
    elif found is not None or kind == "dir":
        return f"is {found or 'a file'}, not what glmtune {command} writes there"
    description, recognized = CONTENT.get((command, output), ("", None))
    if recognized is not None and recognized(target):
        return None
    if kind == "file":
        return f"is a file glmtune {command} did not write" + (f": it is not {description}" if description else "")
    return (f"is a directory glmtune {command} did not write: it has no {RECORD}"
            + (f" and is not {description}" if description else ""))


def _read_record(directory: Path) -> tuple[dict | None, str]:
    """(the record, "") or (None, "") without one, or (None, why) for one that is not a record."""
    path = directory / RECORD
    if not os.path.lexists(path):
        return None, ""
    try:
        record = read_json_file(path, RECORD, max_bytes=1 << 16)
    except ValueError as exc:
        return None, str(exc).removeprefix(f"{RECORD} {path}: ")
    fields = record.get("format"), record.get("command"), record.get("output")
    entries = record.get("entries")
    if (fields[0] != FORMAT or not all(isinstance(field, str) and field for field in fields[1:])
            or not isinstance(entries, list) or not all(isinstance(entry, str) for entry in entries)):
        return None, f"not a {FORMAT} record"
    return record, ""


def _entries(directory: Path) -> dict[str, bool]:
    """{name: is a regular file (not a link)} of the directory's entries, hidden ones included; {} if
    unreadable."""
    try:
        with os.scandir(directory) as entries:
            return {e.name: stat.S_ISREG(e.stat(follow_symlinks=False).st_mode) for e in entries}
    except OSError:
        return {}


def _json_object(path: Path) -> dict | None:
    try:
        return read_json_file(path)
    except (ValueError, OSError):
        return None


def _files_only(directory: Path, allowed: Callable[[str], bool], required: tuple[str, ...]) -> bool:
    """Whether the directory holds regular files only, each `allowed`, the `required` among them (an
    export's own model card, README.md with `CARD_MARKER`, besides them)."""
    entries = {name: is_file for name, is_file in _entries(directory).items()
               if not (name == "README.md" and is_file and _card_file(directory / name))}
    return (bool(entries) and all(entries.values()) and all(map(allowed, entries))
            and all(name in entries for name in required))


def _eval_dir(directory: Path) -> bool:
    entries = _entries(directory)
    regular = {name for name, is_file in entries.items() if is_file}
    if not set(entries) <= _EVAL_NAMES or set(entries) - {"sets"} != regular or "scorecard.json" not in regular:
        return False
    sets = directory / "sets"
    if "sets" in entries and (sets.is_symlink() or not sets.is_dir()
                              or not all(is_file and name.endswith(".jsonl") for name, is_file in _entries(sets).items())):
        return False
    card = _json_object(directory / "scorecard.json")
    return card is not None and str(card.get("format", "")).startswith("glmtune.scorecard/")


def _card_file(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return CARD_MARKER.encode() in fh.read(1 << 16)
    except OSError:
        return False


def _release_file(path: Path) -> bool:
    manifest = _json_object(path)
    return manifest is not None and manifest.get("format") == "glmtune.release/1"


def _adapter_dir(directory: Path) -> bool:
    return (_files_only(directory, _ADAPTER_NAMES.__contains__, ("adapter_config.json", "adapter_model.safetensors"))
            and _json_object(directory / "adapter_config.json") is not None)


def _hf_dir(directory: Path) -> bool:
    def allowed(name: str) -> bool:
        return name in _HF_NAMES or bool(_HF_SHARD.match(name))

    return (_files_only(directory, allowed, ("config.json",))
            and any(_HF_SHARD.match(name) for name in _entries(directory))
            and _json_object(directory / "config.json") is not None)


def _prepared_dir(directory: Path) -> bool:
    def allowed(name: str) -> bool:
        return name in _PREPARED_NAMES or bool(_SPLIT_FILE.match(name))

    if not _files_only(directory, allowed, ("pii_report.json",)):
        return False
    report = _json_object(directory / "pii_report.json")
    manifest = _json_object(directory / "manifest.json") if (directory / "manifest.json").exists() else {}
    return (report is not None and "num_findings" in report
            and manifest is not None and (not manifest or {"version", "outputs"} <= manifest.keys()))


def _synthetic_file(path: Path) -> bool:
    rows = 0
    try:
        for _, row, _ in json_lines(path):
            if not (isinstance(row.get("id"), str) and _SYNTHETIC_ID.match(row["id"]) and "group" in row):
                return False
            rows += 1
    except (ValueError, OSError):
        return False
    return rows > 0


def _preflight_dir(directory: Path) -> bool:
    # as glmtune preflight itself tells its output; a hidden entry beside the report (.git) is a user's
    return (directory / "preflight.json").is_file() and not any(name.startswith(".") for name in _entries(directory))


# (command, output option) -> (what its output is, for messages; whether a target without a record is one)
CONTENT: dict[tuple[str, str], tuple[str, Callable[[Path], bool]]] = {
    ("eval", "--out"): ("an eval directory (scorecard.json)", _eval_dir),
    ("release", "--out"): ("a release manifest", _release_file),
    ("release", "model card"): ("a model card glmtune wrote", _card_file),
    ("export", "--adapter"): ("an adapter glmtune exported", _adapter_dir),
    ("export", "--hf"): ("an HF checkpoint glmtune wrote", _hf_dir),
    ("merge", "OUT_DIR"): ("an HF checkpoint glmtune wrote", _hf_dir),
    ("data prepare", "--out"): ("a prepared dataset", _prepared_dir),
    ("data synth", "OUT"): ("synthetic rows", _synthetic_file),
    ("preflight", "--out"): ("a preflight's output (it holds no preflight.json)", _preflight_dir),
}
