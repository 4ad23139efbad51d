"""What a serving engine's absorbed-MLA decode does to a LoRA adapter that targets `kv_b_proj`.

vLLM's MLA attention (`vllm/model_executor/layers/attention/mla_attention.py`,
`MLAAttention.process_weights_after_loading`) splits W_UK and W_UV out of the BASE
`kv_b_proj` weight once at load time; its decode path (`forward_impl`: `q_nope @ W_UK_T`,
then `_v_up_proj` with `W_UV`) never calls `kv_b_proj`, so the adapter's kv_b delta is
missing for every key and value a decode query attends, the prompt's included. Sparse
(DSA) MLA backends, which GLM-5 uses, send prefill tokens through that path too.

glmtune's `DecodeCache` stores the compressed latent, and `models/glm5/decode.py` expands it
through `kv_b_proj` at every step, so "the kv_b LoRA switched off" reproduces exactly what
the absorbed path computes. On the eval tickets' prompts of a LoRA run, this compares
three variants of the same adapter, each decoding greedily with glmtune's cached forward:

  (a) applied everywhere: what training computed;
  (b) kv_b delta in the prompt's prefill, not in the decode steps (vLLM's non-sparse
      backends: dense prefill, absorbed decode);
  (c) kv_b delta nowhere (absorbed everywhere: vLLM's sparse MLA, or a loader that drops it).

For (b) and (c) it prints the largest |logit - logit_a| over the steps of (a)'s own greedy
continuation (teacher-forced, so every step sees the same context), how often the argmax
moves, and, decoding each freely, how many answers and tokens change and how many answers
stay exact. It also prints (a)'s largest |logit| and smallest top-1/top-2 gap (how close a
greedy choice came to flipping). The noise floor is (a) against the training forward (`Glm5ForCausalLM.forward`
on prompt + continuation): the cached path's own rounding.

    python3 benchmarks/kv_b_absorbed.py --run /tmp/lora20 [--limit 24] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.data.chat_template import load_chat_template  # noqa: E402
from glmtune.data.tokenizer import load_tokenizer  # noqa: E402
from glmtune.eval.answering import Prompting  # noqa: E402
from glmtune.eval.models import load_model, resolve_model  # noqa: E402
from glmtune.eval.sets import load_sets  # noqa: E402
from glmtune.eval.suite import load_suite  # noqa: E402
from glmtune.models.glm5.decode import forward_cached  # noqa: E402
from glmtune.models.glm5.kv_cache import DecodeCache  # noqa: E402
from glmtune.peft.lora import LoRALinear  # noqa: E402


def kv_b_adapters(model) -> list[LoRALinear]:
    found = [m for n, m in model.named_modules() if n.endswith("self_attn.kv_b_proj") and isinstance(m, LoRALinear)]
    if not found:
        raise ValueError("the adapter has no kv_b_proj LoRA: nothing to measure")
    return found


@contextlib.contextmanager
def kv_b_off(modules: list[LoRALinear]):
    """The kv_b LoRA contributes exactly zero (scale 0: s * B = 0) while inside."""
    saved = [m.scaling for m in modules]
    for m in modules:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, s in zip(modules, saved):
            m.scaling = s


@torch.no_grad()
def decode(model, prompt: list[int], steps: int, stop_ids: set[int], kv_b: list[LoRALinear], variant: str,
           forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and fp32 logits per step for one prompt. `forced`: feed these tokens
    instead of the argmax (teacher forcing); `variant` a|b|c as in the module docstring."""
    device = model.lm_head.weight.device
    steps = steps if forced is None else len(forced)
    cache = DecodeCache(model.args, 1, len(prompt) + steps, model.lm_head.weight.dtype, device)
    ids = torch.tensor([prompt], device=device)
    positions = torch.arange(len(prompt), device=device)[None]
    valid = torch.ones_like(ids, dtype=torch.bool)
    with kv_b_off(kv_b) if variant == "c" else contextlib.nullcontext():
        hidden = forward_cached(model, ids, positions, valid, cache)
    tokens, logits = [], []
    with kv_b_off(kv_b) if variant in ("b", "c") else contextlib.nullcontext():
        for step in range(steps):
            logits_V = model.lm_head(hidden[0, -1]).float()
            logits.append(logits_V)
            token = int(logits_V.argmax()) if forced is None else forced[step]
            tokens.append(token)
            if step == steps - 1 or (forced is None and token in stop_ids):
                break
            one = torch.tensor([[token]], device=device)
            hidden = forward_cached(model, one, torch.tensor([[len(prompt) + step]], device=device),
                                    torch.ones_like(one, dtype=torch.bool), cache)
    return tokens, logits


@torch.no_grad()
def training_logits(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The training forward's logits at the positions that predicted `tokens`."""
    ids = torch.tensor([prompt + tokens[:-1]], device=model.lm_head.weight.device)
    out = model(ids).logits[0].float()
    return list(out[len(prompt) - 1:])


def fields(text: str, stop_text: str) -> dict | None:
    try:
        value = json.loads(text.split(stop_text)[0])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a LoRA run directory (RUN_DIR/adapter)")
    parser.add_argument("--suite", default="recipes/tiny/eval_support_json.yaml")
    parser.add_argument("--set", default="tickets")
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    a = parser.parse_args()

    torch.manual_seed(0)
    suite = load_suite(a.suite)
    candidate = resolve_model(a.run, "candidate")
    tokenizer = load_tokenizer(candidate.tokenizer_dir)
    prompting = Prompting(tokenizer, load_chat_template(candidate.tokenizer_dir), suite.file.enable_thinking,
                          suite.file.decoding)
    rows = next(s for s in load_sets(suite, candidate) if s.spec.name == a.set).rows[:a.limit]
    model = load_model(candidate, torch.device(a.device), None)
    kv_b = kv_b_adapters(model)
    stop_ids = prompting.stop_ids | ({model.args.eos_token_id} if isinstance(model.args.eos_token_id, int)
                                     else set(model.args.eos_token_id or ()))
    delta_norm = max(float(m.delta_weight().norm() / m.weight.float().norm()) for m in kv_b)

    report = {"run": a.run, "dtype": str(model.lm_head.weight.dtype).removeprefix("torch."), "prompts": len(rows),
              "kv_b_modules": len(kv_b), "max_kv_b_delta_rel_norm": delta_norm}
    floor, steps_total, scale, margin = 0.0, 0, 0.0, float("inf")
    stats = {v: {"max_abs_logit_diff": 0.0, "argmax_moved": 0, "answers_changed": 0, "tokens_changed": 0,
                 "exact": 0, "valid_json": 0} for v in "abc"}
    for row in rows:
        prompt = prompting.render(row.prompt, row.tools)
        tokens_a, logits_a = decode(model, prompt, a.max_new_tokens, stop_ids, kv_b, "a")
        steps_total += len(tokens_a)
        for logits_V in logits_a:
            top2 = logits_V.topk(2).values
            scale, margin = max(scale, float(logits_V.abs().max())), min(margin, float(top2[0] - top2[1]))
        for ref, got in zip(training_logits(model, prompt, tokens_a), logits_a):
            floor = max(floor, float((ref - got).abs().max()))
        reference = fields(row.reference or "", "\0")
        for v in "abc":
            s = stats[v]
            if v != "a":
                _, logits_v = decode(model, prompt, 0, stop_ids, kv_b, v, forced=tokens_a)
                for la, lv in zip(logits_a, logits_v):
                    s["max_abs_logit_diff"] = max(s["max_abs_logit_diff"], float((la - lv).abs().max()))
                    s["argmax_moved"] += int(la.argmax() != lv.argmax())
                tokens_v, _ = decode(model, prompt, a.max_new_tokens, stop_ids, kv_b, v)
            else:
                tokens_v = tokens_a
            s["answers_changed"] += int(tokens_v != tokens_a)
            s["tokens_changed"] += sum(x != y for x, y in zip(tokens_v, tokens_a)) + abs(len(tokens_v) - len(tokens_a))
            answer = fields(tokenizer.decode([t for t in tokens_v if t not in stop_ids]), "\0")
            s["valid_json"] += int(answer is not None)
            s["exact"] += int(answer is not None and reference is not None and all(
                answer.get(k) == reference.get(k) for k in ("product", "severity", "next_action")))
    report["greedy_steps_a"] = steps_total
    report["noise_floor_cached_vs_training_forward"] = floor
    report["max_abs_logit_a"], report["min_top2_margin_a"] = scale, margin
    report["variants"] = stats
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
