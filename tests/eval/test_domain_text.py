"""The domain-perplexity set (`glmtune/eval/domain_text.py`): held-out documents scored as loss and
perplexity of base and candidate, beside the general-text regression, with its gates.

Two tiny GLM-5 exports (fp32, random init, seeds 0 and 1) are scored on a held-out JSONL written
here: two sources, one document longer than the window. Asserted:
  * tokenization: each document is its tokens and EOS, cut into `window`-token windows;
  * each model's loss per source and over all equals a direct computation (the model's logits,
    cross-entropy over each window's tokens after its first), n is the predicted tokens, the
    perplexity is exp(loss), and the scorecard's markdown and HTML show both models;
  * gates: `improves` with a margin in nats on the domain loss and `max_increase` on the general
    loss pass or fail exactly as the values say;
  * bad input (a missing file, an empty set, a row without text, bytes that are not UTF-8) is one
    sentence naming the file (and line), before a model loads;
  * a served model (a stub engine's prompt log-probabilities) gives the in-process values, and an
    engine without them leaves both metrics null with the reason (the gate fails saying so).
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from glmtune import load_pretrained, save_pretrained
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.eval.domain_text import DomainTextConfig, document_windows, domain_metric_records, load_documents
from glmtune.eval.evaluate import run_eval
from glmtune.eval.gates import evaluate_gates
from glmtune.eval.suite import GateConfig, load_suite
from glmtune.models.glm5 import build_model, get_preset
from tests.eval.endpoint_stub import engine

LOSS, PPL, GENERAL = "domain_text/loss/loss", "domain_text/loss/perplexity", "general_text/loss/loss"
WINDOW = 48
MANUAL = ("Torque the flange bolts to 40 newton metres in a star pattern, then check the gasket seat. "
          "Replace the seal kit every 2000 operating hours or when the pressure test shows a leak. ")
DOCUMENTS = [
    {"text": MANUAL * 4, "source": "manuals"},  # longer than the window: scored in windows
    {"text": "The pump housing is cast iron; its impeller is bronze.", "source": "manuals"},
    {"text": "Revenue rose 4% in the quarter while operating costs fell, the filing states.", "source": "filings"},
    {"text": "The board declared a dividend of 12 cents per share payable in March.", "source": "filings"},
]


def _export(model, directory: Path) -> Path:
    save_pretrained(model, directory)
    for path in resolve_tokenizer_dir(None).iterdir():
        shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    args = get_preset("tiny")
    return {"base": _export(build_model(args, seed=0).eval(), root / "base"),
            "candidate": _export(build_model(args, seed=1).eval(), root / "candidate")}


def _suite(directory: Path, gates: list[dict]) -> Path:
    (directory / "heldout.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCUMENTS))
    (directory / "general.txt").write_text("The ferry left the harbour at seven, an hour late, and the gulls "
                                           "followed it past the breakwater. " * 3)
    path = directory / "suite.yaml"
    path.write_text(json.dumps({"name": "cpt", "version": "1",
                                "general_text": {"path": "general.txt", "max_tokens": 256, "window": 64},
                                "domain_text": {"path": "heldout.jsonl", "source_field": "source", "window": WINDOW}, "gates": gates}))
    return path


@pytest.fixture(scope="module")
def card(models, tmp_path_factory) -> tuple[dict, Path]:
    directory = tmp_path_factory.mktemp("suite")
    gates = [{"name": "domain improves", "metric": LOSS, "rule": "improves", "threshold": 0.0},
             {"name": "general budget", "metric": GENERAL, "rule": "max_increase", "threshold": 0.5}]
    scorecard, _ = run_eval(_suite(directory, gates), models["base"], models["candidate"], directory / "eval",
                            device="cpu", log=lambda _: None)
    return scorecard, directory


def _direct(hf_dir: Path) -> dict[str, tuple[float, int]]:
    """Source -> (summed loss, predicted tokens) from the model's logits, computed here."""
    model = load_pretrained(hf_dir, torch.float32, "cpu").eval()
    tokenizer = load_tokenizer(hf_dir)
    sums: dict[str, list] = {}
    for doc in DOCUMENTS:
        ids = tokenizer(doc["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for start in range(0, len(ids), WINDOW):
            window = ids[start:start + WINDOW]
            if len(window) < 2:
                continue
            with torch.no_grad():
                logits = model(torch.tensor([window])).logits[0].float()
            loss = F.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="sum")
            entry = sums.setdefault(doc["source"], [0.0, 0])
            entry[0] += float(loss)
            entry[1] += len(window) - 1
    return {source: (total, count) for source, (total, count) in sums.items()}


def test_documents_are_tokenized_with_eos_and_cut_into_windows():
    tokenizer = load_tokenizer()
    ids = tokenizer(MANUAL * 4, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = document_windows(tokenizer, MANUAL * 4, WINDOW)
    assert len(ids) > 2 * WINDOW and [t for w in windows for t in w] == ids[:len(ids) - (len(ids) % WINDOW == 1)]
    assert all(len(w) == WINDOW for w in windows[:-1]) and windows[-1][-1] == tokenizer.eos_token_id


def test_the_loss_equals_a_direct_computation(card, models):
    scorecard, directory = card
    metrics = {m["id"]: m for m in scorecard["metrics"]}
    loss, ppl = metrics[LOSS], metrics[PPL]
    assert (loss["unit"], loss["higher_is_better"], ppl["unit"]) == ("nats_per_token", False, "perplexity")
    assert set(loss["by_category"]) == {"all", "manuals", "filings"}
    for label in ("base", "candidate"):
        direct = _direct(models[label])
        for category, sources in (("all", list(direct)), ("manuals", ["manuals"]), ("filings", ["filings"])):
            total = sum(direct[s][0] for s in sources)
            count = sum(direct[s][1] for s in sources)
            entry = loss["by_category"][category]
            assert entry["values"][label] == pytest.approx(total / count, rel=1e-5), (label, category)
            assert entry["n"] == count
            assert ppl["by_category"][category]["values"][label] == pytest.approx(math.exp(entry["values"][label]))
    delta = loss["by_category"]["all"]["delta"]["candidate"]
    values = loss["by_category"]["all"]["values"]
    assert delta == pytest.approx(values["candidate"] - values["base"])
    markdown = (directory / "eval" / "scorecard.md").read_text()
    html = (directory / "eval" / "scorecard.html").read_text()
    for text in (markdown, html):
        assert LOSS in text and PPL in text and GENERAL in text
    assert f"| {PPL} | filings |" in markdown
    assert "## Domain text against general text" in markdown


def test_gates_pass_and_fail_as_stated(card):
    scorecard, _ = card
    metrics = {m["id"]: m for m in scorecard["metrics"]}
    domain = metrics[LOSS]["by_category"]["all"]["values"]
    general = metrics[GENERAL]["by_category"]["all"]["values"]
    domain_gate, general_gate = scorecard["gates"]
    assert domain_gate["passed"] == (domain["base"] - domain["candidate"] > 0)
    assert general_gate["passed"] == (general["candidate"] - general["base"] <= 0.5)
    # Known sums: base 2.0 nats/token, candidate 1.5 (perplexity 7.39 -> 4.48).
    results = {"base": {"domain": {"a": [20.0, 10], "b": [20.0, 10]}},
               "candidate": {"domain": {"a": [10.0, 10], "b": [20.0, 10]}}}
    records = domain_metric_records(results, ["base", "candidate"])
    assert records[0]["by_category"]["all"]["values"] == {"base": 2.0, "candidate": 1.5}
    assert records[1]["by_category"]["a"]["values"]["candidate"] == pytest.approx(math.e)
    gates = [GateConfig(LOSS, "improves", threshold=0.4), GateConfig(LOSS, "improves", threshold=0.5),
             GateConfig(LOSS, "improves", threshold=0.4, category="b"),
             GateConfig(PPL, "max", threshold=4.5), GateConfig(PPL, "max", threshold=4.4)]
    passed = [g["passed"] for g in evaluate_gates(gates, records, ["candidate"])]
    assert passed == [True, False, False, True, False]


def test_bad_input_is_one_sentence_naming_the_file(tmp_path):
    config = DomainTextConfig(path="x")
    missing = tmp_path / "missing.yaml"
    missing.write_text(json.dumps({"name": "s", "version": "1", "domain_text": {"path": "nope.jsonl"}}))
    with pytest.raises(ValueError, match=r"missing.yaml:1: domain_text.path: file not found: .*nope.jsonl$"):
        load_suite(missing)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"^domain_text: no documents in .*empty.jsonl \(empty, or only whitespace\)$"):
        load_documents(empty, config)
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"^domain_text: .*no_text.jsonl:2: the text field 'text' is missing"):
        load_documents(no_text, config)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match=r"^domain_text: .*binary.txt:1: not valid UTF-8"):
        load_documents(binary, config)
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match=r"^domain_text: .*none holds no .txt, .md, .jsonl, .parquet files$"):
        load_documents(tmp_path / "none", config)


def test_text_files_are_one_document_each_named_by_file(tmp_path):
    (tmp_path / "corpus" / "b").mkdir(parents=True)
    (tmp_path / "corpus" / "a.md").write_text("# Pump\nThe housing is cast iron.\n")
    (tmp_path / "corpus" / "b" / "c.txt").write_text("Revenue rose.\n")
    docs = load_documents(tmp_path / "corpus", DomainTextConfig())
    assert [(d.source, d.text) for d in docs] == [("a.md", "# Pump\nThe housing is cast iron."),
                                                  ("b/c.txt", "Revenue rose.")]
    assert len(load_documents(tmp_path / "corpus", DomainTextConfig(limit=1))) == 1


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_a_served_candidate_scores_through_its_prompt_logprobs(models, tmp_path, with_logprobs):
    server = ThreadingHTTPServer(("127.0.0.1", 0), engine(build_model(get_preset("tiny"), seed=0).eval(),
                                                          with_logprobs=with_logprobs))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        suite = _suite(tmp_path, [{"metric": LOSS, "rule": "no_regression", "threshold": 0.01}])
        scorecard, _ = run_eval(suite, models["base"], f"http://127.0.0.1:{server.server_address[1]}/v1",
                                tmp_path / "eval", device="cpu", log=lambda _: None)
    finally:
        server.shutdown()
        server.server_close()
    metrics = {m["id"]: m for m in scorecard["metrics"]}
    [gate] = scorecard["gates"]
    for metric_id in (LOSS, PPL):
        values = metrics[metric_id]["by_category"]["all"]["values"]
        if with_logprobs:  # the same weights as the base, served
            assert "not_available" not in metrics[metric_id]
            assert values["candidate"] == pytest.approx(values["base"], rel=1e-5), metric_id
        else:
            assert values["candidate"] is None and values["base"] is not None
            assert metrics[metric_id]["not_available"]["candidate"].startswith("not available from this engine")
    assert gate["passed"] is with_logprobs


def test_the_bundled_cpt_suite_loads_its_held_out_sources():
    suite = load_suite(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "eval_cpt_domain_text.yaml")
    assert not suite.sets and {LOSS, PPL, GENERAL} <= set(suite.metrics)
    docs = load_documents(suite.domain_text_path, suite.file.domain_text)
    assert len(docs) == 92 and len({d.source for d in docs}) == 23
    corpus = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "domain_text" / "corpus.jsonl"
    trained = {json.loads(line)["source"] for line in corpus.read_text().splitlines()}
    assert not trained & {d.source for d in docs}  # held out by source: no training document's family
    assert [(g.metric, g.rule, g.threshold) for g in suite.file.gates] == [(LOSS, "improves", 1.0),
                                                                          (GENERAL, "max_increase", 0.5)]
