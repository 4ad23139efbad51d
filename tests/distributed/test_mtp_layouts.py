"""The MTP loss (`train.mtp_loss_weight`) at every layout, exported and resumed, against one process.

Three pipeline stages chained in one process (fp64; the later two start on shared-indexer layers,
rows longer than the top-k) give the model's own loss, MTP loss and acceptance and every gradient:
the next tokens' embeddings travel from the first stage through the middle one to the last, which
runs the MTP layer.

Full fine-tuning of the tiny recipe (fp32) with `--train.mtp_loss_weight 0.3`, two steps of four
rows of 512 tokens (above the tiny model's top-k of 256: the sparse selection runs, in the MTP
layer too) with validation at step 2: FSDP2 over 2 ranks, expert parallelism 2, pipeline
parallelism 2 (the MTP layer on the last stage; 1F1B, and ZBVZeroBubble's 4 stages, which glmtune
runs on torch >= 2.13 only) and context parallelism 2 each give the one-process steps (loss,
gradient norm, MTP loss and acceptance, their validation values; relative 1e-5; measured: 2e-7 at
most) and export the same MTP layer. The one-process export holds the
trained MTP layer (the last checkpoint's, not the base's), which transformers still loads; a run
stopped after step 1 and resumed gives the uninterrupted step 2 bit for bit. Every layout reads the
same four rows per step (data-parallel ranks two each; validation: one batch per data-parallel
rank, two in one process: the same four rows). The runs are `glmtune train` through the CLI's entry point
in processes forked with torch and glmtune imported (tests/distributed/forked_runs.py): the one-process
run in a process of its own, the layouts one after another on the same two gloo ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GlmMoeDsaForCausalLM

from glmtune import load_pretrained
from glmtune.checkpoint.manager import CheckpointManager
from glmtune.models.common.aux_loss import AuxiliaryLosses, AuxiliaryScales
from glmtune.models.common.microbatch import MicroBatch, StageMicrobatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.stages import split_into_stages
from glmtune.config import load_config
from tests.distributed.forked_runs import one_torch_thread, shared_train_runs  # noqa: F401 (autouse: one torch thread)
from tests.distributed.layout_tolerances import assert_close_values, assert_same_updates
from tests.train.run_helpers import printed, run_in_fork

WEIGHT = 0.3
STEPS = ["--train.mtp_loss_weight", str(WEIGHT), "--data.synthetic.rows", "480", "--data.packed_sequence_size",
         "512", "--train.max_steps", "2", "--checkpoint.every_steps", "1", "--train.val_every", "2",
         "--train.val_steps", "2", "--checkpoint.export_hf", "true"]
DATA_PARALLEL = ["--train.val_steps", "1"]  # one validation batch per rank: the one-process run's two
LAYOUTS = {
    "fsdp2": DATA_PARALLEL,
    "ep2": ["--parallel.ep", "2", *DATA_PARALLEL],
    "pp2": ["--parallel.pp", "2"],
    # 4 stages on 2 ranks: stages in between pass the embeddings on; split backward; first and last on rank 0
    "pp2-zbv": ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_stages_per_rank", "2"],
    "cp2": ["--parallel.cp", "2"],
}
DESCRIBED = {"fsdp2": "dp_shard 2", "ep2": "ep 2", "pp2": "pipeline: 2 stages", "pp2-zbv": "pipeline: 4 stages",
             "cp2": "cp 2"}
COMPARED = ("loss", "grad_norm", "mtp_loss", "mtp_acceptance", "mtp_tokens", "supervised_tokens")
VALIDATION = ("val_loss", "val_mtp_loss", "val_mtp_acceptance")
MTP_LAYER = "model.layers.4."  # on disk the MTP layer follows the tiny model's 4 decoder layers
LR = load_config("tiny/sft_support_json").optim.lr




@pytest.fixture(scope="module")
def single(shared_results):
    """The one-process run (one forked process, no process group: tests/distributed/forked_runs.py)."""
    return shared_train_runs(shared_results, {"single": STEPS})["single"]


@pytest.fixture(scope="module")
def layouts(shared_results):
    """Every layout's run, one after another on the same 2 gloo ranks (their imports paid once)."""
    return shared_train_runs(shared_results, {layout: [*STEPS, *flags] for layout, flags in LAYOUTS.items()},
                             nproc=2)


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _two_rows(seq: int) -> dict[str, torch.Tensor]:
    """Two rows of `seq` tokens (the second two documents) with next-token and MTP targets."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4000, (2, seq), generator=generator)
    skipped = torch.rand(2, seq, generator=generator) > 0.8
    return {"ids": ids, "position_ids": torch.stack([torch.arange(seq), torch.cat([torch.arange(300),
                                                                                   torch.arange(seq - 300)])]),
            "document_ids": torch.stack([torch.zeros(seq, dtype=torch.long), (torch.arange(seq) >= 300).long()]),
            "targets": torch.roll(ids, -1, 1), "mtp_targets": torch.roll(ids, -2, 1).masked_fill(skipped, -100)}


def _tiny_fp64_with_mtp():
    model = build_model(get_preset("tiny"), torch.float64, attention_backend="eager", moe_backend="loop", seed=0)
    model.set_trainable_extras(mtp=True, indexer=False)
    return model


def test_chained_stages_compute_the_mtp_loss_and_gradients():
    rows = _two_rows(320)  # above the top-k (256): the sparse selection runs and is carried
    kwargs = {k: v for k, v in rows.items() if k != "ids"}
    num_mtp = int((rows["mtp_targets"] != -100).sum())
    aux = AuxiliaryScales(AuxiliaryLosses(mtp_weight=WEIGHT), mtp_targets=num_mtp)  # weight / num_mtp
    reference = _tiny_fp64_with_mtp()  # fp64: the order of the sums leaves no trace
    out = reference(rows["ids"], MicroBatch(rows["ids"], **kwargs, aux=aux), compute_logits=False)
    out.loss_sum.backward()

    model = _tiny_fp64_with_mtp()
    first, middle, last = split_into_stages(model, [1, 2, 1], [0, 1, 2], mtp=True)  # 1 and 3: shared indexers
    assert [stage.num_activations for stage in (first, middle, last)] == [2, 2, 2]
    assert any(name.startswith("mtp_layer.") for name, _ in last.named_parameters())
    assert not any(name.startswith("mtp") for stage in (first, middle) for name, _ in stage.named_parameters())
    mb = MicroBatch(rows["ids"], **kwargs, aux=aux).rows(slice(None))  # with its host facts
    for stage in (first, middle, last):
        stage.microbatches = [StageMicrobatch(mb)]
    carried = first(rows["ids"])  # hidden states, next tokens' embeddings, the selection
    assert [t.dtype for t in carried] == [torch.float64, torch.float64, torch.uint8, torch.uint8]
    loss = last(*middle(*carried))
    torch.testing.assert_close(loss, out.loss_sum.reshape(1), rtol=1e-12, atol=0)
    torch.testing.assert_close(last.statistics["mtp_loss"], torch.stack([out.mtp_loss_sum.float(),
                                                                         out.mtp_num_targets.float()]))
    torch.testing.assert_close(last.statistics["mtp_acceptance"], out.mtp_accepted)
    loss.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys() and "mtp.0.eh_proj.weight" in grads
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_one_process(layout, single, layouts):
    done = layouts[layout]
    assert DESCRIBED[layout] in " ".join(done.stdout.split())  # the console wraps long lines
    expected, actual = _records(single.run_dir), _records(done.run_dir)
    assert sorted(actual) == sorted(expected) == [1, 2]
    assert expected[2]["mtp_loss"] > 0 and expected[2]["val_mtp_loss"] > 0
    for step, want in expected.items():
        for key in (*COMPARED, *(VALIDATION if step == 2 else ())):
            assert_close_values(actual[step][key], want[key], key, (layout, step))
    exported = load_file(done.run_dir / "hf" / "model.safetensors")
    reference = load_file(single.run_dir / "hf" / "model.safetensors")
    base = load_file(single.run_dir / "base" / "model.safetensors")
    assert list(exported) == list(reference)
    mtp = [n for n in reference if n.startswith(MTP_LAYER)]
    trained = [n for n in mtp if not torch.equal(reference[n], base[n])]  # its indexer does not train here
    assert f"{MTP_LAYER}eh_proj.weight" in trained
    assert_same_updates(exported, reference, base, trained, LR, steps=2)  # the layout trained the same MTP layer
    assert all(torch.equal(exported[n], base[n]) for n in set(mtp) - set(trained))


def test_the_export_holds_the_trained_mtp_layer_and_transformers_loads_it(single):
    """The HF export's MTP layer is the last checkpoint's (step 2), moved from the base's."""
    run_dir = single.run_dir
    trained = load_pretrained(run_dir / "base", torch.float32, "cpu")
    trained.set_trainable_extras(mtp=True, indexer=False)  # as the run had them (the optimizer state's keys)
    checkpoints = CheckpointManager(run_dir / "checkpoints")
    assert checkpoints.latest().step == 2
    checkpoints.load(checkpoints.latest(), trained, torch.optim.AdamW(
        [p for p in trained.parameters() if p.requires_grad]))
    exported = load_pretrained(run_dir / "hf", torch.float32, "cpu")
    base = load_pretrained(run_dir / "base", torch.float32, "cpu")
    mtp = {n: p for n, p in trained.named_parameters() if n.startswith("mtp.")}
    assert mtp and dict(exported.named_parameters()).keys() == dict(trained.named_parameters()).keys()
    for name, param in exported.named_parameters():
        if name.startswith("mtp."):
            torch.testing.assert_close(param, mtp[name], rtol=0, atol=0, msg=name)
    moved = {n for n, p in base.named_parameters() if n.startswith("mtp.") and not torch.equal(p, mtp[n])}
    assert moved == {n for n, p in mtp.items() if p.requires_grad}  # every trained one (not the indexer)

    hf, info = GlmMoeDsaForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    dropped = info["unexpected_keys"]  # transformers drops the MTP layer (as its own stacked expert keys), only it
    assert dropped and all(key.startswith(MTP_LAYER) for key in dropped)
    assert f"{MTP_LAYER}eh_proj.weight" in dropped
    assert hf.config.num_nextn_predict_layers == 1


def test_a_run_stopped_after_step_1_resumes_bit_for_bit(single, tmp_path):
    stopped = tmp_path / "stopped"
    shutil.copytree(single.run_dir, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step-00000002")  # what a run stopped after step 1 left
    done = run_in_fork(stopped, single.cache_dir, *STEPS, "--checkpoint.resume", "auto")
    assert done.returncode == 0, done.stdout + done.stderr
    assert printed(done.stdout, "resumed from") and printed(done.stdout, "step-00000001")
    expected, actual = _records(single.run_dir), _records(stopped)
    assert sorted(actual) == [1, 2]
    for key in (*COMPARED, *VALIDATION):
        assert actual[2][key] == expected[2][key], key  # the same floats
