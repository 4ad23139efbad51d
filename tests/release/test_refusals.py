"""Every refusal of `glmtune release` is one line naming what is wrong, and nothing is written."""

from __future__ import annotations

import fcntl
import json
import shutil

import pytest

from glmtune.cli import main
from tests.release.eval_fixture import candidate_fingerprint, make_eval_dir

ENGINE = ["--engine", "vllm==0.11.0"]


def _refused(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("glmtune release: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_refused_inputs(sft_run, tmp_path, capsys):
    run, eval_dir = sft_run
    release = ["release", str(run), "--eval", str(eval_dir)]
    _refused(capsys, ["release", str(run), "--eval", str(tmp_path / "nope"), *ENGINE], "no such directory")
    _refused(capsys, ["release", str(run), *ENGINE], "--eval EVAL_DIR is required")
    _refused(capsys, release, "--engine is required")
    _refused(capsys, [*release, "--engine", "vllm"], "give its version")
    _refused(capsys, [*release, "--engine", "vllm==0.1", "--engine-version", "0.2"], "already names a version")
    _refused(capsys, [*release, *ENGINE, "--approval-note", "ok"], "--approval-note needs --approved-by")
    _refused(capsys, [*release, *ENGINE, "--json"], "--json applies to")
    _refused(capsys, [*release, *ENGINE, "--previous", str(eval_dir / "scorecard.json")], "not a glmtune release")
    _refused(capsys, ["release", "verify", str(tmp_path / "r.json"), "--eval", str(eval_dir)],
             "--eval applies to `glmtune release RUN_DIR`, not to `glmtune release verify`")
    _refused(capsys, ["release", "diff", str(tmp_path / "r.json")], "takes A.json B.json, got 1")
    _refused(capsys, ["release", str(run), str(run), "--eval", str(eval_dir), *ENGINE], "takes one run directory")
    # Never into an input, even with --overwrite.
    _refused(capsys, [*release, *ENGINE, "--out", str(run / "hf" / "release.json"), "--overwrite"],
             "is inside RUN_DIR artifact")
    _refused(capsys, [*release, *ENGINE, "--out", str(eval_dir / "scorecard.json"), "--overwrite"],
             "is inside EVAL_DIR")
    # A run that has not finished: no hf/ for a full fine-tune.
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished, ignore=shutil.ignore_patterns("hf"))
    _refused(capsys, ["release", str(unfinished), "--eval", str(eval_dir), *ENGINE], "has no hf/")
    # A run that is training now: glmtune train holds its lock.
    with open(run / ".glmtune.lock", "w") as lock:
        lock.write("glmtune train (pid 4242 on host-a)\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX)
        _refused(capsys, [*release, *ENGINE], f"RUN_DIR {run} is in use by glmtune train (pid 4242 on host-a)")
    assert not (run / "release.json").exists() and not (unfinished / "release.json").exists()

    # An existing release is replaced only with --overwrite.
    assert main([*release, *ENGINE]) == 0
    capsys.readouterr()
    before = (run / "release.json").read_bytes()
    _refused(capsys, [*release, *ENGINE], "already exists; pass --overwrite")
    assert (run / "release.json").read_bytes() == before
    assert main([*release, "--engine", "vllm==0.12.0", "--overwrite"]) == 0
    assert json.loads((run / "release.json").read_text())["engine"]["version"] == "0.12.0"


@pytest.mark.parametrize("trigger, needle", [
    ("tickets/task_success/exact=0.5", "not a rollback trigger; write METRIC[@CATEGORY] OP NUMBER"),
    ("tickets/task_success/exact < half", "not a rollback trigger"),
    ("tickets/task_success/exact>0.1", "is better higher, so a rollback trigger fires when it falls: use < or <="),
    ("p95_latency_s<0.1", "is better lower"),
    ("tickets/task_success/exacto<0.1", "unknown metric tickets/task_success/exacto"),
    ("tickets/task_success/exact@billing<0.1", "has no category 'billing' in the scorecard (it has all, tool_call)"),
    ("p95_latency_s@tool_call>3", "has no categories"),
    ("tickets/task_success/exact<0.5", "already holds for candidate 'candidate', which the eval measured at 0.4"),
])
def test_refused_rollback_triggers(sft_run, capsys, trigger, needle):
    run, eval_dir = sft_run
    _refused(capsys, ["release", str(run), "--eval", str(eval_dir), *ENGINE, "--rollback", trigger],
             f"--rollback {trigger!r}: ", needle)
    assert not (run / "release.json").exists()


def test_refused_duplicate_trigger_and_margin(sft_run, capsys):
    run, eval_dir = sft_run
    base = ["release", str(run), "--eval", str(eval_dir), *ENGINE]
    _refused(capsys, [*base, "--rollback", "p95_latency_s>2", "--rollback", "p95_latency_s>=3"],
             "already has a trigger ('p95_latency_s>2')")
    _refused(capsys, [*base, "--rollback-margin", "1.5"], "--rollback-margin 1.5: must be in [0, 1)")


def test_refused_failed_gates_unless_allowed(sft_run, tmp_path, capsys):
    run, _ = sft_run
    failed = make_eval_dir(tmp_path / "failed-eval", run, exact=0.0, critical=2.0)
    argv = ["release", str(run), "--eval", str(failed), *ENGINE]
    _refused(capsys, argv, "the eval failed its release gates: task success improves on the base",
             "zero critical format failures", "--allow-failed-gates releases anyway")
    assert main([*argv, "--allow-failed-gates"]) == 0
    out = capsys.readouterr().out
    assert "released with --allow-failed-gates" in out
    m = json.loads((run / "release.json").read_text())
    assert m["eval"]["passed"] is False and m["eval"]["allowed_failed_gates"] is True
    # A failed gate's bar is already crossed: its trigger sits on the candidate's value instead.
    assert {t["metric"]: t["expression"] for t in m["rollback"]["triggers"]}["tickets/format/critical_failures"] \
        == "tickets/format/critical_failures > 2.2"
    # Exact 0 is the worst a ratio can be: no trigger on it could fire without firing at once.
    assert m["rollback"]["untriggered"][0]["metric"] == "tickets/task_success/exact"
    assert "no trigger on tickets/task_success/exact@all (gate: task success improves on the base): candidate " \
           "'candidate''s 0 is already the worst value" in out


def test_refused_candidate_mismatch_and_edited_eval(sft_run, lora_source, tmp_path, capsys):
    run, eval_dir = sft_run
    # The eval scored another model (the LoRA run) as its candidate.
    other = make_eval_dir(tmp_path / "other-eval", run, candidate_source=lora_source,
                          fingerprint={"config_sha256": "ab" * 32, "weights_sha256": "cd" * 32})
    _refused(capsys, ["release", str(run), "--eval", str(other), *ENGINE],
             f"--eval {other} did not evaluate the run {run}",
             f"'candidate' ({lora_source}) has config_sha256 abababababab…")
    # The eval scored this run, but its checkpoint changed afterwards.
    weights = run / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    _refused(capsys, ["release", str(run), "--eval", str(eval_dir), *ENGINE],
             "has weights_sha256", "(the run changed after the eval)")
    # A scorecard whose set was edited after the eval ran.
    edited = make_eval_dir(tmp_path / "edited-eval", run)
    with open(edited / "sets" / "tickets.jsonl", "a") as fh:
        fh.write("{}\n")
    _refused(capsys, ["release", str(run), "--eval", str(edited), *ENGINE],
             "tickets.jsonl: sha256 differs from the set the scorecard names", "edited after the eval")
    assert not (run / "release.json").exists()


def test_adapter_evaluated_on_another_base_or_layout(lora_run, tmp_path, capsys):
    run, _ = lora_run
    other_base = candidate_fingerprint(run)
    other_base["base"]["weights_sha256"] = "ef" * 32
    wrong = make_eval_dir(tmp_path / "wrong-base-eval", run, fingerprint=other_base)
    _refused(capsys, ["release", str(run), "--eval", str(wrong), *ENGINE],
             "ran the adapter on a base with weights_sha256 efefefefefef…", "evaluate on the base that will serve")
    # The per-expert layout holds the same adapter: an eval of it stands for the release.
    per_expert = make_eval_dir(tmp_path / "per-expert-eval", run,
                               fingerprint=candidate_fingerprint(run, "adapter_per_expert"))
    assert main(["release", str(run), "--eval", str(per_expert), *ENGINE]) == 0
    assert json.loads((run / "release.json").read_text())["eval"]["evaluated_artifact"] == "adapter_per_expert"
