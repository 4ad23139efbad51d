"""`train.objective: distill` end to end on the tiny recipe (a 3-layer, 4-expert student) with a
teacher directory built in process (tests/train/distill_teacher.py): λ = 0 is SFT bit for bit, the
cross-entropy part of λ > 0 is SFT's loss, the KL part is logged and trains, a resumed run equals an
uninterrupted one, FSDP2, PP 2 and CP 2 over 2 gloo ranks equal one process, a LoRA student trains, and a student
with another tokenizer is refused before anything trains."""

import json

import pytest

from tests.distributed.layout_tolerances import LOSS_REL
from tests.train.distill_teacher import build_teacher_dir, distill_command, run_distill
from tests.train.run_helpers import command_in_fork, losses


def _distill(run_dir, cache, rows_file, *extra, nproc: int = 1):
    """`run_distill` of a run that must finish, on `nproc` forked processes (run_helpers.command_in_fork:
    torch and glmtune imported once; N gloo ranks as torchrun starts them)."""
    return command_in_fork(distill_command(run_dir, cache, rows_file, *extra), run_dir, nproc)


def _records(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return build_teacher_dir(root / "teacher"), root / "cache"


@pytest.fixture(scope="module")
def distilled(teacher, tmp_path_factory):
    """Four steps with λ = 1, T = 2, checkpoints after steps 2 and 4."""
    rows_file, cache = teacher
    run_dir = tmp_path_factory.mktemp("distilled")
    done = _distill(run_dir, cache, rows_file, "--distill.temperature", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def sft(teacher, tmp_path_factory):
    """The same recipe and rows as plain SFT (train.objective: sft)."""
    rows_file, cache = teacher
    run_dir = tmp_path_factory.mktemp("sft")
    done = _distill(run_dir, cache, rows_file, "--train.objective", "sft")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def test_weight_zero_is_sft_bit_for_bit(teacher, sft, tmp_path):
    rows_file, cache = teacher
    seq = _distill(tmp_path / "seq", cache, rows_file, "--distill.weight", "0")
    assert seq.returncode == 0, seq.stderr[-3000:]
    assert losses(tmp_path / "seq") == losses(sft)  # exact floats, every step
    assert "distill/kl" not in _records(tmp_path / "seq")[1]


def test_cross_entropy_part_is_sft_loss_and_kl_is_added(sft, distilled):
    first = _records(distilled)[1]
    # the same starting weights and rows: the cross-entropy part is SFT's loss of step 1
    assert first["distill/ce"] == pytest.approx(losses(sft)[1], rel=1e-6)
    for record in _records(distilled).values():
        assert record["distill/kl"] > 0
        assert record["loss"] == pytest.approx(record["distill/ce"] + record["distill/kl"], rel=1e-6)


def test_resume_equals_uninterrupted(teacher, distilled, tmp_path):
    rows_file, cache = teacher
    run_dir = tmp_path / "resumed"
    first = _distill(run_dir, cache, rows_file, "--distill.temperature", "2", "--train.max_steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _distill(run_dir, cache, rows_file, "--distill.temperature", "2", "--checkpoint.resume", "auto")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert losses(run_dir) == losses(distilled)  # steps 3 and 4 after the resume: the same floats


def test_other_tokenizer_with_kl_is_refused_in_one_line(teacher, tmp_path):
    rows_file, cache = teacher
    other = tmp_path / "teacher"
    other.mkdir()
    (other / "rows.jsonl").write_text(rows_file.read_text())
    manifest = json.loads((rows_file.parent / "manifest.json").read_text())
    manifest["settings"].update(tokenizer=str(other), tokenizer_sha256="f" * 64)  # another tokenizer's
    (other / "manifest.json").write_text(json.dumps(manifest))
    done = run_distill(tmp_path / "run", cache, other / "rows.jsonl")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    message = " ".join((done.stderr + done.stdout).split())
    assert "needs the teacher's tokenizer" in message and "set distill.weight: 0 for sequence-level" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_fsdp_two_ranks_equal_one_process(teacher, distilled, tmp_path):
    """FSDP2 over 2 gloo ranks (one micro-batch each) gives the one-process run's steps (two micro-batches)."""
    rows_file, cache = teacher
    run_dir = tmp_path / "fsdp"
    done = _distill(run_dir, cache, rows_file, "--distill.temperature", "2", nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "world 2 = dp_replicate 1 x dp_shard 2" in " ".join(done.stdout.split())
    got, want = _records(run_dir), _records(distilled)
    assert got.keys() == want.keys()
    for step in want:
        for key in ("loss", "distill/ce", "distill/kl", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=LOSS_REL), (step, key)


@pytest.mark.parametrize(("layout", "flags", "described"), [
    ("pp2", ["--parallel.pp", "2"], "pp 2"),  # the last stage adds the KL; its parts travel as statistics
    ("cp2", ["--parallel.cp", "2"], "cp 2"),  # each rank's queries' teacher positions, as its hidden states
])
def test_pipeline_and_context_parallel_ranks_equal_one_process(teacher, distilled, tmp_path, layout, flags,
                                                                described):
    rows_file, cache = teacher
    run_dir = tmp_path / layout
    done = _distill(run_dir, cache, rows_file, "--distill.temperature", "2", *flags, nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert described in " ".join(done.stdout.split())
    got, want = _records(run_dir), _records(distilled)
    assert got.keys() == want.keys()
    for step in want:
        for key in ("loss", "distill/ce", "distill/kl", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=LOSS_REL), (layout, step, key)


def test_lora_student_learns_from_the_teacher(teacher, tmp_path):
    """LoRA adapters take the KL's gradient (the head is frozen): the loss falls and both parts are logged,
    for the validation rows too (carved from the teacher's rows, their top-K with them)."""
    rows_file, cache = teacher
    done = _distill(tmp_path / "lora", cache, rows_file, "--peft.method", "lora", "--optim.lr", "1e-2",
                    "--data.split", "{train: 0.7, validation: 0.3}", "--train.val_every", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = _records(tmp_path / "lora")
    assert records[4]["loss"] < records[1]["loss"]
    assert all(r["distill/kl"] > 0 for r in records.values())
    for step in (2, 4):
        val = records[step]
        assert val["val_distill/kl"] > 0
        assert val["val_loss"] == pytest.approx(val["val_distill/ce"] + val["val_distill/kl"], rel=1e-6)
