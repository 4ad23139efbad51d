"""`glmtune eval`'s exit status tells CI what happened: 0 every gate passed, 1 a gate failed, 2 a
user error, 3 an internal error; each error is one line on stderr.

The model is the untrained tiny checkpoint (tests/conftest.py `saved`) with the tiny tokenizer,
as both base and candidate; its output is written by `FakeGenerate`, so the run reaches the
scorecard with an output no small model writes: a tool call nested 1000 deep.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml

from glmtune.cli import main
from glmtune.data.synthetic import LOOKUP_ORDER_TOOL
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from tests.eval.fake_model import DEEP_CALL, FakeGenerate

ANSWER = '{"product": "PayFlow"}'


@pytest.fixture(scope="module")
def tiny_hf(saved, tmp_path_factory) -> Path:
    directory = Path(shutil.copytree(saved, tmp_path_factory.mktemp("model") / "tiny"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TOKENIZER_DIR / name, directory / name)
    return directory


def _suite(tmp_path: Path, gates: list[dict], name: str = "exit-codes") -> Path:
    rows = [{"id": i, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": ANSWER}],
             "tools": [LOOKUP_ORDER_TOOL]} for i, user in (("deep", "deep please"), ("ok", "fine"))]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    suite = {"name": name, "version": "1", "decoding": {"max_new_tokens": 8, "max_tool_rounds": 1},
             "tools": {"functions": {"lookup_order": "glmtune.data.synthetic:lookup_order"}},
             "sets": [{"name": "rows", "path": "rows.jsonl", "scorers": ["tool_execution", "format"]}],
             "gates": gates}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def _eval(suite: Path, model: Path, out: Path, *extra: str) -> tuple[int, str]:
    """`glmtune [--debug] eval SUITE ...` in this process: (exit status, stderr)."""
    err = io.StringIO()
    debug = ["--debug"] if "--debug" in extra else []
    extra = tuple(e for e in extra if e != "--debug")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([*debug, "eval", str(suite), "--base", str(model), "--candidate", str(model), "--out", str(out),
                     "--device", "cpu", "--json", *extra])
    return code, err.getvalue()


@pytest.fixture
def fake_generate(monkeypatch):
    monkeypatch.setattr("glmtune.eval.backends.generate", FakeGenerate(load_tokenizer(), {"deep please": DEEP_CALL}))


def test_a_deep_tool_call_is_a_failed_example_and_gates_decide_0_or_1(tiny_hf, tmp_path, fake_generate):
    passing = _suite(tmp_path, [{"name": "half valid", "metric": "rows/format/valid_json", "rule": "min",
                                 "threshold": 0.5}])
    code, err = _eval(passing, tiny_hf, tmp_path / "pass")
    assert code == 0, err
    card = json.loads((tmp_path / "pass" / "scorecard.json").read_text())
    deep = next(e for e in card["examples"] if e["id"] == "deep")["outputs"]["candidate"]
    assert deep["finish"] == "bad_tool_call" and not deep["passed"]
    assert "lookup_order: argument 'filters': JSON nested deeper than 64 levels" in deep["failures"]

    failing = _suite(tmp_path, [{"name": "no failed calls", "metric": "rows/tool_execution/failed_calls",
                                 "rule": "max", "threshold": 0}])
    code, err = _eval(failing, tiny_hf, tmp_path / "fail")
    assert code == 1 and "gate failed: no failed calls" in err, err


@pytest.mark.parametrize("name, message", [
    ("../../x", "name: '../../x' contains a path separator"),
    (".", "name: '.' is empty or a relative directory"),
])
def test_a_suite_name_that_is_a_path_exits_2_in_one_line(tmp_path, name, message):
    suite = _suite(tmp_path, [], name=name)
    code, err = _eval(suite, tmp_path / "no-model", tmp_path / "out")  # refused before the model is looked at
    assert code == 2 and err.count("\n") == 1 and f"suite.yaml:1: {message}" in err, err


def test_a_template_the_sandbox_refuses_exits_2_in_one_line(tiny_hf, tmp_path):
    model = Path(shutil.copytree(tiny_hf, tmp_path / "model"))
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}")
    code, err = _eval(_suite(tmp_path, []), model, tmp_path / "out")
    assert code == 2 and err.count("\n") == 1, err
    assert f"rows.jsonl:1: set rows: {model / 'chat_template.jinja'}: the chat template sandbox refused" in err
    assert not (tmp_path / "out").exists()


def test_an_internal_error_exits_3_in_one_line_and_debug_shows_it(tiny_hf, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("scorecard\nbroke")

    monkeypatch.setattr("glmtune.eval.evaluate.build_scorecard", broken)
    suite = _suite(tmp_path, [])
    code, err = _eval(suite, tiny_hf, tmp_path / "out")
    assert code == 3, err
    assert err.splitlines()[-1] == ("glmtune eval: internal error: RuntimeError: scorecard broke "
                                    "(run with --debug for the traceback)")
    assert "Traceback" not in err
    with pytest.raises(RuntimeError, match="scorecard"):
        _eval(suite, tiny_hf, tmp_path / "out", "--debug")
