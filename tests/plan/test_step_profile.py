"""`glmtune plan --measure --profile DIR`: the timed steps under torch.profiler, written as a
kernel table, a summary by stream and kind of work, and a Chrome trace (glmtune/plan/step_profile.py)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from torch.profiler import record_function

from glmtune.cli import main
from glmtune.distributed.link_emulator import LANE_RANGE
from glmtune.models.common.rmsnorm import RMSNorm
from glmtune.plan.profile_sources import sources, sources_table, tree_frames
from glmtune.plan.step_profile import timed_events, kind_of, profiled

SHORT = ["--train.max_steps", "5"]
MEASURE = ["plan", "tiny/sft_support_json", "--measure", "--gpus", "2", "--rank", "1", "--steps", "1",
           "--warmup-steps", "1", "--json", *SHORT]


def test_the_timed_steps_are_profiled_into_a_new_directory(tmp_path, capsys):
    out = tmp_path / "profile"
    assert main([*MEASURE, "--profile", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rank"] == 1 and "wrote the timed steps' profile" in captured.err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "rank1_kernels.txt", "rank1_sources.txt", "rank1_summary.json", "rank1_trace.json"]
    kernels = (out / "rank1_kernels.txt").read_text()
    assert "aten::mm" in kernels and "<built-in" not in kernels and ".py(" not in kernels  # operators, no frames
    assert "glmtune/models/glm5/attention.py(" in (out / "rank1_sources.txt").read_text()
    summary = json.loads((out / "rank1_summary.json").read_text())
    assert summary["steps"] == 1 and summary["compute_stream"] == "cpu"
    kinds = summary["kinds"]
    assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0)
    assert kinds["gemm"]["share"] > 0 and kinds["attention"]["share"] > 0
    # the kinds' seconds are the busiest stream's, per step
    assert sum(k["seconds_per_step"] for k in kinds.values()) == pytest.approx(summary["streams"]["cpu"])
    assert json.loads((out / "rank1_trace.json").read_text())["traceEvents"]
    # the heaviest sources: the same seconds charged to lines, every phase a step has without checkpointing
    rows = summary["sources"]
    assert len(rows) == 25 and rows == sorted(rows, key=lambda r: -r["seconds_per_step"])
    assert {"forward", "backward"} <= {r["phase"] for r in rows}


def test_modules_imported_inside_a_profile_keep_their_frames_names(tmp_path, monkeypatch):
    """A module imported inside the profile has run its body's code object and freed it before the
    results are parsed; torch's profiler would read the frame's name through a dangling pointer
    (pytorch#64345; on this CPU a cold profiled step failed so, twice in two runs). The code objects
    `exec` runs are kept until the profile is dropped, and every name parses."""
    for i in range(20):
        (tmp_path / f"fresh_module_{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\nVALUE = f{i}(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with profiled(torch.device("cpu")) as prof:
        for i in range(20):
            importlib.import_module(f"fresh_module_{i}")
            monkeypatch.delitem(sys.modules, f"fresh_module_{i}")
    junk = [bytes([0xC0]) * 64 for _ in range(100_000)]  # what reuses freed memory would write there
    kept = {code.co_filename for code in prof.glmtune_kept_code}
    assert {str(tmp_path / f"fresh_module_{i}.py") for i in range(20)} <= kept
    names = [event.name for event in prof.events()]
    assert any("fresh_module_3.py(" in name for name in names) and junk


@pytest.mark.parametrize(("argv", "message"), [
    (["--profile", "x"], "--profile is an option of --measure"),
])
def test_profile_needs_measure(argv, message, capsys):
    assert main(["plan", "tiny/sft_support_json", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_directory_the_command_did_not_write_is_refused_before_the_rank_is_built(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main([*MEASURE, "--profile", str(mine)]) == 2
    captured = capsys.readouterr()
    assert "--profile" in captured.err and "measuring rank" not in captured.err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(("name", "kind"), [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
     "gemm"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm"),
    ("_sparse_mla_dq_kernel", "attention"),  # the fused sparse MLA (absorbed_triton)
    ("_sparse_attention_dkv_kernel", "attention"),
    ("aten::mm", "gemm"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}", "copy, gather, concat"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>",
     "copy, gather, concat"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>", 
     "elementwise and other"),
])
def test_kernel_names_fall_in_their_kind(name, kind):
    assert kind_of(name) == kind


def test_a_marked_range_is_not_counted_beside_the_work_inside_it():
    """record_function ranges (the pipeline schedule's "PP:..." ones appear on the GPU's timeline as well)
    cover kernels that are counted themselves: on one H200 they doubled 0.7 s of a 5 s step."""
    a = torch.randn(64, 64)
    with profiled(torch.device("cpu")) as prof:
        with record_function("PP:marked"):
            for _ in range(20):
                a = torch.mm(a, a).tanh()
    names = [name for name, _, _ in timed_events(prof, on_device=False)]
    assert "aten::mm" in names and "PP:marked" not in names


def test_each_operators_time_is_charged_to_its_line_and_phase():
    """A glmtune module under activation checkpointing, then an optimizer step: its operators' time is
    charged to the line that called them in the forward and in the recomputation; the backward's to
    that forward line through the autograd node's sequence number, the node named; AdamW's to the
    optimizer; and the rows add up to the operators' own time. The Python frames read from the
    profiler's event tree (where a torch 2.11 profile has them) give the same rows as the events' own."""
    norm = RMSNorm(256)
    x = torch.randn(512, 256, requires_grad=True)
    optimizer = torch.optim.AdamW(norm.parameters(), foreach=False)
    with profiled(torch.device("cpu")) as prof:
        torch.utils.checkpoint.checkpoint(norm, x, use_reentrant=False).sum().backward()
        optimizer.step()
    rows = sources(prof, on_device=False, stream="cpu", steps=1)
    line = next(r["site"] for r in rows if r["phase"] == "forward" and "rmsnorm.py" in r["site"])
    assert line.startswith("glmtune/models/common/rmsnorm.py(") and line.endswith("): forward")
    assert any(r["phase"] == "recompute" and r["site"] == line for r in rows)
    backward = [r for r in rows if r["phase"] == "backward" and r["site"].startswith(line + " [")]
    assert backward and all(r["site"].endswith("Backward0]") or r["site"].endswith("Backward1]") for r in backward)
    assert any(r["phase"] == "optimizer" for r in rows)
    assert sum(r["seconds_per_step"] for r in rows) == pytest.approx(
        sum(micros for _, _, micros in timed_events(prof, on_device=False)) / 1e6)
    assert sources_table(rows).splitlines()[1].split()[0] == f"{rows[0]['seconds_per_step']:.4f}"
    assert sources(prof, on_device=False, stream="cpu", steps=1, frames=tree_frames(prof)) == rows


@pytest.mark.parametrize(("frame", "site"), [
    ("glmtune/models/glm5/moe.py(47): hidden", "glmtune/models/glm5/moe.py(47): hidden"),  # a path sys.path trimmed
    ("/home/u/glmtune/glmtune/models/x.py(3): f", "glmtune/models/x.py(3): f"),  # a checkout named glmtune
    ("/usr/lib/python3/site-packages/glmtune/plan/a.py(9): g", "glmtune/plan/a.py(9): g"),
    ("/home/u/glmtune/.venv/lib/python3.11/site-packages/torch/nn/x.py(3): f", None),  # torch, in the checkout's venv
    ("torch/utils/checkpoint.py(1657): recompute_fn", None),
    ("<built-in method matmul of type object at 0x7f>", None),
])
def test_a_site_is_glmtunes_own_frame(frame, site):
    from glmtune.plan.profile_sources import _glmtune_frame

    assert _glmtune_frame(frame) == site


def test_an_attribution_that_fails_leaves_the_other_tables_and_says_why(tmp_path, capsys, monkeypatch):
    import glmtune.plan.step_profile as step_profile

    def broken(*args, **kwargs):
        raise RuntimeError("no correlation ids")

    monkeypatch.setattr(step_profile, "sources", broken)
    out = tmp_path / "profile"
    assert main([*MEASURE, "--profile", str(out)]) == 0
    summary = json.loads((out / "rank1_summary.json").read_text())
    assert summary["sources_error"] == "RuntimeError: no correlation ids" and "sources" not in summary
    assert (out / "rank1_sources.txt").read_text() == "not attributed: RuntimeError: no correlation ids\n"
    assert "aten::mm" in (out / "rank1_kernels.txt").read_text()


def test_a_profile_that_cannot_be_written_does_not_cost_the_measurement(tmp_path, capsys, monkeypatch):
    import glmtune.plan.measure as measure

    def broken(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xc0", 0, 1, "invalid start byte")

    monkeypatch.setattr(measure, "write_profile", broken)
    assert main([*MEASURE, "--profile", str(tmp_path / "profile")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rank"] == 1  # the report came
    assert "the timed steps' profile could not be written: UnicodeDecodeError" in captured.err
    assert "wrote the timed steps' profile" not in captured.err


@pytest.mark.parametrize(("argv", "message"), [
    (["--profile-phase", "timed"], "--profile-phase is an option of --measure"),
    (["--measure", "--profile-phase", "timed"], "--profile-phase chooses the steps --profile records; add --profile"),
    (["--measure", "--profile", "p", "--profile-phase", "emulated"], "add --emulate-links"),
])
def test_the_profiled_phase_needs_its_profile_and_its_links(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "tiny/sft_support_json", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "measuring rank" not in err and not (tmp_path / "p").exists()


def test_the_emulated_steps_are_profiled_when_asked(tmp_path, capsys, monkeypatch):
    """--profile-phase emulated: the profiler is open over the emulated steps and over nothing else."""
    import glmtune.plan.measure as measure

    seen = []
    one_step = measure._one_step

    def recorded(*args, **kwargs):
        seen.append((args[5], torch.autograd.profiler._is_profiler_enabled))
        return one_step(*args, **kwargs)

    monkeypatch.setattr(measure, "_one_step", recorded)
    out = tmp_path / "profile"
    assert main([*MEASURE, "--emulate-links", "--profile", str(out), "--profile-phase", "emulated"]) == 0
    assert seen == [("warm-up", False), ("timed", False), ("emulated", True)]
    captured = capsys.readouterr()
    assert "wrote the emulated steps' profile" in captured.err
    assert json.loads((out / "rank1_summary.json").read_text())["steps"] == 1
    # no Python stacks there, so no sources table: it says why
    assert "without Python stacks" in (out / "rank1_sources.txt").read_text()
    assert "aten::mm" in (out / "rank1_kernels.txt").read_text()
    # each collective's hold is a range named by its lane, which the report names by its mesh axes
    trace = json.loads((out / "rank1_trace.json").read_text())["traceEvents"]
    lanes = json.loads(captured.out)["emulated"]["lane_seconds"]
    assert {e["name"] for e in trace if e.get("name", "").startswith(LANE_RANGE)} == {LANE_RANGE + n for n in lanes}
    assert list(lanes) == ["efsdp+dp_shard+dp+loss"]  # the one group the tiny recipe's two ranks share
