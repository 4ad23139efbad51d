"""Issue 34: indexer recall on a tiny base whose attention concentrates (a "sharpened" random base).

Why: docs/benchmarks.md "2026-12-03 — MTP acceptance and indexer recall" measured recall on the
tiny preset's random-init base, whose attention is near uniform over a document's keys, so any
64 keys hold about 64/n of the mass (~50% on the eval's tickets) and no indexer can do better:
recall cannot move (50.75% -> 51.13%). We have no real GLM-5 weights. This script makes a base
whose attention is *peaked*, so that *which* keys the indexer picks matters, and measures how far
its selection is from the best one.

What the "sharpened" base is, honestly: the tiny preset's random base (same seed as the table's
runs: train.seed 1234, index_topk 64), with every attention layer's query up-projection
(`self_attn.q_b_proj`, MLA's q_b: both the nope and the rope slice; the MTP layer's too)
multiplied by FACTOR. Every attention logit q.k is then FACTOR x larger, so each head's softmax is
a sharper version of the same random preferences (temperature 1/FACTOR). It is *not* a trained
language model: what it attends to is random (content- and position-dependent, fixed), the LM
still predicts a near-uniform next token (loss ~8.3), and the indexers (their own wq_b / wk from
q_resid and the hidden state, untouched) are as random as before. It gives the indexer something
to find, nothing more. The weights are saved through the project's own HF export
(`Weights.save_pretrained`, the state-dict adapter), with the tiny tokenizer, and trained /
evaluated as any HF base (`--model.name_or_path DIR`).

Choosing FACTOR (`scan`, 2026-12-04): the preset's weights are initialized with a small std, so its
logits are ~0.01-0.1 and x4-x8 changes nothing (top-64 oracle 50.8% at x4); x64 gives an oracle of
79%, x128 96% (top-8 keys hold 60% of the head-mean mass; entropy 0.69 of log n), x256 99.8%. x128
is used. Note what sharpening does *not* do: a random indexer is uncorrelated with the (random)
attention, so the base's recall stays at k / allowed keys (50.8%) at every factor; sharpening
raises the *ceiling* (the oracle), i.e. how much a trained indexer can gain.

Subcommands:
  scan   --factors 1 2 4 8 ...   build the base in memory at each factor and probe it (pick FACTOR)
  build  --factor F --out DIR     write the sharpened base as an HF directory
  probe  --model DIR ...          concentration / recall / KL of HF directories (a base, a run's hf/)
  table  --row LABEL RUN EVAL     the markdown table from runs and their `glmtune eval` directories

`probe --run RUN_DIR` measures on exactly the rows `glmtune eval recipes/tiny/eval_support_json.yaml`
uses for its serving metrics (every chat set's reference conversation; tickets from the run's
validation split), one document per row, top-k = the checkpoint's index_topk, up to 256 sampled
queries per row with more allowed keys than top-k, main decoder layers (its recall equals the
eval's `operations/serving/indexer_recall`); without --run, on --rows generated tickets (seed 7):
  recall        glmtune's `indexer_recall` (attention mass, head-mean dense softmax, on the selection)
  oracle        the mass of the best top-k keys for that query (the ceiling any indexer could reach)
  uniform       k / allowed keys (what a uniform attention, or a random selection, gives on average)
  top8          the mass of the 8 heaviest keys (how peaked attention is)
  entropy       of the head-mean attention, in nats, and as a share of log(allowed keys)
  kl_sparse     the training KL (a micro-batch whose `aux` runs it, nats per query): over the selection
  kl_dense      the warm-up KL (`aux.indexer_warmup`): over every allowed key

Commands (from the repository root, CPU, one thread each; the training options are the
2026-12-03 table's, the model an HF directory instead of the preset):

  export OMP_NUM_THREADS=1 W=/tmp/recall34
  python -m benchmarks.indexer_recall_sharpened scan --factors 1 4 16 32 64 128 256 512 --rows 8
  python -m benchmarks.indexer_recall_sharpened build --factor 128 --out $W/sharp128
  C="--model.name_or_path $W/sharp128 --data.packed_sequence_size 1024 --train.global_batch_size 4 \\
     --train.micro_batch_size 2 --train.max_steps 80 --optim.warmup_steps 10 --train.val_every 40 \\
     --train.generate_samples 0"
  A="--train.mtp_loss_weight 0.3 --model.indexer_trainable true"
  glmtune train tiny/sft_support_json $C --logging.run_dir $W/s_plain
  glmtune train tiny/sft_support_json $C $A --train.indexer_loss_weight 0.01 --logging.run_dir $W/s_aux01
  glmtune train tiny/sft_support_json $C $A --train.indexer_loss_weight 0.1 --logging.run_dir $W/s_aux1
  glmtune train tiny/sft_support_json $C $A --train.indexer_loss_weight 0.1 --train.indexer_warmup_steps 20 \\
      --logging.run_dir $W/s_warm
  glmtune train tiny/sft_support_json $C $A --train.indexer_loss_weight 0.1 --train.indexer_warmup_steps 40 \\
      --train.max_steps 41 --logging.run_dir $W/s_warmdiag      # diagnostic: the warm-up alone
  for r in s_plain s_aux01 s_aux1 s_warm s_warmdiag; do    # the base is each run's model.name_or_path
    glmtune eval recipes/tiny/eval_support_json.yaml --base $W/$r --candidate $W/$r --out $W/e_$r; done
  python -m benchmarks.indexer_recall_sharpened probe --run $W/s_plain --model $W/sharp128 \\
      $W/s_plain/hf $W/s_aux01/hf $W/s_aux1/hf $W/s_warm/hf $W/s_warmdiag/hf
  python -m benchmarks.indexer_recall_sharpened table --base-label "sharpened base" --base-val 8.3262 \\
      --row "SFT" $W/s_plain $W/e_s_plain --row "SFT + MTP + KL 0.01" $W/s_aux01 $W/e_s_aux01   # ...

(`model.overrides` apply to presets only: index_topk 64 is in the sharpened base's config.json.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from glmtune import load_pretrained
from glmtune.config.loader import load_config
from glmtune.data.chat_template import load_chat_template, tokenize_conversation
from glmtune.data.synthetic import generate_rows
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.eval.answering import Prompting
from glmtune.eval.models import resolve_model
from glmtune.eval.serving import serving_batch
from glmtune.eval.sets import load_sets
from glmtune.eval.suite import load_suite
from glmtune.models.common.aux_loss import AuxiliaryLosses, AuxiliaryScales
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5.stages import decoder_layers
from glmtune.models.registry import spec_for
from glmtune.train.data_loader import collate
from glmtune.train.model_source import build_model_from_config, tokenizer_dir_for

RECIPE = "tiny/sft_support_json"
# The 2026-12-03 table's base: the tiny preset, index_topk 64, the recipe's seed (1234).
BASE_OVERRIDES = ["--model.overrides.index_topk", "64", "--data.packed_sequence_size", "1024"]
PROBE_SEED = 7  # held-out generated tickets (training generates seed 0)
QUERIES_PER_ROW = 256


def preset_base(factor: float) -> tuple[torch.nn.Module, object]:
    """The table's random tiny base with every attention's q_b_proj (MTP layer's included) x factor."""
    cfg = load_config(RECIPE, BASE_OVERRIDES)
    model, _ = build_model_from_config(cfg, "cpu")
    sharpen(model, factor)
    return model, cfg


@torch.no_grad()
def sharpen(model: torch.nn.Module, factor: float) -> int:
    layers = decoder_layers(model) + list(model.mtp)
    for layer in layers:
        layer.self_attn.q_b_proj.weight.mul_(factor)
    return len(layers)


def suite_rows(suite_path: str, run_dir: Path) -> list[dict]:
    """The rows `glmtune eval SUITE --candidate RUN_DIR` measures its serving metrics on: every chat
    set's reference conversation (tickets: the run's validation split), one document per batch."""
    suite = load_suite(suite_path)
    candidate = resolve_model(run_dir, "candidate")
    tokenizer_dir = candidate.weights_dir
    prompting = Prompting(load_tokenizer(tokenizer_dir), load_chat_template(tokenizer_dir),
                          suite.file.enable_thinking, suite.file.decoding)
    return [serving_batch(row, prompting) for s in load_sets(suite, candidate) if s.spec.row_kind == "chat"
            for row in s.rows]


def probe_rows(tokenizer_dir: Path, num_rows: int) -> list[dict]:
    """Held-out tickets, one conversation per row (`collate`d), as the eval's serving metrics see them."""
    tokenizer, template = load_tokenizer(tokenizer_dir), load_chat_template(tokenizer_dir)
    batches = []
    for row in generate_rows(num_rows, seed=PROBE_SEED):
        sample = tokenize_conversation(row["messages"], tokenizer, tools=row.get("tools"), template=template,
                                       enable_thinking=False)
        n = len(sample.input_ids)
        batches.append(collate([{"input_ids": sample.input_ids, "labels": sample.labels,
                                 "position_ids": list(range(n)), "document_ids": [0] * n}]))
    return batches


class ConcentrationProbe:
    """Forward hooks on the main decoder layers' attention: per sampled query, the dense head-mean
    attention and what the layer's selection, the best top-k and the top-8 keys hold of it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.topk = model.args.index_topk
        self.sums = dict(recall=0.0, oracle=0.0, uniform=0.0, top8=0.0, entropy=0.0, entropy_share=0.0)
        self.count = 0
        self.handles = [layer.self_attn.register_forward_hook(self._hook, with_kwargs=True)
                        for layer in decoder_layers(model)]

    def _hook(self, attention, args, kwargs, output) -> None:
        x_BSD, cos, sin, allowed_BST = args[:4]
        counts_S = allowed_BST[0].sum(-1)
        eligible = (counts_S > self.topk).nonzero().squeeze(1)
        if eligible.numel() == 0:
            return
        if eligible.numel() > QUERIES_PER_ROW:
            eligible = eligible[torch.linspace(0, eligible.numel() - 1, QUERIES_PER_ROW).long()]
        q_BNSK, _, latent_BSR, k_rot_B1SK = attention.project(x_BSD, cos, sin)
        k_BNTK, _ = attention.keys_and_values(latent_BSR, k_rot_B1SK)
        logits_NnT = torch.matmul(q_BNSK[0][:, eligible].double(), k_BNTK[0].double().transpose(-1, -2))
        allowed_nT = allowed_BST[0, eligible]
        logits_NnT = (logits_NnT * attention.scale).masked_fill(~allowed_nT, float("-inf"))
        probs_nT = logits_NnT.softmax(-1).mean(0)
        selected_nT = output[1][0][0, eligible]
        n_allowed = allowed_nT.sum(-1).double()
        logp = torch.where(probs_nT > 0, probs_nT.log(), torch.zeros_like(probs_nT))
        entropy_n = -(probs_nT * logp).sum(-1)
        s = self.sums
        s["recall"] += float((probs_nT * selected_nT).sum())
        s["oracle"] += float(probs_nT.topk(self.topk, -1).values.sum())
        s["uniform"] += float((self.topk / n_allowed).sum())
        s["top8"] += float(probs_nT.topk(8, -1).values.sum())
        s["entropy"] += float(entropy_n.sum())
        s["entropy_share"] += float((entropy_n / n_allowed.log()).sum())
        self.count += eligible.numel()

    def close(self) -> dict:
        for handle in self.handles:
            handle.remove()
        return {k: v / max(self.count, 1) for k, v in self.sums.items()} | {"queries": self.count}


def _kl_batch(batch: dict, warmup: bool = False) -> MicroBatch:
    """The rows with the indexers' KL reported (no step's queries: no gradient factor); `warmup`: dense."""
    reported = AuxiliaryScales(AuxiliaryLosses(indexer_weight=1.0), indexer_warmup=warmup)
    return MicroBatch(batch["input_ids"], batch["position_ids"], batch["document_ids"],
                      longest_document=batch["longest_document"], single_document=batch["single_document"], aux=reported)


@torch.no_grad()
def probe(model: torch.nn.Module, batches: list[dict]) -> dict:
    model.eval()
    concentration = ConcentrationProbe(model)
    kl = {"kl_sparse": [0.0, 0.0], "kl_dense": [0.0, 0.0]}
    try:
        for batch in batches:
            out = model(batch["input_ids"], _kl_batch(batch), compute_logits=False)  # the probe's hooks run here
            kl["kl_sparse"][0] += float(out.indexer_kl[0])
            kl["kl_sparse"][1] += float(out.indexer_kl[1])
    finally:
        result = concentration.close()
    for batch in batches:  # the warm-up's distribution: dense attention over every allowed key
        out = model(batch["input_ids"], _kl_batch(batch, warmup=True), compute_logits=False)
        kl["kl_dense"][0] += float(out.indexer_kl[0])
        kl["kl_dense"][1] += float(out.indexer_kl[1])
    return result | {name: s / max(c, 1) for name, (s, c) in kl.items()}


def show(label: str, r: dict) -> None:
    print(f"{label:>28}  recall {r['recall']:.2%}  oracle {r['oracle']:.2%}  uniform {r['uniform']:.2%}  "
          f"top8 {r['top8']:.2%}  entropy {r['entropy']:.3f} nats ({r['entropy_share']:.2f} of log n)  "
          f"KL sparse {r['kl_sparse']:.4f}  dense {r['kl_dense']:.4f}  ({r['queries']} query-layer pairs)",
          flush=True)


def _value(scorecard: dict, metric: str, role: str) -> float:
    entry = next(m for m in scorecard["metrics"] if m["id"] == metric)
    return entry["by_category"]["all"]["values"][role]


def _serving(scorecard: dict, role: str, name: str) -> float:
    total = scorecard["operations"][role]["serving"]["totals"][name]
    return total["sum"] / total["count"]


def _val_loss(run_dir: Path) -> float:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["val_loss"] for r in lines if "val_loss" in r][-1]


def table(rows: list[tuple[str, Path, Path]], base_label: str, base_val: float | None) -> str:
    """Markdown: (label, run dir, eval dir) per model; the first eval's base is the base row (its val
    loss: the runs' "validation loss before training", printed in their log, not in metrics.jsonl)."""
    out = ["| model | MTP acceptance (eval) | indexer recall (eval) | tickets reference loss | val loss |",
           "|---|---:|---:|---:|---:|"]
    first = json.loads((rows[0][2] / "scorecard.json").read_text())
    out.append(f"| {base_label} | {_serving(first, 'base', 'mtp_acceptance'):.1%} | "
               f"{_serving(first, 'base', 'indexer_recall'):.2%} | "
               f"{_value(first, 'tickets/reference_loss/loss', 'base'):.3f} | "
               f"{'' if base_val is None else f'{base_val:.3f}'} |")
    for label, run_dir, eval_dir in rows:
        card = json.loads((eval_dir / "scorecard.json").read_text())
        out.append(f"| {label} | {_serving(card, 'candidate', 'mtp_acceptance'):.1%} | "
                   f"{_serving(card, 'candidate', 'indexer_recall'):.2%} | "
                   f"{_value(card, 'tickets/reference_loss/loss', 'candidate'):.3f} | {_val_loss(run_dir):.3f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    scan = sub.add_parser("scan")
    scan.add_argument("--factors", type=float, nargs="+", default=[1, 2, 4, 8])
    scan.add_argument("--rows", type=int, default=24)
    build = sub.add_parser("build")
    build.add_argument("--factor", type=float, required=True)
    build.add_argument("--out", type=Path, required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--model", type=Path, nargs="+", required=True, help="HF directories")
    pr.add_argument("--run", type=Path, help="a run directory: probe the eval suite's rows (tickets: its "
                    "validation split) as `glmtune eval` does; without it, --rows generated tickets (seed 7)")
    pr.add_argument("--suite", default="recipes/tiny/eval_support_json.yaml")
    pr.add_argument("--rows", type=int, default=24)
    pr.add_argument("--json", type=Path, help="also write the results here")
    tb = sub.add_parser("table", help="the markdown table from runs and their `glmtune eval` directories")
    tb.add_argument("--row", nargs=3, action="append", metavar=("LABEL", "RUN_DIR", "EVAL_DIR"), required=True)
    tb.add_argument("--base-label", default="base")
    tb.add_argument("--base-val", type=float, help="the base's validation loss (a run log's \"before training\")")
    a = parser.parse_args()
    if a.command == "table":
        print(table([(label, Path(r), Path(e)) for label, r, e in a.row], a.base_label, a.base_val))
        return
    torch.manual_seed(0)
    results = {}
    if a.command == "scan":
        cfg = load_config(RECIPE, BASE_OVERRIDES)
        batches = probe_rows(resolve_tokenizer_dir(tokenizer_dir_for(cfg, None)), a.rows)
        for factor in a.factors:
            began = time.perf_counter()
            model, _ = preset_base(factor)
            results[f"x{factor:g}"] = r = probe(model, batches)
            show(f"factor {factor:g}", r)
            print(f"{'':>28}  ({time.perf_counter() - began:.1f} s)", flush=True)
    elif a.command == "build":
        model, cfg = preset_base(a.factor)
        spec = spec_for(cfg.model.name_or_path)
        spec.weights.save_pretrained(model, a.out, source_dir=resolve_tokenizer_dir(tokenizer_dir_for(cfg, None)),
                             overwrite=False)
        (a.out / "SHARPENED.json").write_text(json.dumps({
            "what": "tiny preset random base (seed 1234, index_topk 64) with every self_attn.q_b_proj x factor",
            "factor": a.factor, "script": "benchmarks/indexer_recall_sharpened.py"}, indent=1) + "\n")
        print(f"wrote {a.out} (q_b_proj x {a.factor:g})")
        return
    else:
        batches = None
        for path in a.model:
            began = time.perf_counter()
            model = load_pretrained(path, torch.float32, "cpu")
            batches = batches or (suite_rows(a.suite, a.run) if a.run else probe_rows(path, a.rows))
            results[str(path)] = r = probe(model, batches)
            show(str(path), r)
            print(f"{'':>28}  ({time.perf_counter() - began:.1f} s)", flush=True)
    if getattr(a, "json", None):
        a.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
