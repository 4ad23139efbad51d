"""DPO with LoRA against SFT with LoRA on the GLM-5 proxy: the same rows, the same adapters, one run.

Each row packs preference pairs (`--docs` documents: 2i chosen, 2i + 1 rejected, as
`glmtune/data/packing.py` packs them). Both sides start from the same bf16 base and the same fresh
LoRA adapters (each side builds its model anew), read the same token batches and run torch's fused AdamW over the fp32 adapters:

  sft  the next-token loss over every token after each document's first (the fused loss);
  dpo  glmtune's preference objective (`glmtune/train/preference.py`): a no_grad forward with the
       adapters switched off (the reference), then the policy's forward with per-token
       log-probabilities summed per document, the sigmoid loss per pair, and backward.

Reported per side: seconds per step, tokens/s (all tokens of the rows: a pair's tokens count
once), peak memory; then dpo / sft. The reference forward costs about one forward of the three
(forward + backward ~ 3 forwards) a step already has, so expect ~1.3x the SFT step; the
per-token log-probability head runs over the same supervised rows as the fused loss.

  python benchmarks/preference_step.py --seq 4096 --docs 8 --compile           # one H200
  python benchmarks/preference_step.py --tiny --seq 256 --docs 4 --steps 2 --warmup 1   # CPU smoke
"""

from __future__ import annotations

import sys

import torch

from benchmarks.lora_bench import peft_config
from benchmarks.throughput import build_glmtune, glmtune_step, init_weights, make_batches, parse_args, proxy_config
from benchmarks.timing import DEVICE, emit, free_memory, loss_step, time_training
from glmtune.config import DpoConfig
from glmtune.models.glm5.parallelize import parallelize_glm5
from glmtune.models.glm5.spec import GLM5
from glmtune.peft import apply_lora
from glmtune.train.data_loader import collate
from glmtune.train.preference import PreferenceObjective, documents_per_row, pair_counts

LR = 1e-4


def pair_rows(ids_R_B_S: torch.Tensor, lengths: list[int]) -> list[dict]:
    """The batches as packed preference rows: documents of `lengths`, each one's first label -100."""
    document_ids = [d for d, n in enumerate(lengths) for _ in range(n)]
    positions = [i for n in lengths for i in range(n)]
    starts = {sum(lengths[:d]) for d in range(len(lengths))}
    batches = []
    for step_ids in ids_R_B_S:
        rows = []
        for ids in step_ids.tolist():
            labels = [-100 if i in starts else t for i, t in enumerate(ids)]
            rows.append({"input_ids": ids, "labels": labels, "position_ids": positions, "document_ids": document_ids})
        batch = collate(rows)
        batch.update(documents_per_row(batch))
        batch["step_totals"] = pair_counts(batch)
        batches.append(batch)
    return batches


def dpo_step(model, opt, batches):
    objective = PreferenceObjective(GLM5.compute.token_logps, DpoConfig(), lora=True)
    return loss_step(model, opt, batches, objective.loss)


def run(side: str, cfg, state, a, raw, batches) -> dict:
    model = build_glmtune(cfg, state, a, torch.bfloat16)
    apply_lora(model, peft_config(a), seed=0)
    parallelize_glm5(model, activation_checkpointing=a.ckpt_mode if a.ckpt else "none", compile=a.compile,
                     ac_keep_matmul_min_k=a.ac_min_k)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=DEVICE == "cuda")
    step = glmtune_step(model, opt, raw, a) if side == "sft" else dpo_step(model, opt, batches)
    try:
        seconds, losses, peak = time_training(step, a)
    finally:
        model = opt = step = None
        free_memory()
    tokens = a.batch * a.seq
    return {"side": side, "seq": a.seq, "docs": a.docs, "compile": a.compile, "ckpt": a.ckpt,
            "step_s": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1), "peak_gib": round(peak, 2),
            "losses": [round(x, 5) for x in losses]}


def main(argv=None) -> int:
    a = parse_args(argv)
    assert a.docs % 2 == 0, "--docs must be even: each pair is two documents"
    cfg = proxy_config(a)
    state = init_weights(cfg)
    ids, positions, lengths = make_batches(a, cfg.vocab_size)
    raw = (ids, positions, lengths)
    batches = pair_rows(ids, lengths)
    sft = run("sft", cfg, state, a, raw, batches)
    dpo = run("dpo", cfg, state, a, raw, batches)
    ratio = {"dpo_over_sft_step": round(dpo["step_s"] / sft["step_s"], 3),
             "dpo_over_sft_peak": round(dpo["peak_gib"] / max(sft["peak_gib"], 1e-9), 3)}
    emit([sft, dpo, ratio], a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
