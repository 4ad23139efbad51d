"""What `glmtune eval` reads of a run directory, an adapter and a run's data manifest, hostile:
each variant is one sentence naming the file, exit status 2, no traceback, and no name read
from a file leads out of its directory.

The directories are copies of the shared two-step LoRA run (its adapter/, base/, run.json and
data_manifest.json); every refusal comes before a model is loaded, so each case takes a second.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from glmtune.cli import main
from tests.train.run_helpers import TWO_STEPS, shared_run

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def lora_run(shared_results) -> Path:
    return shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir


@pytest.fixture
def run(lora_run, tmp_path) -> Path:
    """A copy of the LoRA run this test may damage (its checkpoints left out: eval does not read them)."""
    return Path(shutil.copytree(lora_run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints")))


def _suite(tmp_path: Path) -> Path:
    suite = {"name": "hostile", "version": "1",
             "sets": [{"name": "tickets", "run_split": "validation", "limit": 2, "scorers": ["task_success"]}]}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def _eval(tmp_path: Path, base: Path, candidate: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["eval", str(_suite(tmp_path)), "--base", str(base), "--candidate", str(candidate),
                     "--out", str(tmp_path / "out"), "--device", "cpu", "--json"])
    return code, err.getvalue()


def _refused(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


def _edit_json(path: Path, change) -> None:
    """`path` rewritten as `change` (bytes or text), or as what `change` makes of its parsed JSON."""
    content = change(json.loads(path.read_text())) if callable(change) else change
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


ADAPTER_FILES = {  # (file of adapter/, what it becomes, what the sentence says)
    "config truncated": ("adapter_config.json", lambda c: json.dumps(c)[:25], "not valid JSON"),
    "config nested deep": ("adapter_config.json", DEEP, "nested deeper than 64 levels"),
    "config a list": ("adapter_config.json", "[1, 2]", "is a list, not an object"),
    "config not UTF-8": ("adapter_config.json", b"\xff{", "not valid JSON"),
    "config over its size": ("adapter_config.json", " " * (2 << 20) + "{}", "more than 1,048,576 bytes"),
    "config base a number": ("adapter_config.json", lambda c: json.dumps({**c, "base_model_name_or_path": 7}),
                             "base_model_name_or_path is a number, not a path"),
    "record base path a number": ("glmtune_adapter.json",
                                  lambda m: json.dumps({**m, "base": {**m["base"], "path": 7}}),
                                  "not a glmtune base identity"),
    "record base hash a list": ("glmtune_adapter.json",
                                lambda m: json.dumps({**m, "base": {**m["base"], "weights_sha256": [1]}}),
                                "not a glmtune base identity"),
    "record base a string": ("glmtune_adapter.json", lambda m: json.dumps({**m, "base": "x"}),
                             "its base is a string"),
    "record nested deep": ("glmtune_adapter.json", DEEP, "nested deeper than 64 levels"),
}


@pytest.mark.parametrize("case", list(ADAPTER_FILES))
def test_a_hostile_adapter_file_is_one_sentence_naming_it(run, tmp_path, case):
    name, content, said = ADAPTER_FILES[case]
    path = run / "adapter" / name
    _edit_json(path, content)
    _refused(*_eval(tmp_path, run, run / "adapter"), str(path), said)


@pytest.mark.parametrize("base", [7, [1], {"path": "/x", "config_sha256": 5}])
def test_a_run_record_whose_base_is_not_an_identity_is_one_sentence(run, tmp_path, base):
    record = run / "run.json"
    _edit_json(record, lambda r: json.dumps({**r, "base": base}))
    _refused(*_eval(tmp_path, run, run), str(record), "not a glmtune base identity")


def _outside(tmp_path: Path) -> Path:
    """A file of chat rows outside the run: what a manifest must not lead the evaluation to."""
    outside = tmp_path / "outside.jsonl"
    row = {"messages": [{"role": "user", "content": "secret"}, {"role": "assistant", "content": "{}"}]}
    outside.write_text(json.dumps(row) + "\n")
    return outside


def _files(names):
    return lambda manifest, outside: {**manifest, "validation_files": names(outside)}


MANIFESTS = {  # the manifest (parsed; text is written as it is), what the sentence says
    "absolute path out": (_files(lambda out: [str(out)]), "which is not in"),
    "traversal out": (_files(lambda out: ["../../" + out.name]), "which is not in"),
    "'..' itself": (_files(lambda out: [".."]), "leaves"),
    "a string": (_files(lambda out: "validation.jsonl"), "validation_files is a string, not a list of file names"),
    "numbers": (_files(lambda out: [1, 2]), "validation_files is a list, not a list of file names"),
    "a list manifest": (lambda manifest, out: [], "is a list, not an object"),
    "nested deep": (lambda manifest, out: DEEP, "nested deeper than 64 levels"),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_hostile_data_manifest_never_leads_out_of_the_run(run, tmp_path, case):
    make, said = MANIFESTS[case]
    manifest = run / "data_manifest.json"
    value = make(json.loads(manifest.read_text()), _outside(tmp_path))
    manifest.write_text(value if isinstance(value, str) else json.dumps(value))
    _refused(*_eval(tmp_path, run, run), str(manifest), said)
    assert not (tmp_path / "out").exists()


def test_a_split_file_that_links_out_of_the_run_is_refused(run, tmp_path):
    manifest = run / "data_manifest.json"
    [name] = json.loads(manifest.read_text())["validation_files"]
    local = run / "data" / Path(name).name
    local.unlink()
    local.symlink_to(_outside(tmp_path))
    _refused(*_eval(tmp_path, run, run), str(manifest), "is a link that leads out of")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_special_file_among_the_tokenizer_files_is_named_for_what_it_is(run, tmp_path, name):
    """A FIFO in the base's tokenizer (read to compare base and candidate) was hashed as empty: "the
    base and the candidate use different tokenizers"; a blocking read otherwise."""
    base = run / "base"
    (base / name).unlink()
    os.mkfifo(base / name)
    _refused(*_eval(tmp_path, run, run), f"{base / name}: a FIFO (named pipe)")
