"""`glmtune eval` on the tiny model: the base (RUN_DIR/base, random init) against a short real SFT run
(the shared four-step run with its HF export), every scorer on real outputs, and a planted
regression for each gate that makes eval fail on exactly that gate.

The four-step model does not answer tickets yet (its outputs are not JSON and call no tools),
so the suite's thresholds sit around what it measurably does: its reference answers' loss
falls (the `improves` gate), it calls no tool (3 of 4 rows of the tools set need none), it
never refuses, its loss on plain prose stays the base's (8.37). Four variants regress their
gate for real: the trained model as its own base (nothing improves), one more ticket in the set
(a third critical format failure), a tools set with two of four rows needing a call, refusal
markers its JSON answers match (its ordinary answers now count as refusals). Two are budget
variants, because no text makes a four-step model measurably worse than its random base and
latency cannot be regressed deterministically: a loss budget that asks the loss to fall by 0.5
nats, a p95 latency limit of 0.1 ms. Evaluations run in this process at one thread (several
xdist workers share the CPU cores; the tiny model's many small ops then run 2-20x faster).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from glmtune.cli import main
from glmtune.data.synthetic import SCHEMA_PATH, generate_rows
from tests.train.run_helpers import TWO_STEPS, WITH_EXPORT, shared_run

BUNDLED = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "eval_support_json"
GATES = ["reference loss improves", "critical format failures", "tool execution", "no refusal regression",
         "general loss budget", "p95 latency"]


def _suite(tools_rows: int = 1, ticket_limit: int = 2, markers: list[str] | None = None, loss_budget: float = 0.5,
           latency: float = 60.0) -> dict:
    refusal = {"type": "refusal"} if markers is None else {"type": "refusal", "markers": markers}
    return {
        "name": "ci", "version": "1",
        "decoding": {"max_new_tokens": 12, "batch_size": 8, "max_tool_rounds": 1},
        "tools": {"timeout_s": 30, "functions": {"lookup_order": "glmtune.data.synthetic:lookup_order"}},
        "sets": [
            {"name": "tickets", "run_split": "validation", "limit": ticket_limit,
             "scorers": [{"type": "task_success", "fields": ["product", "severity", "next_action"]},
                         {"type": "format", "schema": str(SCHEMA_PATH)}, "reference_loss"]},
            {"name": "tools", "path": f"tools_{tools_rows}.jsonl", "scorers": ["tool_execution", "task_success"]},
            {"name": "refusal", "path": "refusal.jsonl", "scorers": [refusal]},
            {"name": "general", "path": "general.jsonl", "scorers": ["facts", "reference_loss"]},
        ],
        "general_text": {"path": "general_text.txt", "max_tokens": 256, "window": 128},
        "gates": [
            {"name": GATES[0], "metric": "tickets/reference_loss/loss", "rule": "improves"},
            {"name": GATES[1], "metric": "tickets/format/critical_failures", "rule": "max", "threshold": 2},
            {"name": GATES[2], "metric": "tools/tool_execution/success", "rule": "min", "threshold": 0.7},
            {"name": GATES[3], "metric": "refusal/refusal/accuracy", "rule": "no_regression"},
            {"name": GATES[4], "metric": "general_text/loss/loss", "rule": "max_increase", "threshold": loss_budget},
            {"name": GATES[5], "metric": "operations/latency/p95_s", "rule": "max", "threshold": latency},
        ],
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("suite")
    rows = generate_rows(200, seed=7)
    calls = [r for r in rows if r["category"] == "tool_call"]
    quoted = [r for r in rows if r.get("tools") and r["category"] != "tool_call"]  # tools offered, no call needed
    plain = [r for r in rows if not r.get("tools")]
    _write_jsonl(directory / "tools_1.jsonl", calls[:1] + quoted[:1] + plain[:2])
    _write_jsonl(directory / "tools_2.jsonl", calls[:2] + quoted[:1] + plain[:1])
    refusal = [json.loads(line) for line in (BUNDLED / "refusal.jsonl").read_text().splitlines()]
    _write_jsonl(directory / "refusal.jsonl", [refusal[0], *refusal[5:8]])  # one must refuse, three must not
    general = [json.loads(line) for line in (BUNDLED / "general.jsonl").read_text().splitlines()]
    _write_jsonl(directory / "general.jsonl", [general[0], general[4]])
    shutil.copy(BUNDLED / "general_text.txt", directory / "general_text.txt")
    return directory


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sft_run(shared_results) -> Path:
    return shared_run(shared_results, *WITH_EXPORT).run_dir  # also tests/distributed' reference run


def _main(argv: list[str]) -> tuple[int, str, str]:
    """`glmtune ARGV` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _eval(suite_dir: Path, name: str, suite: dict, base: Path, candidate: Path, *extra: str):
    path = suite_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    out = suite_dir / "out" / name
    code, stdout, stderr = _main(["eval", str(path), "--base", str(base), "--candidate", str(candidate),
                                  "--out", str(out), "--device", "cpu", *extra])
    card = json.loads((out / "scorecard.json").read_text()) if (out / "scorecard.json").is_file() else None
    return code, card, out, stdout + stderr


@pytest.fixture(scope="module")
def baseline(sft_run, suite_dir):
    return _eval(suite_dir, "baseline", _suite(), sft_run, sft_run)


def test_every_scorer_runs_on_real_outputs_and_every_gate_passes(baseline, sft_run):
    code, card, out, printed = baseline
    assert code == 0, printed
    assert card["format"] == "glmtune.scorecard/1" and card["passed"]
    assert [g["name"] for g in card["gates"]] == GATES and all(g["passed"] for g in card["gates"])
    assert [(m["label"], m["kind"], m["fingerprint"]["path"]) for m in card["models"]] == [
        ("base", "run", str(sft_run / "base")), ("candidate", "run", str(sft_run / "hf"))]
    metrics = {m["id"]: m for m in card["metrics"]}
    scorers = {m["scorer"] for m in card["metrics"]}
    assert scorers == {"task_success", "format", "tool_execution", "reference_loss", "refusal", "facts", "loss",
                       "latency", "throughput", "memory", "serving"}
    assert metrics["operations/serving/mtp_acceptance"]["by_category"]["all"]["n"] > 0
    for metric in metrics.values():
        entry = metric["by_category"]["all"]
        if metric["id"] == "operations/serving/indexer_recall" and "not_available" in metric:  # rows below top-k
            assert [label for label, v in entry["values"].items() if v is None] == list(metric["not_available"])
            continue
        assert entry["n"] > 0 and set(entry["values"]) == {"base", "candidate"}, metric["id"]
        if metric["scorer"] != "memory":  # CPU: the process's peak RSS (Linux); checked below
            assert all(v is not None for v in entry["values"].values()), metric["id"]
    tools = metrics["tools/tool_execution/success"]["by_category"]
    assert tools["all"]["values"]["candidate"] == 0.75 and tools["tool_call"]["values"]["candidate"] == 0.0
    loss = metrics["tickets/reference_loss/loss"]["by_category"]["all"]
    assert loss["values"]["base"] > 8 > loss["values"]["candidate"]  # random init: ~ln(4096) = 8.3
    assert loss["delta"]["candidate"] == pytest.approx(loss["values"]["candidate"] - loss["values"]["base"])
    assert metrics["refusal/refusal/accuracy"]["by_category"]["all"]["values"] == {"base": 0.75, "candidate": 0.75}
    assert [(f["set"], f["field"]) for f in card["fields"]][:3] == [
        ("tickets", "product"), ("tickets", "severity"), ("tickets", "next_action")]
    ops = card["operations"]["candidate"]
    assert ops["requests"] == 2 + 4 + 4 + 2 == len(ops["latency_s"]) and ops["p50_s"] <= ops["p95_s"]
    assert ops["peak_memory_gib"] is None or 0.1 < ops["peak_memory_gib"] < 64
    # Every evaluated row is an example, with each model's output, verdict and reasons.
    assert len(card["examples"]) == 12
    tool_row = next(e for e in card["examples"] if e["set"] == "tools" and e["category"] == "tool_call")
    assert tool_row["reference"] and tool_row["outputs"]["candidate"]["failures"]
    assert tool_row["outputs"]["candidate"]["passed"] is False
    # The eval directory: the exact rows (hashed in the scorecard), the suite's bytes, both reports.
    for s in card["suite"]["sets"]:
        assert hashlib.sha256((out / "sets" / f"{s['name']}.jsonl").read_bytes()).hexdigest() == s["sha256"]
    assert card["suite"]["sets"][0]["source"] == "run:validation"
    suite_file = Path(card["suite"]["path"])
    assert (out / "suite.yaml").read_bytes() == suite_file.read_bytes()
    assert hashlib.sha256(suite_file.read_bytes()).hexdigest() == card["suite"]["sha256"]
    assert "<svg" in (out / "scorecard.html").read_text()
    assert "## Failures of candidate" in (out / "scorecard.md").read_text()
    assert "PASS p95 latency" in printed and f"report: {out / 'scorecard.html'}" in printed


@pytest.mark.parametrize("variant", range(6))
def test_a_planted_regression_fails_exactly_its_gate(variant, baseline, sft_run, suite_dir):
    suites = [_suite(), _suite(ticket_limit=3), _suite(tools_rows=2), _suite(markers=['"product"']),
              _suite(loss_budget=-0.5), _suite(latency=1e-4)]
    base = sft_run / "hf" if variant == 0 else sft_run  # the trained model as its own base: no improvement
    code, card, _, printed = _eval(suite_dir, f"variant{variant}", suites[variant], base, sft_run)
    assert code == 1, printed
    failed = [g["name"] for g in card["gates"] if not g["passed"]]
    assert failed == [GATES[variant]], [g["message"] for g in card["gates"]]
    assert f"FAIL {GATES[variant]}" in printed and not card["passed"]


def test_user_errors_exit_2_before_any_model_runs(baseline, sft_run, suite_dir, tmp_path):
    suite = suite_dir / "baseline.yaml"
    taken = suite_dir / "out" / "baseline"  # the baseline's output: refused without --overwrite
    cases = [
        (sft_run, ["--out", str(taken)], f"--out {taken} already exists and is not empty; pass --overwrite"),
        (sft_run, ["--out", str(sft_run / "hf" / "x")], "is inside candidate weights"),
        (sft_run, ["--merged"], "--merged: the candidate"),
        (sft_run / "hf", [], "run_split: validation reads the candidate run directory's held-out split"),
    ]
    for candidate, extra, message in cases:
        argv = ["eval", str(suite), "--base", str(sft_run), "--candidate", str(candidate), *extra]
        code, _, err = _main(argv if "--out" in extra else argv + ["--out", str(tmp_path / "o")])
        assert code == 2 and message in err, err
    other = shutil.copytree(sft_run / "base", tmp_path / "other_base")
    (other / "chat_template.jinja").write_text("{{ messages }}")
    code, _, err = _main(["eval", str(suite), "--base", str(other), "--candidate", str(sft_run),
                          "--out", str(tmp_path / "o")])
    assert code == 2 and "use different chat templates (base" in err, err
    assert not (tmp_path / "o").exists()


def test_lora_candidate_merged_and_unmerged(shared_results, suite_dir):
    run_dir = shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir
    suite = _suite()
    suite["sets"] = suite["sets"][:2]
    suite["general_text"] = None
    suite["gates"] = [{"metric": "tools/tool_execution/success", "rule": "no_regression", "model": "candidate-merged"},
                      {"metric": "tickets/reference_loss/loss", "rule": "max_increase", "threshold": 0.01}]
    code, card, _, printed = _eval(suite_dir, "lora", suite, run_dir, run_dir, "--merged")
    assert code == 0, printed
    models = {m["label"]: m for m in card["models"]}
    assert list(models) == ["base", "candidate", "candidate-merged"]
    assert (models["candidate"]["merged"], models["candidate-merged"]["merged"]) == (False, True)
    adapter = models["candidate"]["fingerprint"]
    assert adapter["path"] == str(run_dir / "adapter") and adapter["base"]["path"] == str(run_dir / "base")
    assert adapter["base"]["weights_sha256"] == models["base"]["fingerprint"]["weights_sha256"]
    assert [(g["model"], g["passed"]) for g in card["gates"]] == [
        ("candidate-merged", True), ("candidate", True), ("candidate-merged", True)]
    loss = {m["id"]: m for m in card["metrics"]}["tickets/reference_loss/loss"]["by_category"]["all"]["values"]
    assert loss["candidate"] == pytest.approx(loss["candidate-merged"], abs=1e-4)
