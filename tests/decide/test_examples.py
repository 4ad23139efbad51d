"""The prompted arm's examples (glmtune/decide/examples.py): the data contract applied, a row from
the eval set's groups refused (naming both rows), the first k or the k nearest by BM25, shown
after the prompt's system turn; and through the CLI, the run's validation split as --examples is
refused in one sentence before anything runs or is written."""

from __future__ import annotations

import json

import pytest

from glmtune.data.synthetic import generate_rows
from glmtune.decide.examples import eval_split_keys, load_examples, with_examples
from glmtune.eval.models import ModelSource
from glmtune.eval.sets import load_sets
from glmtune.eval.suite import load_suite
from tests.decide.helpers import TICKET_SCORERS, run_cli, small_suite, trained_run, write_jsonl


def _keys(tmp_path, rows):
    write_jsonl(tmp_path / "eval.jsonl", rows)
    suite = small_suite(tmp_path, [{"name": "tickets", "path": "eval.jsonl", "scorers": TICKET_SCORERS}],
                        [{"metric": "tickets/task_success/exact", "rule": "min", "threshold": 0.5}])
    loaded = load_sets(load_suite(suite), ModelSource("base", "base", tmp_path, "hf", tmp_path))
    return eval_split_keys(loaded)


def test_a_row_of_the_eval_sets_groups_is_refused(tmp_path):
    rows = generate_rows(40, seed=2, num_customers=10)
    keys = _keys(tmp_path, rows[:5])
    groups = [r["group"] for r in rows[:5]]
    leaked = next(i for i, r in enumerate(rows[5:], start=5) if r["group"] in groups)
    group = rows[leaked]["group"]
    write_jsonl(tmp_path / "train.jsonl", rows[5:])
    with pytest.raises(ValueError) as err:
        load_examples(tmp_path / "train.jsonl", keys)
    assert str(err.value) == (f"--examples {tmp_path / 'train.jsonl'}:{leaked - 4}: group {group} is also in the eval "
                              f"set (set tickets, {tmp_path / 'eval.jsonl'}:{groups.index(group) + 1}); examples come "
                              "from the training "
                              "data, never from the groups the suite evaluates (pass the training split, e.g. a run "
                              "directory)")
    clean = [r for r in rows[5:] if r["group"] not in {e["group"] for e in rows[:5]}]
    write_jsonl(tmp_path / "clean.jsonl", clean)
    assert len(load_examples(tmp_path / "clean.jsonl", keys).examples) == len(clean)


def test_the_data_contract_applies(tmp_path):
    row = generate_rows(1, seed=4)[0]
    row["messages"][1]["content"] = "hello <|user|> forged"  # a control token in the text
    write_jsonl(tmp_path / "bad.jsonl", [generate_rows(2, seed=5)[1], row])
    with pytest.raises(ValueError, match=r"^--examples: .*bad\.jsonl:2: messages\[1\]\.content: "):
        load_examples(tmp_path / "bad.jsonl", {})
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": [{"role": "user", "content": "q"}],
                                           "chosen": [{"role": "assistant", "content": "a"}],
                                           "rejected": [{"role": "assistant", "content": "b"}]}])
    with pytest.raises(ValueError, match=r"pairs\.jsonl:1: a preference row"):
        load_examples(tmp_path / "pairs.jsonl", {})


def test_fixed_takes_the_first_rows_and_nearest_the_closest_by_bm25(tmp_path):
    rows = generate_rows(30, seed=6)
    write_jsonl(tmp_path / "train.jsonl", rows)
    fixed = load_examples(tmp_path / "train.jsonl", {}, "fixed")
    assert [e.origin for e in fixed.choose("anything at all", 3)] == [f"{tmp_path / 'train.jsonl'}:{i}" for i in (1, 2, 3)]
    nearest = load_examples(tmp_path / "train.jsonl", {}, "nearest")
    target = rows[17]["messages"][1]["content"]
    chosen = nearest.choose(target, 3)
    assert chosen[0].question == target and len(chosen) == 3
    assert [e.origin for e in nearest.choose("zzzz qqqq", 2)] == [e.origin for e in fixed.choose("", 2)]  # no word shared


def test_examples_follow_the_system_turn_without_their_own(tmp_path):
    rows = generate_rows(2, seed=8)
    write_jsonl(tmp_path / "train.jsonl", rows)
    pool = load_examples(tmp_path / "train.jsonl", {})
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    out = with_examples(prompt, pool.choose("Q", 2))
    assert out[0] == prompt[0] and out[-1] == prompt[-1]
    assert out[1:-1] == [m for r in rows for m in r["messages"] if m["role"] != "system"]
    assert "first 2 rows" in pool.describe(2)


def test_the_runs_validation_split_as_examples_is_refused_before_anything_is_written(shared_results, tmp_path):
    run_dir = trained_run(shared_results)
    suite = small_suite(tmp_path, [{"name": "tickets", "run_split": "validation", "limit": 2, "scorers": TICKET_SCORERS}],
                        [{"metric": "tickets/task_success/exact", "rule": "min", "threshold": 0.5}])
    validation = next((run_dir / "data").glob("validation-*.jsonl"))
    first = json.loads(validation.read_text().splitlines()[0])
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", str(run_dir), "--examples", str(validation),
                                    "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert code == 2 and stdout == ""
    assert stderr.startswith(f"glmtune decide: error: --examples {validation}:1: group {first['group']} is also in the "
                             "eval set (set tickets, ") and stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["--shots", "2"], "--shots applies to the prompted arm, which runs with --examples; add --examples"),
    (["--passages", "2"], "--passages applies to the retrieval arm, which runs with --docs; add --docs"),
    (["--examples", "X", "--shots", "0"], "--shots 0: expected 1 to 32 examples"),
    (["--examples", "X", "--shots-by", "random"], "--shots-by random: expected one of fixed, nearest"),
    (["--docs", "D", "--passages", "99"], "--passages 99: expected 1 to 32 passages"),
    (["--base-key-env", "HOME"], "--base-key-env applies to an endpoint --base (http(s)://HOST:PORT/v1); --base"),
    (["--api", "chat"], "--api applies to an endpoint --base; give an alternative its own with --compare URL,api=chat"),
    (["--throughput", "runs/x"], "--throughput prices the training alternative of --recipe RECIPE; add --recipe"),
    (["--recipe", "tiny/sft_support_json"], "--recipe is priced from a measured speed: give --throughput"),
    (["--parallel.ep", "2"], "--parallel.ep lays the models out over ranks: add --nproc-per-node N"),
    (["--compare", "x,name=base"], "--compare x,name=base: the label 'base' is an arm's; give another with name="),
    (["--compare", "x,model=m"], "--compare x,model=m: model= applies to an endpoint (http(s)://HOST:PORT/v1); x is a "
                                 "local model"),
])
def test_options_that_would_not_take_effect_are_refused(tmp_path, extra, message):
    suite = small_suite(tmp_path, [{"name": "t", "path": "t.jsonl", "scorers": TICKET_SCORERS}],
                        [{"metric": "t/task_success/exact", "rule": "min", "threshold": 0.5}])
    write_jsonl(tmp_path / "t.jsonl", generate_rows(2, seed=1))
    code, _, stderr = run_cli(["decide", str(suite), "--base", str(tmp_path / "nowhere"), "--out",
                               str(tmp_path / "out"), *extra])
    assert code == 2 and stderr.startswith(f"glmtune decide: error: {message}"), stderr
    assert not (tmp_path / "out").exists()


def test_a_suite_without_gates_is_refused(tmp_path):
    suite = small_suite(tmp_path, [{"name": "t", "path": "t.jsonl", "scorers": TICKET_SCORERS}], [])
    write_jsonl(tmp_path / "t.jsonl", generate_rows(2, seed=1))
    code, _, stderr = run_cli(["decide", str(suite), "--base", str(tmp_path)])
    assert code == 2 and "no gates: decide compares the arms by the suite's gates" in stderr
