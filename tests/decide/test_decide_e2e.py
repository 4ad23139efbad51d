"""`glmtune decide` end to end on the tiny model, in this process: every arm on real generation.

The base is the shared four-step run's starting point (its base/, random init), the alternative
the run itself (its hf/); the prompted arm shows 2 of the run's training tickets nearest each
prompt, the retrieval arm 2 passages of the bundled documents. What each arm's model was given is
recorded at `generate` (the real one, wrapped): every prompt is the row's prompt with that arm's
examples or passages, rendered with the one chat template. Neither model answers tickets or
catalog questions, so the gates fail in every arm and the verdict is "fine-tune" (exit 1), naming
the categories, with the recipe's cost from the run's measured speed (the plan's figures). Nothing
is written outside --out; the run directory is untouched.
"""

from __future__ import annotations

import json

import pytest
import torch

from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
from glmtune.data.tokenizer import load_tokenizer
from glmtune.eval.backends import generate as real_generate
from tests.decide.helpers import (BUNDLED, TICKET_SCORERS, decision_of, metric, run_cli, small_suite, trained_run,
                                  write_jsonl)
from tests.train.run_helpers import printed
from tests.tree_snapshot import changes, snapshot


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # xdist workers share the cores (as tests/eval/test_eval_e2e.py)
    yield
    torch.set_num_threads(threads)


class Recording:
    """The real `generate`, recording each prompt it is given (decoded)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.prompts = tokenizer, []

    def __call__(self, model, prompts, max_new_tokens, **options):
        self.prompts += [self.tokenizer.decode(p) for p in prompts]
        return real_generate(model, prompts, max_new_tokens, **options)


def _suite(tmp_path):
    write_jsonl(tmp_path / "catalog.jsonl", generate_doc_questions(seed=0)[:2])
    refusal = [json.loads(line) for line in (BUNDLED / "eval_support_json" / "refusal.jsonl").read_text().splitlines()]
    write_jsonl(tmp_path / "refusal.jsonl", [refusal[0], refusal[6]])  # one must be declined, one answered
    sets = [{"name": "tickets", "run_split": "validation", "limit": 2, "scorers": TICKET_SCORERS + ["tool_execution"]},
            {"name": "catalog", "path": "catalog.jsonl", "scorers": ["facts"]},
            {"name": "refusal", "path": "refusal.jsonl", "scorers": ["refusal"]}]
    gates = [{"name": "exact", "metric": "tickets/task_success/exact", "rule": "min", "threshold": 0.2},
             {"name": "facts", "metric": "catalog/facts/supported", "rule": "min", "threshold": 0.5},
             {"name": "refusals", "metric": "refusal/refusal/accuracy", "rule": "no_regression"}]
    return small_suite(tmp_path, sets, gates)


def test_every_arm_on_the_tiny_model(shared_results, tmp_path, monkeypatch):
    run_dir = trained_run(shared_results)
    suite = _suite(tmp_path)
    write_documents(tmp_path / "docs", seed=0)
    recording = Recording(load_tokenizer(run_dir / "hf"))
    monkeypatch.setattr("glmtune.eval.backends.generate", recording)
    before, run_before = snapshot(tmp_path), snapshot(run_dir)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", str(run_dir), "--examples", str(run_dir),
                                    "--shots", "2", "--shots-by", "nearest", "--docs", str(tmp_path / "docs"),
                                    "--passages", "2", "--compare", f"{run_dir},name=trained,cost-per-1k=0.5",
                                    "--recipe", "tiny/sft_support_json", "--throughput", str(run_dir), "--gpu",
                                    "h200-141g", "--price-per-gpu-hour", "2.5", "--out", str(out), "--device", "cpu"])
    assert code == 1, stdout + stderr
    assert changes(before, snapshot(tmp_path, ignore=("out",))) == [] and changes(run_before, snapshot(run_dir)) == []
    decision = decision_of(out)
    assert [a["label"] for a in decision["arms"]] == ["base", "prompted", "retrieval", "trained"]
    assert [a["kind"] for a in decision["arms"]] == ["base", "prompted", "retrieval", "alternative"]
    verdict = decision["verdict"]
    assert verdict["kind"] == "fine-tune" and verdict["exit_code"] == 1
    assert verdict["text"].startswith("fine-tune: these gates fail in every arm (base, prompted, retrieval, trained): ")
    assert {g["gate"]: g["category"] for g in verdict["failing_everywhere"]} == {"exact": "task", "facts": "facts"}
    assert "verdict: fine-tune" in stdout and "report: " in stdout
    [line] = verdict["cost"]  # the plan's figures for the recipe, from the run's measured speed
    assert line.startswith("fine-tuning by tiny/sft_support_json on 1 x h200-141g: ") and printed(stdout, line)
    assert line.endswith(f"; speed: measured: {run_dir / 'metrics.jsonl'}, 0 TFLOP/s per GPU")
    assert decision["cost"]["gpus"][0]["cost"] == pytest.approx(decision["cost"]["gpus"][0]["gpu_hours"] * 2.5, 1e-5)
    models = {m["label"]: m for m in decision["scorecard"]["models"]}
    assert models["prompted"]["fingerprint"] == models["base"]["fingerprint"] != models["trained"]["fingerprint"]
    assert decision["arms"][1]["examples"] == {"source": str(next((run_dir / "data").glob("train-*.jsonl"))),
                                               "rows": decision["arms"][1]["examples"]["rows"], "shots": 2,
                                               "chosen": "nearest"}
    assert decision["arms"][2]["documents"]["files"] == 15 and decision["arms"][2]["passages_per_prompt"] == 2
    assert set(metric(decision, "tickets/task_success/exact")) == {"base", "prompted", "retrieval", "trained"}
    _check_prompts_seen(decision, recording.prompts)
    markdown = (out / "decision.md").read_text()
    assert markdown.startswith("# Decision: fine-tune: these gates fail in every arm")
    assert "## Failures of base" in markdown and "## Failures of trained" in markdown


def _check_prompts_seen(decision: dict, seen: list[str]) -> None:
    """Every arm's model was given each row's prompt with what the arm added (and nothing else)."""
    for example in decision["scorecard"]["examples"]:
        question = example["prompt"]
        asked = [p for p in seen if p.split("<|user|>")[-1].startswith(question)]
        assert len(asked) >= 4, (question, len(asked))  # base, prompted, retrieval, trained: the first round each
        shown = example["added"]["retrieval"]
        with_passages = [p for p in asked if "Passages from the documents follow" in p]
        assert with_passages and all(f"[{s['number']}] ({s['where']}) {s['text']}" in p
                                     for p in with_passages for s in shown)
        assert len(example["added"]["prompted"]) == 2
        with_examples = [p for p in asked if p.count("<|user|>") == 3 and "Passages" not in p]
        assert with_examples, question  # two example turns before the row's own user turn
