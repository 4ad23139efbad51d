"""Set rows: the data contract with file:line, limits, the prompt/reference cut, categories, the
suite's system prompt and thinking switch, and the scorers' row checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.data.chat_template import bundled_template
from glmtune.data.synthetic import generate_rows
from glmtune.data.tokenizer import load_tokenizer
from glmtune.eval.models import ModelSource
from glmtune.eval.answering import Prompting
from glmtune.eval.sets import check_rows, load_sets
from glmtune.eval.suite import DecodingConfig, load_suite

HF = ModelSource("candidate", "candidate", Path("/models/x"), "hf", Path("/models/x"))


def _suite(tmp_path: Path, rows: list, extra: str = "", scorers: str = "[task_success, tool_execution]") -> Path:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "suite.yaml"
    path.write_text(f"name: s\nversion: '2'\n{extra}sets:\n  - name: t\n    path: rows.jsonl\n    limit: 3\n"
                    f"    scorers: {scorers}\n")
    return path


def test_rows_are_cut_at_the_last_user_turn(tmp_path):
    rows = generate_rows(60, seed=1)
    tool_row = next(r for r in rows if r["category"] == "tool_call")
    untagged = {k: v for k, v in rows[0].items() if k != "category"}
    [loaded] = load_sets(load_suite(_suite(tmp_path, [tool_row, untagged, rows[1], rows[2]])), HF)
    assert [r.id for r in loaded.rows] == [tool_row["id"], rows[0]["id"], rows[1]["id"]]  # limit: 3
    first, second = loaded.rows[:2]
    assert first.prompt == tool_row["messages"][:2] and first.category == "tool_call"
    assert first.reference == tool_row["messages"][-1]["content"]
    assert first.reference_calls == [{"name": "lookup_order", "arguments": tool_row["messages"][2]["tool_calls"][0]
                                      ["function"]["arguments"]}]
    assert first.reference_turns == tool_row["messages"][2:] and first.origin.endswith("rows.jsonl:1")
    assert second.category == "other" and second.reference_calls == []
    assert loaded.jsonl.decode().splitlines()[0] == json.dumps(tool_row, ensure_ascii=False)
    assert loaded.source == str(tmp_path / "rows.jsonl")


def test_system_prompt_and_thinking_apply_to_every_row(tmp_path):
    rows = generate_rows(3, seed=1)
    suite = load_suite(_suite(tmp_path, rows, "system_prompt: Answer briefly.\nenable_thinking: true\n"))
    [loaded] = load_sets(suite, HF)
    for row in loaded.rows:
        assert row.prompt[0] == {"role": "system", "content": "Answer briefly."}
        assert [m["role"] for m in row.prompt] == ["system", "user"]
    tokenizer = load_tokenizer()
    thinking = Prompting(tokenizer, bundled_template(), True, DecodingConfig())
    plain = Prompting(tokenizer, bundled_template(), False, DecodingConfig())
    text = tokenizer.decode(thinking.render(loaded.rows[0].prompt, None))
    assert text.endswith("<|assistant|><think>") and "Answer briefly." in text
    assert tokenizer.decode(plain.render(loaded.rows[0].prompt, None)).endswith("<|assistant|></think>")


def test_contract_violations_and_unscorable_rows_name_the_line(tmp_path):
    good = generate_rows(1, seed=1)[0]
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    with pytest.raises(ValueError, match=r"suite.yaml:4: set t: 1 data contract violation.*rows.jsonl:2"):
        load_sets(load_suite(_suite(tmp_path, [good, bad])), HF)
    not_json = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    loaded = load_sets(load_suite(_suite(tmp_path, [good, not_json])), HF)
    with pytest.raises(ValueError, match=r"rows.jsonl:2: set t: task_success: task_success needs a JSON object"):
        check_rows(loaded)
    refusal = load_sets(load_suite(_suite(tmp_path, [good], scorers="[refusal]")), HF)
    with pytest.raises(ValueError, match=r"rows.jsonl:1: set t: refusal: a refusal row needs must_refuse"):
        check_rows(refusal)
    split = _suite(tmp_path, [good]).read_text().replace("path: rows.jsonl", "run_split: validation")
    (tmp_path / "split.yaml").write_text(split)
    with pytest.raises(ValueError, match="is not a run directory; give the set a path"):
        load_sets(load_suite(tmp_path / "split.yaml"), HF)


def test_a_set_reads_only_its_limit_and_at_most_max_set_rows(tmp_path, monkeypatch):
    rows = generate_rows(6, seed=1)
    path = _suite(tmp_path, rows)  # limit: 3
    with (tmp_path / "rows.jsonl").open("a") as f:
        f.write("not json: never read, so never checked\n")
    assert [r.id for r in load_sets(load_suite(path), HF)[0].rows] == [r["id"] for r in rows[:3]]
    monkeypatch.setattr("glmtune.eval.sets.MAX_SET_ROWS", 5)
    unlimited = tmp_path / "unlimited.yaml"
    unlimited.write_text(path.read_text().replace("    limit: 3\n", ""))
    with pytest.raises(ValueError, match=r"unlimited.yaml:4: set t: more than 5 rows, the most a set evaluates "
                                         r"\(MAX_SET_ROWS\); give the set a limit"):
        load_sets(load_suite(unlimited), HF)


def test_a_set_file_over_its_size_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = _suite(tmp_path, generate_rows(3, seed=1))
    monkeypatch.setattr("glmtune.eval.sets.MAX_SET_FILE_BYTES", 100)
    with pytest.raises(ValueError, match=r"set t: .*rows.jsonl is [\d,]+ bytes, more than the 100 a set file may"):
        load_sets(load_suite(path), HF)
