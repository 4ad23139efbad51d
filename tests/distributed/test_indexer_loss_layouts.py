"""The indexer KL loss (`train.indexer_loss_weight`) under FSDP2, EP and CP, against one process.

Full fine-tuning of the tiny recipe (fp32) with `--model.indexer_trainable true
--train.indexer_loss_weight 0.01`, top-k 64 (`model.overrides.index_topk`) on rows of 512 tokens,
so every long document's later queries attend a real selection, and GLM-5.2's shared-indexer
layers train the indexer they reuse. Two steps of four rows: step 1 is the warm-up
(`train.indexer_warmup_steps 1`: dense attention, only the indexers train), step 2 sparse
training of everything, validation after it. FSDP2 over 2 ranks, expert parallelism 2 (over
the FSDP2-sharded ranks) and context parallelism 2 (the indexer keys gathered over the cp ranks
with their gradient, each rank's KL over its own queries) each give the one-process steps: loss,
gradient norm, indexer KL and its validation value to relative 1e-5. Every layout reads the
same four rows per step (data-parallel ranks two each; validation: one batch per data-parallel
rank, two in one process). bf16 compute on fp32 master weights (held by the optimizer) runs the
warm-up, whose main parameters have no gradient.

Pipeline parallelism runs sparse steps only (the warm-up is refused there: the stage outputs carry no
graph while the main model runs without gradients): two stages of [2, 2] layers (each starts on a
full-indexer layer) give the one-process sparse steps, with the indexer loss alone and with the MTP
loss too (`--train.mtp_loss_weight 0.3`: the MTP layer's indexer learns on the last stage), and
ZBVZeroBubble's four one-layer stages (every layer its own indexer: split backward); so does FSDP2
with both (measured: 6.2e-6 at most, pp2's val_indexer_kl, a KL of ~1.7e-4 nats); every layout
exports the same trained indexers. Two stages chained in one process (fp64) give the model's loss,
KL and every gradient.
The runs are `glmtune train` through the CLI's entry point in processes forked with torch and glmtune
imported (tests/distributed/forked_runs.py): the one-process runs one after another in a process of their
own (no process group), the layouts one after another on the same two gloo ranks.

Under context parallelism each rank's KL covers its own queries, over keys gathered from every rank with
their gradient: on gloo (fp64, packed rows whose documents cross the cp slices), the ranks' KL sums
and query counts add up to one process's, and so do their indexer gradients (the gather's backward
returns each key's gradient to its rank), in the warm-up (dense) and in sparse training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from glmtune.config import load_config
from glmtune.config.validate import auxiliary_loss_errors
from glmtune.distributed.context_parallel import apply_context_parallel
from glmtune.models.common.aux_loss import AuxiliaryLosses, AuxiliaryScales
from glmtune.models.common.microbatch import MicroBatch, StageMicrobatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.stages import split_into_stages
from tests.distributed.forked_runs import one_torch_thread, shared_train_runs  # noqa: F401 (autouse: one torch thread)
from tests.distributed.gloo_helpers import run_gloo
from tests.distributed.layout_tolerances import assert_close_values, assert_same_updates

STEPS = ["--model.indexer_trainable", "true", "--train.indexer_loss_weight", "0.01", "--train.indexer_warmup_steps",
         "1", "--model.overrides.index_topk", "64", "--data.synthetic.rows", "480", "--data.packed_sequence_size",
         "512", "--train.max_steps", "2", "--checkpoint.every_steps", "2", "--train.val_every", "2",
         "--train.val_steps", "2"]
DATA_PARALLEL = ["--train.val_steps", "1"]  # one validation batch per rank: the one-process run's two
LAYOUTS = {
    "fsdp2": DATA_PARALLEL,
    "ep2": ["--parallel.ep", "2", *DATA_PARALLEL],
    "cp2": ["--parallel.cp", "2"],
}
DESCRIBED = {"fsdp2": "dp_shard 2", "ep2": "ep 2", "cp2": "cp 2"}
LR = load_config("tiny/sft_support_json").optim.lr
COMPARED = ("loss", "grad_norm", "indexer_kl", "queries", "supervised_tokens")
VALIDATION = ("val_loss", "val_indexer_kl")
# Sparse steps only (no warm-up), for pipeline parallelism; with the MTP loss too.
SPARSE = [*STEPS[:4], *STEPS[6:], "--checkpoint.export_hf", "true"]
assert "--train.indexer_warmup_steps" in STEPS[4:6] and "--train.indexer_warmup_steps" not in SPARSE
WITH_MTP = [*SPARSE, "--train.mtp_loss_weight", "0.3"]
MTP_COMPARED = ("mtp_loss", "mtp_acceptance", "mtp_tokens")
MTP_VALIDATION = ("val_mtp_loss", "val_mtp_acceptance")
PIPELINE = ["--parallel.pp", "2", "--parallel.pp_layer_split", "[2,2]"]  # stages start on layers 0 and 2: full
# Four one-layer stages (every layer its own indexer) on 2 ranks: split backward, the KL's weight
# gradients in its second pass.
ALL_FULL = [*WITH_MTP, "--model.overrides.indexer_types", "[full,full,full,full]"]
ZBV = ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_stages_per_rank", "2"]
# Every one-process run (the layouts' references, by their steps, and bf16 on fp32 masters), one after
# another in one forked process with no process group (tests/distributed/forked_runs.py).
ONE_PROCESS = {"steps": STEPS, "bf16": [*STEPS, "--model.dtype", "bfloat16"], "sparse": SPARSE,
               "with_mtp": WITH_MTP, "all_full": ALL_FULL}
SPARSE_LAYOUTS = {  # name -> (the one-process run of its steps, layout flags, described, compared keys)
    "pp2": ("sparse", PIPELINE, "pipeline: 2 stages of 2/2 layers", ()),
    "pp2-mtp": ("with_mtp", PIPELINE, "pipeline: 2 stages of 2/2 layers", MTP_COMPARED),
    "pp2-zbv-mtp": ("all_full", ZBV, "pipeline: 4 stages of 1/1/1/1 layers", MTP_COMPARED),
    "fsdp2-mtp": ("with_mtp", DATA_PARALLEL, "dp_shard 2", MTP_COMPARED),
}




def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def one_process(shared_results):
    return shared_train_runs(shared_results, ONE_PROCESS)


@pytest.fixture(scope="module")
def layouts(shared_results):
    """Every layout's run (`LAYOUTS` on the warm-up steps, `SPARSE_LAYOUTS`), one after another on the
    same 2 gloo ranks: their imports paid once."""
    runs = {**{layout: [*STEPS, *flags] for layout, flags in LAYOUTS.items()},
            **{f"sparse-{layout}": [*ONE_PROCESS[single], *flags]
               for layout, (single, flags, _, _) in SPARSE_LAYOUTS.items()}}
    return shared_train_runs(shared_results, runs, nproc=2)


def test_the_one_process_run_warms_up_then_trains_everything(one_process):
    records = _records(one_process["steps"].run_dir)
    assert sorted(records) == [1, 2]
    assert records[1]["indexer_kl"] > 0 and records[2]["indexer_kl"] > 0
    # the warm-up's gradient is the indexers' alone (weight 0.01 over queries x layers): tiny
    assert records[1]["grad_norm"] < 1e-3 < records[2]["grad_norm"]


def test_fp32_master_weights_warm_up_with_main_gradients_absent(one_process):
    """bf16 compute on fp32 masters (held by the optimizer): the warm-up step leaves every main
    parameter without a gradient, which the norm and the optimizer skip; then everything trains."""
    done = one_process["bf16"]
    assert "bf16 parameters and compute, fp32 master weights in the optimizer" in " ".join(done.stdout.split())
    records = _records(done.run_dir)
    assert records[1]["grad_norm"] < 1e-3 < records[2]["grad_norm"] and records[2]["indexer_kl"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_one_process(layout, one_process, layouts):
    single, done = one_process["steps"], layouts[layout]
    assert DESCRIBED[layout] in " ".join(done.stdout.split())  # the console wraps long lines
    got, want = _records(done.run_dir), _records(single.run_dir)
    assert sorted(got) == sorted(want) == [1, 2]
    for step in (1, 2):
        for key in COMPARED + (VALIDATION if step == 2 else ()):
            assert_close_values(got[step][key], want[step][key], key, (layout, step))


@pytest.mark.parametrize("layout", list(SPARSE_LAYOUTS))
def test_sparse_layouts_match_one_process(layout, one_process, layouts):
    reference, _, described, extra = SPARSE_LAYOUTS[layout]
    single, done = one_process[reference], layouts[f"sparse-{layout}"]
    assert described in " ".join(done.stdout.split())  # the console wraps long lines
    got, want = _records(done.run_dir), _records(single.run_dir)
    assert sorted(got) == sorted(want) == [1, 2]
    assert want[1]["grad_norm"] > 1e-3 and want[2]["indexer_kl"] > 0  # no warm-up: everything trains
    validation = VALIDATION + (MTP_VALIDATION if extra else ())
    for step in (1, 2):
        for key in COMPARED + extra + (validation if step == 2 else ()):
            assert_close_values(got[step][key], want[step][key], key, (layout, step))
    exported = load_file(done.run_dir / "hf" / "model.safetensors")
    reference = load_file(single.run_dir / "hf" / "model.safetensors")
    base = load_file(single.run_dir / "base" / "model.safetensors")
    indexers = [name for name in reference if ".indexer." in name]
    assert len(indexers) >= 10 and list(exported) == list(reference)
    trained = [name for name in indexers if extra or not name.startswith("model.layers.4.")]  # 4: the MTP layer
    assert_same_updates(exported, reference, base, trained, LR, steps=2)  # the same indexers (the MTP layer's too)
    for name in set(indexers) - set(trained):  # the MTP layer's, untrained without its loss
        assert torch.equal(exported[name], reference[name]) and torch.equal(reference[name], base[name]), name


def test_the_warm_up_is_refused_under_pipeline_parallelism():
    def errors(*flags):
        return auxiliary_loss_errors(load_config("tiny/sft_support_json", [*STEPS[:8], *flags]))
    assert errors("--parallel.pp", "2", "--train.indexer_warmup_steps", "0") == []
    assert errors("--parallel.pp", "1") == []
    refused = errors("--parallel.pp", "2")
    assert len(refused) == 1 and "train.indexer_warmup_steps (1) with parallel.pp > 1" in refused[0]
    assert "carry no graph during the warm-up" in refused[0]


def _packed_rows():
    """Two rows of 512 tokens: documents of 300 + 212, and 40 + 280 + 192 (the last 20 padding)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4000, (2, 512), generator=generator)
    docs = [[300, 212], [40, 280, 172]]
    document_ids = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]
                                          + [torch.full((512 - sum(row),), -1)]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row] + [torch.arange(512 - sum(row))])
                             for row in docs])
    return ids, positions, document_ids


def _kl_and_indexer_grads(model, warmup: bool):
    """The model's indexer KL (sum, count) and its indexers' gradients: the KL alone is differentiated
    (the main loss with weight 0; it carries the warm-up's KL, which no layer output can)."""
    ids, positions, document_ids = _packed_rows()
    targets = torch.roll(ids, -1, 1)
    queries = int((document_ids >= 0).sum())
    layers = len(model.model.layers)
    # each layer's KL differentiated with factor 1: the weight is the queries x layers it divides by
    aux = AuxiliaryScales(AuxiliaryLosses(indexer_weight=float(queries * layers)), queries=queries, indexer_warmup=warmup)
    out = model(ids, MicroBatch(ids, positions, document_ids, targets, aux=aux), compute_logits=False)
    (out.loss_sum * 0).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if ".indexer." in name and p.grad is not None}
    return out.indexer_kl.detach(), grads


def _tiny_fp64(mtp: bool = False):
    model = build_model(get_preset("tiny").replace(index_topk=64), torch.float64, attention_backend="eager",
                        moe_backend="loop", seed=0)
    model.set_trainable_extras(mtp=mtp, indexer=True)
    return model


@pytest.mark.parametrize("mtp", [False, True])
def test_chained_stages_compute_the_kl_and_gradients(mtp):
    """Two stages [2, 2] in one process (fp64), with the MTP loss or not, against the model: the same loss,
    KL (sum, count) summed over the stages, and every gradient (the indexers', the MTP layer's included)."""
    ids, positions, document_ids = _packed_rows()
    rows = dict(position_ids=positions, document_ids=document_ids, targets=torch.roll(ids, -1, 1))
    num_mtp = None
    if mtp:
        rows["mtp_targets"] = torch.roll(ids, -2, 1)
        num_mtp = int((rows["mtp_targets"] != -100).sum())
    mtp_scale = 0.3 / num_mtp if mtp else None
    scale = 0.01 / (int((document_ids >= 0).sum()) * (5 if mtp else 4))  # queries x KL layers, as `Glm5Compute.loss`
    reference = _tiny_fp64(mtp)
    queries = int((document_ids >= 0).sum())  # the sizes `scale` and `mtp_scale` come from
    aux = AuxiliaryScales(AuxiliaryLosses(0.3 if mtp else 0.0, 0.01), mtp_targets=num_mtp, queries=queries)
    assert (aux.mtp_grad_scale(), aux.indexer_grad_scale(5 if mtp else 4)) == (mtp_scale, scale)
    reference = _tiny_fp64(mtp)
    out = reference(ids, MicroBatch(ids, **rows, aux=aux), compute_logits=False)
    out.loss_sum.backward()

    model = _tiny_fp64(mtp)
    stages = split_into_stages(model, [2, 2], [0, 1], mtp=mtp, indexer_kl=True)
    mb = MicroBatch(ids, **rows, aux=aux).rows(slice(None))  # with its host facts
    for stage in stages:
        stage.microbatches = [StageMicrobatch(mb)]
        assert "indexer_kl" in stage.statistic_names
    carried = stages[0](ids)
    loss = stages[1](*(carried if mtp else (carried,)))
    torch.testing.assert_close(loss, out.loss_sum.reshape(1), rtol=1e-12, atol=0)
    kl = stages[0].statistics["indexer_kl"] + stages[1].statistics["indexer_kl"]
    assert kl[1] == (5 if mtp else 4) * 1004  # queries x KL layers, as one process counts them
    torch.testing.assert_close(kl, out.indexer_kl, rtol=1e-12, atol=0)
    loss.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    assert "model.layers.2.self_attn.indexer.wk.weight" in grads
    assert mtp == ("mtp.0.self_attn.indexer.wk.weight" in grads)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-14, msg=name)


def _cp_kl_worker(rank: int, world_size: int, out_dir: str, warmup: bool) -> None:
    model = _tiny_fp64()
    apply_context_parallel(model, dist.group.WORLD, "head_tail")
    torch.save(_kl_and_indexer_grads(model, warmup), f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("warmup", [False, True])
def test_context_parallel_kl_and_indexer_gradients_add_up_to_one_process(warmup, tmp_path):
    want_kl, want = _kl_and_indexer_grads(_tiny_fp64(), warmup)
    run_gloo(_cp_kl_worker, 2, tmp_path, str(tmp_path), warmup)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(sum(kl for kl, _ in ranks), want_kl, rtol=1e-10, atol=0)
    assert want_kl[1] == 4 * 1004 and want_kl[0] > 0
    assert len(want) == 10 and all(grads.keys() == want.keys() for _, grads in ranks)  # layers 0 and 2
    for name, grad in want.items():
        assert grad.abs().max() > 0, name
        # the keys' gradients (wk, k_norm) pass the gather's backward, which sums the ranks' shares in fp32
        through_gather = ".wk." in name or ".k_norm." in name
        tolerance = dict(rtol=1e-5, atol=1e-8) if through_gather else dict(rtol=1e-9, atol=1e-15)
        torch.testing.assert_close(ranks[0][1][name] + ranks[1][1][name], grad, **tolerance, msg=name)
