"""What the MTP loss and the indexer KL loss cost a training step, on the GLM-5 proxy, side by side.

The proxy (benchmarks/throughput.py: every GLM-5 width, fewer layers and experts) gets GLM-5's
one MTP layer (a MoE layer with its own indexer, and its glue: enorm, hnorm, eh_proj,
shared_head.norm; N(0, 0.02) like the rest). Each side builds the model anew from the same bf16
weights, reads the same token batches (one document per row) and trains every parameter it
trains with glmtune's AdamW:

  sft      the next-token loss (the MTP layer and the indexers frozen, as today's default);
  mtp      + the MTP loss (weight 0.3): one more MoE layer and a second head pass;
  indexer  + the indexers' KL loss (weight 0.01), the indexers trainable;
  both     both losses.

Reported per side: seconds per step, tokens/s, peak memory, and each side over `sft`. The
proxy has `--layers` decoder layers, so the MTP layer's share of the step is ~1 / (layers + 1)
here and ~1/79 of GLM-5's; the record carries the layer count so the two can be told apart.

  python benchmarks/auxiliary_losses.py --seq 4096 --compile                 # one H200
  python benchmarks/auxiliary_losses.py --seq 16384 --ckpt --compile
  python benchmarks/auxiliary_losses.py --tiny --seq 256 --steps 2 --warmup 1   # CPU smoke
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import build_glmtune, init_weights, make_batches, parse_args, proxy_config  # noqa: E402
from benchmarks.timing import DEVICE, emit, free_memory, loss_step, time_training  # noqa: E402
from glmtune.models.common.aux_loss import AuxiliaryLosses  # noqa: E402
from glmtune.models.glm5.parallelize import parallelize_glm5  # noqa: E402
from glmtune.models.glm5.spec import GLM5  # noqa: E402
from glmtune.train.data_loader import collate  # noqa: E402

SIDES = {"sft": AuxiliaryLosses(), "mtp": AuxiliaryLosses(mtp_weight=0.3),
         "indexer": AuxiliaryLosses(indexer_weight=0.01), "both": AuxiliaryLosses(mtp_weight=0.3, indexer_weight=0.01)}


def packed_batches(ids_R_B_S: torch.Tensor) -> list[dict]:
    """One collated batch per step: one document per row, every token after the first supervised."""
    batches = []
    for step_ids in ids_R_B_S:
        seq = step_ids.shape[1]
        rows = [{"input_ids": ids, "labels": [-100, *ids[1:]], "position_ids": list(range(seq)),
                 "document_ids": [0] * seq} for ids in step_ids.tolist()]
        batch = collate(rows)
        batch["step_totals"] = {"tokens": batch["num_supervised"], "mtp_tokens": batch["num_mtp_supervised"],
                                "queries": batch["input_ids"].numel()}
        batch["loss_grad_scale"] = 1.0 / batch["num_supervised"]
        batches.append(batch)
    return batches


def build(cfg, state, a, aux: AuxiliaryLosses):
    """The proxy with one MTP layer: the shared weights, the MTP layer's drawn from a fixed seed."""
    model = build_glmtune(cfg, state, a, torch.bfloat16, mtp_layers=1)
    GLM5.compute.set_auxiliary_training(model, mtp=aux.mtp_weight > 0, indexer=aux.indexer_weight > 0)
    parallelize_glm5(model, activation_checkpointing=a.ckpt_mode if a.ckpt else "none", compile=a.compile,
                     ac_keep_matmul_min_k=a.ac_min_k)
    return model


def train_step(model, opt, batches, aux: AuxiliaryLosses):
    return loss_step(model, opt, batches, functools.partial(GLM5.compute.loss, aux=aux))


def run(side: str, cfg, state, a, batches) -> dict:
    from glmtune.train.optim import TritonAdamW

    aux = SIDES[side]
    model = build(cfg, state, a, aux)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = TritonAdamW(trainable, lr=1e-5) if a.optimizer == "triton" else \
        torch.optim.AdamW(trainable, lr=1e-5, fused=DEVICE == "cuda")
    step = train_step(model, opt, batches, aux)
    try:
        seconds, losses, peak = time_training(step, a)
    finally:
        model = opt = step = None
        free_memory()
    return {"side": side, "seq": a.seq, "layers": a.layers, "compile": a.compile, "ckpt": a.ckpt,
            "step_s": round(seconds, 4), "tokens_per_s": round(a.batch * a.seq / seconds, 1),
            "peak_gib": round(peak, 2), "losses": [round(x, 5) for x in losses]}


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = proxy_config(a)
    state = init_weights(cfg)
    ids, _, _ = make_batches(a, cfg.vocab_size)
    batches = packed_batches(ids)
    results = {side: run(side, cfg, state, a, batches) for side in SIDES}
    base = results["sft"]
    ratios = {f"{side}_over_sft": {"step": round(r["step_s"] / base["step_s"], 3),
                                   "tokens_per_s": round(r["tokens_per_s"] / base["tokens_per_s"], 3),
                                   "peak": round(r["peak_gib"] / max(base["peak_gib"], 1e-9), 3)}
              for side, r in results.items() if side != "sft"}
    emit([*results.values(), {"seq": a.seq, "ckpt": a.ckpt, "layers": a.layers, **ratios}], a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
