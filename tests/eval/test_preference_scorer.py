"""The `preference` scorer: pairs scored teacher-forced, against transformers and against the base.

Two tiny GLM-5 HF exports (fp32): the base (seed 0) and a candidate that is the base with its LM
head moved by a known random change. `glmtune eval` runs a suite whose only set holds short
preference pairs (every sequence below the indexer's top-k, so the sparse selection keeps every
key on both sides). Asserted:
  * each model's per-pair log-probabilities equal transformers' `GlmMoeDsaForCausalLM` on the same
    export (a forward per answer, log-softmax summed over the answer's labelled tokens), rel 1e-5;
  * the candidate's implicit margin is beta x (its margin - the base's margin), implicit accuracy
    the share where that is > 0, and the metrics per category are the means of their rows;
  * gates read the new metrics, and a rule that needs the base's value is refused on the
    candidate-only ones;
  * refusals: a preference scorer on chat rows, a chat scorer on pairs, both in one set, a pair
    that breaks the preference contract (file:line: field: reason);
  * an endpoint: with the engine's prompt log-probabilities, its values equal the in-process
    ones; without them, every preference metric is null and named "not available from this
    engine", and a gate on it fails saying so.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from glmtune import save_pretrained
from glmtune.data.chat_template import IGNORE_INDEX, load_chat_template
from glmtune.data.preferences import tokenize_pair
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.eval.evaluate import run_eval
from glmtune.eval.suite import load_suite
from glmtune.models.glm5 import build_model, get_preset
from tests.eval.endpoint_stub import engine

BETA = 0.25
CATEGORIES = ["billing", "billing", "login", "login", "outage"]


def _pairs() -> list[dict]:
    rows = []
    for i, category in enumerate(CATEGORIES):
        good = {"product": "PayFlow", "severity": "high", "next_action": "review_billing"}
        bad = dict(good, severity="low") if i % 2 else None
        rows.append({"id": f"p{i}", "category": category,
                     "prompt": [{"role": "user", "content": f"Ticket {i}: I was charged twice for order {i}."}],
                     "chosen": [{"role": "assistant", "content": json.dumps(good)}],
                     "rejected": [{"role": "assistant", "content": json.dumps(bad) if bad else
                                   json.dumps(good)[:-1]}]})
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _suite(directory: Path, scorers: str = "[{type: preference, beta: 0.25}]", gates: str = "",
           rows_file: str = "pairs.jsonl") -> Path:
    path = directory / "suite.yaml"
    path.write_text("name: pref\nversion: 1\nsets:\n"
                    f"  - {{name: pairs, path: {rows_file}, scorers: {scorers}}}\n" + gates)
    return path


def _export(model, directory: Path) -> Path:
    save_pretrained(model, directory)
    for path in resolve_tokenizer_dir(None).iterdir():
        shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("models")
    base = build_model(get_preset("tiny"), seed=0).eval()
    base_dir = _export(base, root / "base")
    candidate = build_model(get_preset("tiny"), seed=0).eval()
    with torch.no_grad():  # the known change: the LM head moved
        candidate.lm_head.weight.add_(0.05 * torch.randn(candidate.lm_head.weight.shape,
                                                         generator=torch.Generator().manual_seed(3)))
    return base_dir, _export(candidate, root / "candidate"), base


@pytest.fixture(scope="module")
def card(models, tmp_path_factory) -> dict:
    base_dir, cand_dir, _ = models
    directory = tmp_path_factory.mktemp("suite")
    _write(directory / "pairs.jsonl", _pairs())
    gates = ("gates:\n  - {metric: pairs/preference/preference_accuracy, rule: no_regression}\n"
             "  - {metric: pairs/preference/implicit_reward_accuracy, rule: min, threshold: 1.0}\n"
             "  - {metric: pairs/preference/mean_margin, rule: improves, category: login}\n")
    scorecard, _ = run_eval(_suite(directory, gates=gates), base_dir, cand_dir, directory / "eval", device="cpu",
                            log=lambda _: None)
    return scorecard


def _transformers_logps(hf_dir: Path) -> list[tuple[float, float, int, int]]:
    """(log p(chosen), log p(rejected), tokens of each) per pair, by transformers."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer, template = load_tokenizer(hf_dir), load_chat_template(hf_dir)
    out = []
    for row in _pairs():
        sums = []
        for sample in tokenize_pair(row, tokenizer, template=template, enable_thinking=False):
            assert len(sample.input_ids) < 256, "above the tiny indexer's top-k: the sparse selection would differ"
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([sample.input_ids])).logits[0].double(), dim=-1)
            scored = [(t, sample.input_ids[t + 1]) for t in range(len(sample.input_ids) - 1)
                      if sample.labels[t + 1] != IGNORE_INDEX]
            sums.append((sum(float(logp[t, token]) for t, token in scored), len(scored)))
        out.append((sums[0][0], sums[1][0], sums[0][1], sums[1][1]))
    return out


def _records(card: dict, label: str) -> list[dict]:
    return [e["outputs"][label]["preference"] for e in card["examples"] if e["set"] == "pairs"]


def test_log_probabilities_equal_transformers(card, models):
    base_dir, cand_dir, _ = models
    for label, hf_dir in (("base", base_dir), ("candidate", cand_dir)):
        for got, (chosen, rejected, n_chosen, n_rejected) in zip(_records(card, label), _transformers_logps(hf_dir)):
            assert (got["chosen_tokens"], got["rejected_tokens"]) == (n_chosen, n_rejected)
            assert got["logp_chosen"] == pytest.approx(chosen, rel=1e-5), label
            assert got["logp_rejected"] == pytest.approx(rejected, rel=1e-5), label
            assert got["margin"] == pytest.approx(chosen - rejected, rel=1e-4, abs=1e-4)


def test_implicit_margin_and_categories(card):
    base, cand = _records(card, "base"), _records(card, "candidate")
    assert all(b["implicit_margin"] is None for b in base)
    implicit = [BETA * (c["margin"] - b["margin"]) for b, c in zip(base, cand)]
    assert [c["implicit_margin"] for c in cand] == pytest.approx(implicit, rel=1e-5, abs=1e-6)
    assert all(abs(x) > 1e-4 for x in implicit), "the known change moves every pair's margin"
    metrics = {m["name"]: m for m in card["metrics"] if m["set"] == "pairs"}
    assert set(metrics["preference_accuracy"]["by_category"]) == {"all", "billing", "login", "outage"}
    for category in ("all", "billing", "login", "outage"):
        rows = [i for i, c in enumerate(CATEGORIES) if category in ("all", c)]
        values = {name: m["by_category"][category]["values"] for name, m in metrics.items()}
        for label, records in (("base", base), ("candidate", cand)):
            assert values["preference_accuracy"][label] == pytest.approx(
                sum(records[i]["margin"] > 0 for i in rows) / len(rows))
            assert values["mean_margin"][label] == pytest.approx(sum(records[i]["margin"] for i in rows) / len(rows))
        assert values["implicit_reward_accuracy"] == {
            "base": None, "candidate": pytest.approx(sum(implicit[i] > 0 for i in rows) / len(rows))}
        assert values["mean_implicit_margin"]["candidate"] == pytest.approx(sum(implicit[i] for i in rows) / len(rows))
    example = next(e for e in card["examples"] if e["set"] == "pairs")
    assert example["reference"] == _pairs()[0]["chosen"][0]["content"]
    assert example["outputs"]["candidate"]["text"].startswith("prefers")
    assert card["operations"]["base"]["requests"] == 0  # nothing generated


def test_gates_read_the_new_metrics(card):
    metrics = {m["name"]: m["by_category"] for m in card["metrics"] if m["set"] == "pairs"}
    gates = {g["metric"]: g for g in card["gates"]}
    acc = metrics["preference_accuracy"]["all"]["values"]
    assert gates["pairs/preference/preference_accuracy"]["passed"] == (acc["candidate"] >= acc["base"])
    implicit = metrics["implicit_reward_accuracy"]["all"]["values"]["candidate"]
    assert gates["pairs/preference/implicit_reward_accuracy"]["passed"] == (implicit >= 1.0)
    login = metrics["mean_margin"]["login"]["values"]
    gate = gates["pairs/preference/mean_margin"]
    assert (gate["value"], gate["base_value"]) == (login["candidate"], login["base"])
    assert gate["passed"] == (login["candidate"] > login["base"])


def test_a_rule_needing_the_base_is_refused_on_a_candidate_only_metric(tmp_path):
    _write(tmp_path / "pairs.jsonl", _pairs())
    suite = _suite(tmp_path, gates="gates:\n  - {metric: pairs/preference/implicit_reward_accuracy, "
                                   "rule: improves}\n")
    with pytest.raises(ValueError, match=r"suite.yaml:6: gates\[0\].rule: .*measured against the base.*use min or "
                                         "max"):
        load_suite(suite)


def _chat_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]


@pytest.mark.parametrize("scorers, rows, message", [
    ("[preference]", _chat_rows(), r"rows.jsonl:1: <row>: a chat row \(messages\), but the preference scorer "
                                   "scores preference rows"),
    ("[task_success, reference_loss]", _pairs(), r"rows.jsonl:1: <row>: a preference row \(prompt/chosen/rejected\), "
                                                 "but task_success, reference_loss score generated answers"),
    ("[preference]", [_pairs()[0], {**_pairs()[1], "rejected": _pairs()[1]["chosen"]}],
     "rows.jsonl:2: rejected: identical to chosen"),
], ids=["preference-on-chat", "chat-on-pairs", "contract"])
def test_rows_of_the_other_kind_are_refused(models, tmp_path, scorers, rows, message):
    base_dir, cand_dir, _ = models
    _write(tmp_path / "rows.jsonl", rows)
    suite = _suite(tmp_path, scorers=scorers, rows_file="rows.jsonl")
    with pytest.raises(ValueError, match=message):
        run_eval(suite, base_dir, cand_dir, tmp_path / "eval", device="cpu", log=lambda _: None)


def test_one_set_holds_one_kind_of_row(tmp_path):
    _write(tmp_path / "pairs.jsonl", _pairs())
    with pytest.raises(ValueError, match=r"suite.yaml:4: sets\[0\].scorers: set pairs: preference scores preference "
                                         r"pairs .* and facts score generated answers .* put them in two sets"):
        load_suite(_suite(tmp_path, scorers="[preference, facts]"))


@pytest.mark.parametrize("with_logprobs", [True, False], ids=["logprobs", "no-logprobs"])
def test_endpoint(models, tmp_path, with_logprobs):
    base_dir, _, base_model = models
    server = ThreadingHTTPServer(("127.0.0.1", 0), engine(base_model, with_logprobs))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    _write(tmp_path / "pairs.jsonl", _pairs())
    suite = _suite(tmp_path, gates="gates:\n  - {metric: pairs/preference/preference_accuracy, rule: min, "
                                   "threshold: 0}\n")
    try:
        card, _ = run_eval(suite, base_dir, url, tmp_path / "eval", device="cpu", log=lambda _: None)
    finally:
        server.shutdown()
        server.server_close()
    metrics = {m["name"]: m for m in card["metrics"] if m["set"] == "pairs"}
    if with_logprobs:  # the same weights served: the in-process values, and no implicit reward
        for b, c in zip(_records(card, "base"), _records(card, "candidate")):
            assert c["logp_chosen"] == pytest.approx(b["logp_chosen"], rel=1e-5)
            assert c["logp_rejected"] == pytest.approx(b["logp_rejected"], rel=1e-5)
            assert c["implicit_margin"] == pytest.approx(0.0, abs=1e-5)
        assert card["gates"][0]["passed"] and not any("not_available" in m for m in metrics.values())
        return
    for name, metric in metrics.items():
        assert metric["by_category"]["all"]["values"]["candidate"] is None, name
        assert metric["not_available"]["candidate"].startswith("not available from this engine"), name
    assert metrics["preference_accuracy"]["by_category"]["all"]["values"]["base"] is not None
    assert all(r is None for r in _records(card, "candidate"))
    assert all(e["outputs"]["candidate"]["passed"] for e in card["examples"])  # no row fails for it
    gate = card["gates"][0]
    assert not gate["passed"] and "not available from this engine (null)" in gate["message"]
