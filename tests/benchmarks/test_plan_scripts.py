"""CPU smoke tests of the GPU benchmarks behind `glmtune plan` and the trainer's throughput:
they run end to end on narrow widths and write what docs/benchmarks.md reads."""

from __future__ import annotations

import json

from benchmarks import plan_check, rank_reports, trainer_throughput
from glmtune.cli import main as glmtune_main


def test_plan_check_runs_a_setup_and_counts_saved_tensors(tmp_path):
    out = tmp_path / "plan.jsonl"
    assert plan_check.main(["--tiny", "--in-process", "--setups", "256:none:none:full", "--steps", "1",
                            "--warmup", "1", "--out", str(out)]) == 0
    line = json.loads(out.read_text())
    assert line["setup"] == "256:none:none:full" and line["planned_peak_gib"] > 0
    assert set(line["saved_gib"]) >= {"layer 0", "layer 3"} and set(line["planned_saved_gib"]) == {
        f"layer {i}" for i in range(4)}


def test_trainer_throughput_reads_the_runs_windows(tmp_path):
    out = tmp_path / "trainer.jsonl"
    assert trainer_throughput.main(["--tiny", "--seq", "256", "--steps", "4", "--log-every", "2",
                                    "--skip-reference", "--out", str(out), "--work", str(tmp_path)]) == 0
    line = json.loads(out.read_text())
    assert line["impl"] == "glmtune train" and len(line["windows_tok_s"]) == 2 and line["steady_tok_s"] > 0
    assert line["packing"]["num_tokens"] == line["packing"]["num_rows"] * 256  # every row one truncated document


def test_rank_reports_prints_a_measured_rank_s_figures(tmp_path, capsys):
    argv = ["plan", "tiny/sft_support_json", "--measure", "--gpus", "2", "--steps", "1", "--warmup-steps", "0",
            "--emulate-links", "--json", "--data.packed_sequence_size", "128", "--train.generate_samples", "0",
            "--optim.warmup_steps", "0"]
    assert glmtune_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    (tmp_path / "tiny.json").write_text(json.dumps(report))
    (tmp_path / "cut.json").write_text("")  # a run its timeout stopped
    assert rank_reports.main([str(tmp_path)]) == 0
    cut, tiny = capsys.readouterr().out.splitlines()
    assert cut.startswith("cut.json | not a report")
    emulated = report["emulated"]
    for figure in (f"compute {report['time']['step_s']:.3f} s", f"exposed {emulated['exposed_comm_s']:.3f} s",
                   f"tokens/s per GPU {report['tokens_per_s_per_gpu']:.1f}", f"losses {report['time']['losses']}",
                   f"floor {emulated['floor_s']:.3f} s ({emulated['floor_bound']})"):
        assert figure in tiny, (figure, tiny)
    assert "dp_shard" in tiny.split("lanes ")[1]  # FSDP2's lane over the 2 ranks
