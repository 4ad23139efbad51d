"""`glmtune eval --compare TARGET`: one more model on the same scorecard (glmtune/eval/compare.py).

A distillation scorecard's arms, tiny: the base and the candidate are a 3-layer student, the compared
model is the tiny teacher (another tokenizer-sharing checkpoint). The compared arm answers as that
model does when it is the candidate (every score and delta the same), carries its serving costs
(parameters, active parameters, tokens/s), is in every table of scorecard.md and scorecard.html,
and is never gated. An endpoint target gets its API key from its key-env variable and the key is
nowhere in the output, even when the server echoes it back into an answer. A target that cannot be
used is one line (exit 2) and nothing is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from glmtune import save_pretrained
from glmtune.cli import main
from glmtune.data.synthetic import SCHEMA_PATH, generate_rows
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.eval.operations import parameter_counts
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.registry import spec_for
from tests.eval.endpoint_stub import engine

STUDENT = {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "dense", "sparse"],
           "indexer_types": ["full", "shared", "full"], "n_routed_experts": 4}
KEY = "sk-compare-test-0123456789abcdef"


def _save(model, directory: Path) -> Path:
    save_pretrained(model, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TOKENIZER_DIR / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(the teacher, the student): tiny seed 0, and 3 layers with 4 experts, one tokenizer."""
    root = tmp_path_factory.mktemp("compare")
    teacher = _save(build_model(get_preset("tiny"), seed=0), root / "teacher")
    student = _save(build_model(get_preset("tiny").replace(**STUDENT), seed=1), root / "student")
    return teacher, student


@pytest.fixture(scope="module")
def suite(models, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("suite")
    rows = [r for r in generate_rows(40, seed=7) if not r.get("tools")][:3]
    (directory / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "compare", "version": "1", "decoding": {"max_new_tokens": 8, "max_tool_rounds": 0},
            "sets": [{"name": "tickets", "path": "tickets.jsonl",
                      "scorers": [{"type": "task_success", "fields": ["product", "severity"]},
                                  {"type": "format", "schema": str(SCHEMA_PATH)}, "reference_loss"]}],
            "gates": [{"name": "latency", "metric": "operations/latency/p95_s", "rule": "max", "threshold": 1e6}]}
    (directory / "suite.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return directory / "suite.yaml"


def _eval(suite: Path, base: Path, candidate: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    """`glmtune eval` in this process at one thread: (exit status, stdout, stderr)."""
    stdout, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several test workers share the cores; the tiny model's small ops run faster
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            code = main(["eval", str(suite), "--base", str(base), "--candidate", str(candidate), "--out", str(out),
                         "--device", "cpu", "--json", *extra])
    finally:
        torch.set_num_threads(threads)
    return code, stdout.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cards(models, suite, tmp_path_factory) -> tuple[dict, dict, Path]:
    """(student -> student with the teacher compared, student -> teacher, the first's directory)."""
    teacher, student = models
    root = tmp_path_factory.mktemp("evals")
    code, _, err = _eval(suite, student, student, root / "compared", "--compare", f"{teacher},name=teacher")
    assert code == 0, err
    code, _, err = _eval(suite, student, teacher, root / "as-candidate")
    assert code == 0, err
    read = [json.loads((root / name / "scorecard.json").read_text()) for name in ("compared", "as-candidate")]
    return read[0], read[1], root / "compared"


def test_a_compared_model_scores_as_it_does_as_the_candidate(cards):
    compared, as_candidate, _ = cards
    assert [(m["label"], m["role"], m["kind"]) for m in compared["models"]] == [
        ("base", "base", "hf"), ("candidate", "candidate", "hf"), ("teacher", "compare", "hf")]
    pairs = [(a, b) for a, b in zip(compared["metrics"], as_candidate["metrics"]) if not a["id"].startswith("operations/")]
    assert pairs and [a["id"] for a, _ in pairs] == [b["id"] for _, b in pairs]
    for a, b in pairs:
        for category, entry in a["by_category"].items():
            theirs = b["by_category"][category]
            assert entry["values"]["teacher"] == pytest.approx(theirs["values"]["candidate"], rel=1e-6), a["id"]
            assert entry["delta"]["teacher"] == pytest.approx(theirs["delta"]["candidate"], rel=1e-6, abs=1e-9)
    for a, b in zip(compared["examples"], as_candidate["examples"]):
        assert a["outputs"]["teacher"]["text"] == b["outputs"]["candidate"]["text"]
        assert a["outputs"]["teacher"]["passed"] == b["outputs"]["candidate"]["passed"]


def test_its_serving_costs_are_measured_and_it_is_not_gated(cards, models):
    compared, _, _ = cards
    teacher, student = models
    ops = compared["operations"]
    assert {k: ops["teacher"][k] for k in ("parameters", "active_parameters")} == parameter_counts(
        spec_for(teacher), teacher)
    assert ops["teacher"]["parameters"] > ops["candidate"]["parameters"] == parameter_counts(
        spec_for(student), student)["parameters"]
    assert ops["teacher"]["generated_tokens_per_s"] > 0 and ops["teacher"]["device"] == "cpu"
    assert ops["teacher"]["requests"] == ops["candidate"]["requests"] == 3
    assert [g["model"] for g in compared["gates"]] == ["candidate"]  # the gates decide the candidate only


def test_the_reports_show_the_compared_arm(cards):
    compared, _, out = cards
    md = (out / "scorecard.md").read_text()
    assert "| metric | category | n | base | candidate | teacher | Δ candidate | Δ teacher |" in md
    params = f"{compared['operations']['teacher']['parameters']:,}"
    assert f"| teacher | cpu | {params} | " in md
    assert "## Failures of teacher" in md
    assert "Compared, not gated: teacher (the gates decide the candidate against the base)." in md
    html = (out / "scorecard.html").read_text()
    assert f'teacher</td><td class="num">{params}</td>' in html
    assert "Compared, not gated: teacher" in html and "Δ teacher" in html


def _echoing_engine(model, seen: list[str]):
    """The stub engine, answering a generation with the bearer token it was sent (a server that echoes
    the key back): the key must still appear nowhere in the output."""
    base = engine(model)

    class Echo(base):
        def do_POST(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if isinstance(json.loads(raw)["prompt"], str):
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                return self._json({"id": "g", "object": "text_completion", "created": 0, "model": "tiny",
                                   "choices": [{"index": 0, "text": f"Fine, {token}.", "finish_reason": "stop"}]})
            self.rfile = io.BytesIO(raw)
            return super().do_POST()

    return Echo


def test_an_endpoint_arm_uses_its_key_and_writes_it_nowhere(models, suite, tmp_path, monkeypatch):
    teacher, student = models
    monkeypatch.setenv("COMPARE_TEST_KEY", KEY)
    seen: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _echoing_engine(build_model(get_preset("tiny"), seed=0).eval(),
                                                                   seen))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        code, stdout, err = _eval(suite, student, student, tmp_path / "out",
                                  "--compare", f"{url},name=served,key-env=COMPARE_TEST_KEY", "--concurrency", "2")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0, err
    assert seen and all(header == f"Bearer {KEY}" for header in seen)
    card = json.loads((tmp_path / "out" / "scorecard.json").read_text())
    served = next(m for m in card["models"] if m["label"] == "served")
    assert (served["role"], served["kind"], served["fingerprint"]["model"]) == ("compare", "endpoint", "tiny")
    assert all(e["outputs"]["served"]["text"] == "Fine, [API key redacted]." for e in card["examples"])
    reference = next(m for m in card["metrics"] if m["id"] == "tickets/reference_loss/loss")
    assert reference["by_category"]["all"]["values"]["served"] is not None  # the engine's prompt log-probabilities
    assert card["operations"]["served"]["endpoint"]["http_requests"] >= 3
    for path in (tmp_path / "out").rglob("*"):
        assert not path.is_file() or KEY.encode() not in path.read_bytes(), path
    assert KEY not in stdout and KEY not in err


@pytest.mark.parametrize("target, extra, message", [
    ("{missing}", (), "--compare {missing}: "),
    ("{teacher},name=candidate", (), "the label 'candidate' is an arm's; give another with name="),
    ("http://127.0.0.1:9/v1,key-env=GLMTUNE_COMPARE_UNSET", (),
     "key-env: the environment variable GLMTUNE_COMPARE_UNSET is not set (or empty)"),
    ("{teacher},cost-per-1k=1", (), "'cost-per-1k=1' is not one of name=, model=, api=, key-env="),
    ("{teacher}", ("--nproc-per-node", "2"), "--compare with --nproc-per-node: a sharded evaluation lays out"),
    ("{other_template}", (), "its chat template"),
], ids=["missing", "reserved-label", "key-unset", "decide-key", "sharded", "other-template"])
def test_a_target_that_cannot_be_used_is_one_line_and_nothing_is_written(models, suite, tmp_path, target, extra,
                                                                          message):
    teacher, student = models
    other = Path(shutil.copytree(teacher, tmp_path / "other"))
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    names = {"teacher": teacher, "missing": tmp_path / "no-such-model", "other_template": other}
    target, message = target.format(**names), message.format(**names)
    code, stdout, err = _eval(suite, student, student, tmp_path / "out", "--compare", target, *extra)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists() and stdout == ""
