"""`glmtune plan --measure --profile DIR`: the timed steps under torch.profiler, written as a
kernel table, a summary by stream and kind of work, and a Chrome trace (glmtune/plan/step_profile.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import record_function

from glmtune.cli import main
from glmtune.plan.step_profile import timed_events, kind_of, profiled

SHORT = ["--train.max_steps", "5"]
MEASURE = ["plan", "tiny/sft_support_json", "--measure", "--gpus", "2", "--rank", "1", "--steps", "1",
           "--warmup-steps", "0", "--json", *SHORT]


def test_the_timed_steps_are_profiled_into_a_new_directory(tmp_path, capsys):
    out = tmp_path / "profile"
    assert main([*MEASURE, "--profile", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rank"] == 1 and "wrote the timed steps' profile" in captured.err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "rank1_kernels.txt", "rank1_summary.json", "rank1_trace.json"]
    assert "aten::mm" in (out / "rank1_kernels.txt").read_text()
    summary = json.loads((out / "rank1_summary.json").read_text())
    assert summary["steps"] == 1 and summary["compute_stream"] == "cpu"
    kinds = summary["kinds"]
    assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0)
    assert kinds["gemm"]["share"] > 0 and kinds["attention"]["share"] > 0
    # the kinds' seconds are the busiest stream's, per step
    assert sum(k["seconds_per_step"] for k in kinds.values()) == pytest.approx(summary["streams"]["cpu"])
    assert json.loads((out / "rank1_trace.json").read_text())["traceEvents"]


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
