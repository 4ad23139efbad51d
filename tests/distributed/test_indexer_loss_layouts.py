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
rank, two in one process). bf16 compute on fp32 master weights (FSDP2 in one process) runs the
warm-up, whose main parameters have no gradient.

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

from glmtune.distributed.context_parallel import apply_context_parallel
from glmtune.models.glm5 import build_model, get_preset
from tests.distributed.gloo_helpers import run_gloo
from tests.train.run_helpers import shared_run

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
COMPARED = ("loss", "grad_norm", "indexer_kl", "queries", "supervised_tokens")
VALIDATION = ("val_loss", "val_indexer_kl")


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_the_one_process_run_warms_up_then_trains_everything(shared_results):
    records = _records(shared_run(shared_results, *STEPS).run_dir)
    assert sorted(records) == [1, 2]
    assert records[1]["indexer_kl"] > 0 and records[2]["indexer_kl"] > 0
    # the warm-up's gradient is the indexers' alone (weight 0.01 over queries x layers): tiny
    assert records[1]["grad_norm"] < 1e-3 < records[2]["grad_norm"]


def test_fp32_master_weights_warm_up_with_main_gradients_absent(shared_results):
    """bf16 compute on fp32 masters (FSDP2 on a one-rank mesh): the warm-up step leaves every main
    parameter without a gradient, which FSDP2, the norm and AdamW skip; then everything trains."""
    done = shared_run(shared_results, *STEPS, "--model.dtype", "bfloat16")
    assert "fp32 master weights, bf16 compute" in " ".join(done.stdout.split())
    records = _records(done.run_dir)
    assert records[1]["grad_norm"] < 1e-3 < records[2]["grad_norm"] and records[2]["indexer_kl"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_one_process(layout, shared_results):
    single = shared_run(shared_results, *STEPS)
    done = shared_run(shared_results, *STEPS, *LAYOUTS[layout], nproc=2)
    assert DESCRIBED[layout] in " ".join(done.stdout.split())  # the console wraps long lines
    got, want = _records(done.run_dir), _records(single.run_dir)
    assert sorted(got) == sorted(want) == [1, 2]
    for step in (1, 2):
        for key in COMPARED + (VALIDATION if step == 2 else ()):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (layout, step, key)


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
    out = model(ids, position_ids=positions, document_ids=document_ids, compute_logits=False, targets=targets,
                indexer_kl=True, indexer_grad_scale=1.0, indexer_warmup=warmup)
    (out.loss_sum * 0).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if ".indexer." in name and p.grad is not None}
    return out.indexer_kl.detach(), grads


def _tiny_fp64():
    model = build_model(get_preset("tiny").replace(index_topk=64), torch.float64, attention_backend="eager",
                        moe_backend="loop", seed=0)
    model.set_trainable_extras(mtp=False, indexer=True)
    return model


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
