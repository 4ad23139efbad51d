"""Which side of `benchmarks/generation.py` depends on the batch: each row's first-token logits
computed in the left-padded batch and alone, by glmtune's `generate` and by transformers'.

On one H200 at batch 32 (bf16) the two implementations' greedy tokens split at the first token
for some rows with logit gaps near 1 (docs/benchmarks.md, 2026-12-03), where on a CPU they are
bit-identical. A row's logits must not depend on the other rows of its batch beyond rounding:
this prints, per implementation, the largest |batched - alone| over each row's first-token
logits and whether the argmax moved, and the largest |glmtune - transformers| of the rows alone.

    python3 benchmarks/generation_padding.py --batches 32 [--dtype float32]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generation import build_models, make_prompts, parse_args, run_hf, run_ours  # noqa: E402


def compare(a, ours, hf, batch: int) -> dict:
    prompts = make_prompts(a, batch, ours.args.vocab_size)
    pad = ours.args.pad_token_id if ours.args.pad_token_id is not None else 0

    def glm(ps):
        return run_ours(ours, ps, 1, return_logits=True).step_logits[0].cpu()

    def tf(ps):
        return run_hf(hf, ps, 1, pad, return_logits=True)[1][0].cpu()

    batched = {"glmtune": glm(prompts), "transformers": tf(prompts)}
    alone = {"glmtune": torch.cat([glm([p]) for p in prompts]), "transformers": torch.cat([tf([p]) for p in prompts])}
    line = {"batch": batch, "dtype": str(a.dtype).removeprefix("torch."),
            "pads": [max(map(len, prompts)) - len(p) for p in prompts]}
    for name in batched:
        diff_B = (batched[name] - alone[name]).abs().amax(dim=-1)
        moved = (batched[name].argmax(-1) != alone[name].argmax(-1)).nonzero().flatten().tolist()
        line[name] = {"max_batched_vs_alone": float(diff_B.max()), "worst_row": int(diff_B.argmax()),
                      "argmax_moved_rows": moved}
    line["alone_glmtune_vs_transformers"] = float((alone["glmtune"] - alone["transformers"]).abs().max())
    line["batched_glmtune_vs_transformers"] = float((batched["glmtune"] - batched["transformers"]).abs().max())
    return line


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    if a.dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="glmtune-pad-") as folder:
        ours, hf = build_models(a, Path(folder))
    for batch in a.batches:
        print(json.dumps(compare(a, ours, hf, batch)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
