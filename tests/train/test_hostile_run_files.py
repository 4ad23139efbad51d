"""What a resumed run reads back of its own run directory, hostile: `metrics.jsonl` (rewritten on
resume to the checkpoint's step) and the settings that name files in it. A line that is not a
step record glmtune writes is one sentence naming the file and line, before anything is
rewritten or set aside; only a last line cut short by a kill is dropped. A model's output or a
reference nested thousands deep is not JSON to the samples table, never a RecursionError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from glmtune.config import load_config
from glmtune.config.validate import validate_config
from glmtune.train.metrics import MetricsWriter
from glmtune.train.samples import SampleResult
from tests.train.run_helpers import TWO_STEPS, run, shared_run
from tests.tree_snapshot import changes, snapshot

STEP = '{"step": %d, "loss": 1.5}'
DEEP = "[" * 100_000 + "]" * 100_000

LINES = {  # metrics.jsonl -> (line, what the sentence says)
    "garbage mid-file": ([STEP % 1, "not json", STEP % 2], 2, "not valid JSON"),
    "a list line": ([STEP % 1, "[1, 2]"], 2, "is a list, not an object"),
    "nested deep": ([STEP % 1, DEEP], 2, "JSON nested deeper than 64 levels"),
    "a string step": ([STEP % 1, '{"step": "2"}'], 2, "step is '2', not a step number"),
    "a boolean step": (['{"step": true}'], 1, "step is True, not a step number"),
    "a float step": (['{"step": 1.0}'], 1, "step is 1.0, not a step number"),
    "no step": ([STEP % 1, '{"loss": 1}'], 2, "step is None, not a step number"),
    "a negative step": (['{"step": -4}'], 1, "step is -4, not a step number"),
    "a line over 1 MiB": ([STEP % 1, '{"step": 2, "x": "' + "y" * (1 << 20) + '"}'], 2, "a line of more than"),
    "not UTF-8": ([STEP % 1, '{"step": 2, "note": "\udcff"}'], 2, "not valid JSON"),
}


def _write(path: Path, lines: list[str]) -> bytes:
    data = "".join(line + "\n" for line in lines).encode("utf-8", "surrogateescape")
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("case", list(LINES))
def test_a_hostile_metrics_line_is_refused_before_the_file_is_rewritten(tmp_path, case):
    lines, number, said = LINES[case]
    metrics = MetricsWriter(tmp_path, "metrics.jsonl", tensorboard=False)
    before = _write(metrics.path, lines)
    with pytest.raises(ValueError) as refused:
        metrics.truncate_after(2)
    message = str(refused.value)
    assert message.startswith(f"metrics file {metrics.path}:{number}: ") and said in message
    assert metrics.path.read_bytes() == before  # nothing lost


def test_resume_drops_later_steps_and_only_a_last_line_cut_by_a_kill(tmp_path):
    metrics = MetricsWriter(tmp_path, "metrics.jsonl", tensorboard=False)
    metrics.path.write_text("".join(STEP % s + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    metrics.truncate_after(2)
    assert metrics.path.read_text() == STEP % 1 + "\n" + STEP % 2 + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # rewritten in place of, no temporary left
    metrics.path.write_text("not json\n")  # a fresh run (step 0) reads nothing of the old file
    metrics.truncate_after(0)
    assert metrics.path.read_text() == ""


def test_a_metrics_file_outside_the_run_directory_is_refused():
    for path in ("../../metrics.jsonl", "/tmp/metrics.jsonl", "logs/../../m.jsonl"):
        cfg = load_config("tiny/sft_support_json", ["--logging.metrics_file", path])
        with pytest.raises(ValueError, match=r"logging.metrics_file .* must be a path inside the run directory"):
            validate_config(cfg, num_experts=8, num_layers=4, world_size=1)
    validate_config(load_config("tiny/sft_support_json", ["--logging.metrics_file", "logs/m.jsonl"]), 8, 4, 1)


@pytest.mark.parametrize("case", ["a list line", "a string step", "nested deep"])
def test_glmtune_train_resume_refuses_a_hostile_metrics_file_changing_nothing(shared_results, tmp_path, case):
    finished = shared_run(shared_results, *TWO_STEPS).run_dir.parent
    copy = Path(shutil.copytree(finished, tmp_path / "w"))
    metrics = copy / "run" / "metrics.jsonl"
    lines = LINES[case][0]
    _write(metrics, [json.dumps(json.loads(line)) for line in metrics.read_text().splitlines()[:1]] + lines[1:])
    before = snapshot(copy)
    result = run(copy / "run", copy / "cache", *TWO_STEPS, "--checkpoint.resume", "auto")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("glmtune train: error: ")]
    assert f"metrics file {metrics}:2: {LINES[case][2]}" in line, line
    # metrics.jsonl and the checkpoints as they were: only what every start rewrites before a resume has changed
    changed = {c[2:] for c in changes(before, snapshot(copy))}
    # (the preset's base is written again, the same weights, with its output record's new time)
    assert changed <= {"run/.glmtune.lock", "run/config.yaml", "run/data_manifest.json", "run/run.json",
                       "run/base/.glmtune-output.json"}, changed


@pytest.mark.parametrize("output", [DEEP, "{" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000])
def test_a_deeply_nested_output_is_no_json_to_the_samples_table(output):
    sample = SampleResult("prompt", '{"product": "x"}', output)
    assert not sample.valid_json and not sample.exact
    assert not SampleResult("prompt", DEEP, "{}").exact
