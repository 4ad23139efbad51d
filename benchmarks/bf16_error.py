"""Where glmtune's bf16 logits lose precision: each backend combination against a float32 reference.

Preflight check 8 found glmtune's bf16 logits of the tiny preset 1.7 times further from float32
than transformers' (docs/preflight.md). This measures, on one GPU, the relative error (Frobenius)
and top-1 agreement of glmtune's bf16 logits against the same weights in float32 (eager attention,
torch MoE dispatch) for every attention / MoE-dispatch / grouped-matmul backend, beside
transformers' bf16 logits (eager) of the same checkpoint. Sequences are at most `index_topk`
tokens, so the DSA selection keeps every key and the indexer's numerics cannot matter.

    python benchmarks/bf16_error.py --preset tiny --seq 256 --rows 4 --out results.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import tempfile

import torch

from benchmarks.timing import emit
from glmtune import load_pretrained, save_pretrained
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import set_moe_dispatch_backend


def relative(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    actual, expected = actual.float(), expected.float()
    rel = ((actual - expected).norm() / expected.norm()).item()
    return rel, (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    args = get_preset(opts.preset)
    seq = min(opts.seq, args.index_topk)
    ids = torch.randint(0, args.vocab_size, (opts.rows, seq), generator=torch.Generator().manual_seed(opts.seed))
    ids = ids.cuda()
    with tempfile.TemporaryDirectory() as export:
        # bf16 weights written once: every model below reads exactly these values
        save_pretrained(build_model(args, torch.bfloat16, "cpu", seed=opts.seed), export)
        reference = load_pretrained(export, torch.float32, "cuda", attention_backend="eager").eval()
        set_moe_dispatch_backend(reference, "torch")
        ref_BSV = reference(ids).logits.float()
        del reference

        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16, attn_implementation="eager")
        rel, top1 = relative(hf.cuda().eval()(ids).logits, ref_BSV)
        emit([{"what": "transformers bf16 (eager)", "relative_error": rel, "top1": top1}], opts.out)
        del hf
        for attention, dispatch, grouped in itertools.product(("eager", "sdpa", "gemm", "triton"),
                                                              ("torch", "triton"), ("grouped_mm", "loop")):
            model = load_pretrained(export, torch.bfloat16, "cuda", attention_backend=attention,
                                    moe_backend=grouped).eval()
            set_moe_dispatch_backend(model, dispatch)
            rel, top1 = relative(model(ids).logits, ref_BSV)
            emit([{"what": f"glmtune bf16 attention={attention} dispatch={dispatch} moe={grouped}",
                   "relative_error": rel, "top1": top1}], opts.out)
            del model


if __name__ == "__main__":
    main()
