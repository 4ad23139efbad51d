"""The serving metrics (`glmtune/eval/serving.py`): MTP acceptance against an explicit reference,
and every way a value is null with its reason, never a silent zero.

Tiny GLM-5 HF exports (fp32, one MTP layer): the base (seed 0) and a candidate whose LM head has
four rows scaled up, so greedy tokens gather on few ids and the MTP drafts agree with the main
model's next token on a measurable share of positions (a random-init base agrees on almost none).
Asserted:
  * `operations/serving/mtp_acceptance` of each model equals the count computed here from
    materialized logits over the chat sets' reference conversations (`reference_sample`): at every
    position t whose token t+2 is supervised, argmax of the LM head over the MTP layer's output
    (`mtp_hidden_states`) against argmax of the main logits at t+1; a preference set's pairs do
    not count;
  * the suite accepts gates on the serving ids, and they are evaluated (no_regression, min);
  * not available: a checkpoint with `num_nextn_predict_layers: 0`, an endpoint (both null with
    the reason, in the metric, the gate and scorecard.md), and a metric the spec counted nothing
    for (indexer recall on rows shorter than the top-k).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from glmtune import load_pretrained, save_pretrained
from glmtune.data.chat_template import IGNORE_INDEX, load_chat_template
from glmtune.data.synthetic import generate_rows
from glmtune.data.synthetic_preferences import generate_preference_rows
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.eval.answering import Prompting
from glmtune.eval.evaluate import run_eval
from glmtune.eval.scorers.reference_loss import reference_sample
from glmtune.eval.sets import load_sets
from glmtune.eval.suite import DecodingConfig, load_suite
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.spec import Glm5Compute
from tests.eval.endpoint_stub import engine

MTP = "operations/serving/mtp_acceptance"
RECALL = "operations/serving/indexer_recall"


def _export(model, directory: Path) -> Path:
    save_pretrained(model, directory)
    for path in resolve_tokenizer_dir(None).iterdir():
        shutil.copy(path, directory / path.name)
    return directory


def _candidate(args):
    model = build_model(args, seed=0).eval()
    with torch.no_grad():  # a few dominant tokens: greedy choices of the main and MTP heads often meet
        model.lm_head.weight[10:14] *= 30.0
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    args = get_preset("tiny")
    assert args.num_nextn_predict_layers == 1
    return {"base": _export(build_model(args, seed=0).eval(), root / "base"),
            "candidate": _export(_candidate(args), root / "candidate"),
            "no_mtp": _export(build_model(dataclasses.replace(args, num_nextn_predict_layers=0), seed=0).eval(),
                              root / "no_mtp")}


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _suite(directory: Path, gates: str = "") -> Path:
    rows = generate_rows(60, seed=5)
    _write(directory / "tickets.jsonl", [r for r in rows if r["category"] == "tool_call"][:1] +
           [r for r in rows if not r.get("tools")][:2])  # a tool turn inside the reference: not supervised
    _write(directory / "plain.jsonl", [{"id": "p0", "messages": [
        {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there, how can I help?"}]}])
    _write(directory / "pairs.jsonl", generate_preference_rows(2, seed=5))
    path = directory / "suite.yaml"
    path.write_text("name: serving\nversion: 1\ndecoding: {max_new_tokens: 4, max_tool_rounds: 0}\nsets:\n"
                    "  - {name: tickets, path: tickets.jsonl, scorers: [reference_loss]}\n"
                    "  - {name: plain, path: plain.jsonl, scorers: [reference_loss]}\n"
                    "  - {name: pairs, path: pairs.jsonl, scorers: [preference]}\n" + gates)
    return path


GATES = (f"gates:\n  - {{metric: {MTP}, rule: no_regression}}\n"
         f"  - {{metric: {MTP}, rule: min, threshold: 0.05}}\n")


@pytest.fixture(scope="module")
def card(models, tmp_path_factory) -> tuple[dict, Path]:
    directory = tmp_path_factory.mktemp("suite")
    scorecard, _ = run_eval(_suite(directory, GATES), models["base"], models["candidate"], directory / "eval",
                              device="cpu", log=lambda _: None)
    return scorecard, directory


def _reference_counts(hf_dir: Path, suite_path: Path) -> tuple[int, int]:
    """(accepted, positions) over the suite's chat rows, from materialized logits."""
    model = load_pretrained(hf_dir, torch.float32, "cpu").eval()
    suite = load_suite(suite_path)
    tokenizer = load_tokenizer(hf_dir)
    prompting = Prompting(tokenizer, load_chat_template(hf_dir), False, DecodingConfig())
    accepted = positions = 0
    for s in load_sets(suite, None):
        if s.spec.row_kind != "chat":
            continue
        for row in s.rows:
            ids, targets = reference_sample(row, prompting)  # targets[t] = labels[t + 1]
            # MTP at t drafts token t+2; it has a target where labels[t + 2] (= targets[t + 1]) is supervised
            scored = [t for t in range(len(ids) - 2) if targets[t + 1] != IGNORE_INDEX]
            mtp_targets = [ids[t + 2] if t in scored else IGNORE_INDEX for t in range(len(ids))]
            with torch.no_grad():
                ids_1T = torch.tensor([ids])
                out = model(ids_1T, MicroBatch(ids_1T, mtp_targets=torch.tensor([mtp_targets])))
                main_greedy = out.logits[0].float().argmax(-1)
                drafts = model.lm_head(out.mtp_hidden_states[0]).float().argmax(-1)
            accepted += sum(int(drafts[t] == main_greedy[t + 1]) for t in scored)
            positions += len(scored)
    return accepted, positions


def test_mtp_acceptance_equals_the_reference(card, models):
    scorecard, directory = card
    metric = next(m for m in scorecard["metrics"] if m["id"] == MTP)
    assert "not_available" not in metric and metric["unit"] == "ratio" and metric["higher_is_better"]
    values = metric["by_category"]["all"]["values"]
    for label in ("base", "candidate"):
        accepted, positions = _reference_counts(models[label], directory / "suite.yaml")
        serving = scorecard["operations"][label]["serving"]
        assert serving["rows"] == 4 and serving["rows_failed"] == 0  # the chat rows; the pairs do not count
        assert serving["totals"]["mtp_acceptance"] == {"sum": accepted, "count": positions}, label
        assert values[label] == accepted / positions
        assert metric["by_category"]["all"]["n"] == positions
    assert 0.05 < values["candidate"] < 1.0, "the planted head makes drafts agree on a measurable share"


def test_gates_on_a_serving_metric(card):
    scorecard, directory = card
    assert {MTP, RECALL} <= set(load_suite(directory / "suite.yaml").metrics)
    values = next(m for m in scorecard["metrics"] if m["id"] == MTP)["by_category"]["all"]["values"]
    regression, floor = scorecard["gates"]
    assert (regression["value"], regression["base_value"]) == (values["candidate"], values["base"])
    assert regression["passed"] == (values["candidate"] >= values["base"])
    assert floor["passed"] == (values["candidate"] >= 0.05)
    markdown = (directory / "eval" / "scorecard.md").read_text()
    assert f"| {MTP} | all |" in markdown


@pytest.fixture
def served_candidate(models):
    server = ThreadingHTTPServer(("127.0.0.1", 0), engine(_candidate(get_preset("tiny"))))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_no_mtp_layer_and_an_endpoint_are_not_available(models, served_candidate, tmp_path):
    suite = _suite(tmp_path, f"gates:\n  - {{metric: {MTP}, rule: no_regression}}\n")
    scorecard, out = run_eval(suite, models["no_mtp"], served_candidate, tmp_path / "eval", device="cpu",
                              log=lambda _: None)
    metrics = {m["id"]: m for m in scorecard["metrics"]}
    assert metrics[MTP]["by_category"]["all"]["values"] == {"base": None, "candidate": None}
    why = metrics[MTP]["not_available"]
    assert why["base"] == ("not available from this checkpoint: it has no MTP layer "
                           "(config.json num_nextn_predict_layers: 0)")
    assert why["candidate"].startswith("not available from this engine: a served model exposes no MTP drafts")
    assert metrics[RECALL]["not_available"]["candidate"] == why["candidate"]
    assert "serving" not in scorecard["operations"]["candidate"]
    [gate] = scorecard["gates"]
    assert not gate["passed"] and gate["message"] == "candidate candidate's value is not available from this " \
                                                     "engine (null)"
    markdown = (out / "scorecard.md").read_text()
    assert "n/a (not available from this checkpoint) | n/a (not available from this engine)" in markdown
    assert "n/a (not available from this checkpoint)" in (out / "scorecard.html").read_text()


def test_nothing_counted_is_not_a_zero(models, tmp_path, monkeypatch):
    """A spec entry with count 0 (rows shorter than the indexer's top-k: every key is selected) is
    null with the reason, the longest row named."""
    original = Glm5Compute.serving_metrics

    def with_recall(self, model, batch):
        return {**original(self, model, batch), "indexer_recall": torch.zeros(2)}

    monkeypatch.setattr(Glm5Compute, "serving_metrics", with_recall)
    suite = _suite(tmp_path)
    scorecard, _ = run_eval(suite, models["base"], models["base"], tmp_path / "eval", device="cpu",
                            log=lambda _: None)
    metric = next(m for m in scorecard["metrics"] if m["id"] == RECALL)
    assert metric["by_category"]["all"]["values"] == {"base": None, "candidate": None}
    prompting = Prompting(load_tokenizer(models["base"]), load_chat_template(models["base"]), False, DecodingConfig())
    longest = max(len(reference_sample(row, prompting)[0]) for s in load_sets(load_suite(suite), None)
                  if s.spec.row_kind == "chat" for row in s.rows)
    assert metric["not_available"]["candidate"] == (
        "not measurable on these rows: no query has more allowed keys than the indexer's top-k, so every key is "
        f"selected (the longest row has {longest} tokens; longer rows measure it)")
    assert scorecard["operations"]["base"]["serving"]["totals"]["indexer_recall"] == {"sum": 0.0, "count": 0.0}
