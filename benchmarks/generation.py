"""Generation tokens/s of glmtune's KV-cache decoder against transformers' `generate`, same weights.

glmtune builds the GLM-5 proxy of benchmarks/throughput.py (every GLM-5 layer width; 4 layers =
1 dense + 3 MoE, 32 experts; bf16 on the GPU, the model's default backends) with random weights,
writes it with its own `save_pretrained`, and transformers loads that directory
(`AutoModelForCausalLM.from_pretrained`, its defaults): both hold the same weights. For each batch
size, the same left-padded prompts (random ids from a fixed seed; row 0 has `--prompt` tokens,
the others 3/4 of that up to it) are answered greedily with `--new` tokens per row and no stop
ids, by `glmtune.generation.generate` (one process) and by `model.generate` (transformers' default
cache). One warm-up call each, then `--repeats` timed calls of each, interleaved, with a device
sync around every call; medians are reported.

Per batch size: total generated tokens/s (batch x new / wall time, prefill included); glmtune's
prefill time and decode tokens/s (`GenerationResult`); transformers' prefill time measured the
same way (a `max_new_tokens=1` call) and the decode tokens/s it leaves; peak GPU memory of each
call (both models resident); and how far the two agree: per row, the first step whose token
differs (null: none). Greedy bf16 decoding may split at a near-tie, so each split is reported
with both models' logit margins there instead of asserting equality.

    python benchmarks/generation.py                       # batch 1 and 8, prompt 256, 128 new
    python benchmarks/generation.py --batches 1,8,32 --new 256
    python benchmarks/generation.py --dtype float32       # agreement without bf16 rounding (slower)
    python benchmarks/generation.py --device cpu --layers 2 --experts 8 --vocab 8192 --batches 3 \
        --prompt 40 --new 24 --repeats 1                  # the proxy's layer widths on a CPU
    python benchmarks/generation.py --tiny                # the tiny preset, fp32 on the CPU, seconds

Results append to $OUT/generation.jsonl (or --out) as JSON lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import DEVICE, emit, peak_gib, results_path, sync  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8; --tiny: 1,4)")
    p.add_argument("--prompt", type=int, default=None, help="longest prompt in tokens (default 256; --tiny: 24)")
    p.add_argument("--new", type=int, default=None, help="new tokens per row (default 128; --tiny: 12)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per implementation (default 3; --tiny: 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--vocab", type=int, default=None, help="the proxy's vocabulary (default GLM-5's 154880)")
    p.add_argument("--device", default=None, help="default: cuda when there is one (--tiny: cpu)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="both models' weights and compute (float32: full-precision matmuls, no TF32); --tiny: float32")
    p.add_argument("--tiny", action="store_true", help="the tiny preset in fp32 on the CPU: a smoke test")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    small = a.tiny
    a.batches = [int(b) for b in (a.batches or ("1,4" if small else "1,8")).split(",")]
    a.prompt = a.prompt or (24 if small else 256)
    a.new = a.new or (12 if small else 128)
    a.repeats = a.repeats or (1 if small else 3)
    a.device = a.device or ("cpu" if small else DEVICE)
    a.dtype = torch.float32 if small else getattr(torch, a.dtype)
    return a


def model_args(a):
    """The tiny preset, or the proxy of benchmarks/throughput.py as glmtune's args."""
    from glmtune.models.glm5.args import Glm5Args, get_preset

    if a.tiny:
        return get_preset("tiny")
    from benchmarks.throughput import proxy_config

    shape = argparse.Namespace(tiny=False, layers=a.layers, dense=a.dense, experts=a.experts, seq=a.prompt + a.new)
    args = Glm5Args.from_hf_dict(proxy_config(shape).to_dict())
    return args.replace(vocab_size=a.vocab) if a.vocab else args


def build_models(a, folder: Path):
    """glmtune's model with random weights, and transformers' model loaded from glmtune's export of it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from glmtune import save_pretrained
    from glmtune.models.glm5.model import build_model

    ours = build_model(model_args(a), a.dtype, a.device, seed=a.seed).eval()
    start = time.perf_counter()
    save_pretrained(ours, folder)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the tiny preset's MTP layer, which transformers drops, is reported
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=a.dtype, device_map=a.device).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    # No stop ids on either side. min_new_tokens alone would mask transformers' eos logits, a token
    # glmtune may still pick (it has no stop ids to mask): clear eos so both take the plain argmax.
    hf.generation_config.eos_token_id = None
    print(f"built: {sum(p.numel() for p in ours.parameters()) / 1e9:.3f}B parameters, "
          f"export + transformers load {time.perf_counter() - start:.1f}s", flush=True)
    return ours, hf


def make_prompts(a, batch: int, vocab: int) -> list[list[int]]:
    """Row 0 is `a.prompt` tokens long, the others 3/4 of that up to it (left padding in the batch)."""
    gen = torch.Generator().manual_seed(a.seed + batch)
    shortest = max(1, 3 * a.prompt // 4)
    lengths = [a.prompt] + torch.randint(shortest, a.prompt + 1, (batch - 1,), generator=gen).tolist()
    high = min(vocab, 4000) if a.tiny else vocab  # tiny: below the preset's pad and eos ids (4064+)
    return [torch.randint(1, high, (n,), generator=gen).tolist() for n in lengths]


def timed(fn):
    """(seconds, result) of one call between device syncs."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def run_ours(model, prompts, new, return_logits=False):
    from glmtune.generation import generate

    return generate(model, prompts, new, stop_token_ids=set(), return_logits=return_logits)


def run_hf(model, prompts, new, pad_id, return_logits=False):
    """transformers' `generate` on the same left-padded batch: (new tokens per row, fp32 logits per step)."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=pad_id, return_dict_in_generate=True, output_logits=return_logits)
    logits = [step.float() for step in out.logits] if return_logits else []
    return out.sequences[:, longest:].tolist(), logits


def first_divergence(ours: list[list[int]], theirs: list[list[int]]) -> list[int | None]:
    """Per row, the first step whose token differs (None: every token agrees)."""
    return [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), None) for r, s in zip(ours, theirs)]


def splits(divergence, ours, theirs, our_logits, their_logits) -> list[dict]:
    """At each row's split: each model's logit margin of its own token over the other's (a near-tie is small)."""
    out = []
    for row, step in enumerate(divergence):
        if step is None:
            continue
        mine, other = ours[row][step], theirs[row][step]
        out.append({"row": row, "step": step,
                    "glmtune_margin": round(float(our_logits[step][row, mine] - our_logits[step][row, other]), 5),
                    "transformers_margin": round(float(their_logits[step][row, other]
                                                       - their_logits[step][row, mine]), 5)})
    return out


def max_logit_diff(divergence, new, our_logits, their_logits) -> float:
    """Largest |glmtune - transformers| fp32 logit over the steps both computed from the same tokens."""
    worst = 0.0
    for row, step in enumerate(divergence):
        last = new if step is None else step + 1  # the split step's logits still follow the same tokens
        for s in range(last):
            diff = our_logits[s][row].to(their_logits[s].device) - their_logits[s][row]
            worst = max(worst, diff.abs().max().item())
    return worst


def bench_batch(a, ours, hf, batch: int) -> dict:
    prompts = make_prompts(a, batch, ours.args.vocab_size)
    pad_id = ours.args.pad_token_id if ours.args.pad_token_id is not None else 0  # what generate pads with
    total = batch * a.new
    # Warm-up, with logits: the tokens and logits the agreement figures come from.
    warm = run_ours(ours, prompts, a.new, return_logits=True)
    hf_tokens, hf_logits = run_hf(hf, prompts, a.new, pad_id, return_logits=True)
    divergence = first_divergence(warm.token_ids, hf_tokens)
    split_rows = splits(divergence, warm.token_ids, hf_tokens, warm.step_logits, hf_logits)
    logit_diff = max_logit_diff(divergence, a.new, warm.step_logits, hf_logits)
    del warm.step_logits[:], hf_logits
    run_hf(hf, prompts, 1, pad_id)  # the prefill-only call's shapes, warmed too

    walls = {"glmtune": [], "transformers": [], "transformers_prefill": []}
    results, peaks = [], {"glmtune": 0.0, "transformers": 0.0}
    repeatable = {"glmtune": True, "transformers": True}  # each timed call's tokens equal its warm-up's
    for _ in range(a.repeats):
        for name, call in (("glmtune", lambda: run_ours(ours, prompts, a.new)),
                           ("transformers", lambda: run_hf(hf, prompts, a.new, pad_id)),
                           ("transformers_prefill", lambda: run_hf(hf, prompts, 1, pad_id))):
            if a.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds, result = timed(call)
            walls[name].append(seconds)
            if name in peaks:
                peaks[name] = max(peaks[name], peak_gib() if a.device == "cuda" else 0.0)
            if name == "glmtune":
                results.append(result)
                repeatable["glmtune"] &= result.token_ids == warm.token_ids
            elif name == "transformers":
                repeatable["transformers"] &= result[0] == hf_tokens

    wall = {name: statistics.median(v) for name, v in walls.items()}
    ours_prefill = statistics.median(r.prefill_s for r in results)
    ours_decode = statistics.median(r.decode_tokens_per_s for r in results)
    decode_steps = batch * (a.new - 1)
    hf_decode_s = wall["transformers"] - wall["transformers_prefill"]
    agreed = sum(a.new if step is None else step for step in divergence)
    return {
        "batch": batch, "prompt_lengths": [len(p) for p in prompts], "new_tokens": a.new, "repeats": a.repeats,
        "glmtune_tok_s": round(total / wall["glmtune"], 1), "glmtune_wall_s": round(wall["glmtune"], 4),
        "glmtune_prefill_s": round(ours_prefill, 4), "glmtune_decode_tok_s": round(ours_decode, 1),
        "transformers_tok_s": round(total / wall["transformers"], 1),
        "transformers_wall_s": round(wall["transformers"], 4),
        "transformers_prefill_s": round(wall["transformers_prefill"], 4),
        "transformers_decode_tok_s": round(decode_steps / hf_decode_s, 1) if hf_decode_s > 0 else None,
        "speedup": round(wall["transformers"] / wall["glmtune"], 3),
        "glmtune_peak_gib": round(peaks["glmtune"], 2), "transformers_peak_gib": round(peaks["transformers"], 2),
        "tokens_agreeing_before_split": agreed, "tokens_total": total,
        "first_divergence": divergence, "splits": split_rows, "max_logit_diff_before_split": round(logit_diff, 5),
        "glmtune_repeatable": repeatable["glmtune"], "transformers_repeatable": repeatable["transformers"],
        "walls_s": {k: [round(x, 4) for x in v] for k, v in walls.items()},
    }


def table(lines: list[dict]) -> str:
    head = ("| batch | glmtune tok/s | glmtune decode tok/s | glmtune prefill s | transformers tok/s "
            "| transformers decode tok/s | transformers prefill s | speedup | tokens agreeing | first split per row |")
    rows = [head, "|" + "---:|" * 9 + "---|"]
    for r in lines:
        split = ", ".join("-" if s is None else str(s) for s in r["first_divergence"])
        rows.append(f"| {r['batch']} | {r['glmtune_tok_s']:,.1f} | {r['glmtune_decode_tok_s']:,.1f} "
                    f"| {r['glmtune_prefill_s']:.4f} | {r['transformers_tok_s']:,.1f} "
                    f"| {r['transformers_decode_tok_s'] or 0:,.1f} | {r['transformers_prefill_s']:.4f} "
                    f"| {r['speedup']:.2f}x | {r['tokens_agreeing_before_split']}/{r['tokens_total']} | {split} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    if a.dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False  # the default, said here: fp32 means fp32 products
    with tempfile.TemporaryDirectory(prefix="glmtune-gen-") as folder:
        ours, hf = build_models(a, Path(folder))
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    import transformers

    meta = {"impl": "generation", "preset": "tiny" if a.tiny else "proxy",
            "dtype": str(a.dtype).removeprefix("torch."),
            "layers": ours.args.num_hidden_layers, "experts": ours.args.n_routed_experts,
            "hf_attn": hf.config._attn_implementation,
            "hf_experts": getattr(hf.config, "_experts_implementation", None),
            "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d")}
    lines = []
    for batch in a.batches:  # each line written as it is measured: a run cut short keeps what it had
        lines.append({**bench_batch(a, ours, hf, batch), **meta})
        emit(lines[-1:], results_path(a.out, "generation.jsonl"))
    print(table(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
