"""Batched incremental decoding with a `DecodeCache`: greedy or seeded sampling.

    result = generate(model, [ids_a, ids_b], max_new_tokens=64, tokenizer=tok,
                      temperature=0.7, top_p=0.9, seed=0, stop_strings=["}"])
    result.token_ids[i], result.texts[i], result.finish_reasons[i], result.decode_tokens_per_s

Prompts of different lengths are LEFT-padded to the longest: every row's next token is
then the last column, and each row's rope positions count from its first real token
(as transformers' `generate` does from the attention mask). Pad keys are masked out of
attention (and, in GLM-5, out of the indexer's top-k: `models/glm5/decode.py`).

What depends on the architecture (the cache, the forward over new tokens through it, the head,
the config's special ids) is the model family's, reached through its spec's `decoding` hooks
(`glmtune.models.common.decoding.CachedDecoding`, found by `registry.decoding_of`); this
module is the family-agnostic part.

The prompt is prefilled in chunks of `prefill_chunk` positions through the same cached
forward (bounding the [B, S, H, T] fp32 indexer scores); then one token per row per step.

A row finishes at a stop token id (not included in its tokens: "stop_token"), when its
text contains a stop string (the text is cut before it, the tokens kept up to the one
that completed it: "stop_string"), or after `max_new_tokens` ("length"). Stop ids default
to the model config's `eos_token_id` plus the tokenizer's eos.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from glmtune.models.common.decoding import CachedDecoding
from glmtune.models.registry import decoding_of


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids per row (without the prompt and the stop id)
    texts: list[str] | None  # decoded (cut before a stop string); None without a tokenizer
    finish_reasons: list[str]  # "stop_token" | "stop_string" | "length"
    prompt_tokens: int  # real (unpadded) prompt tokens over all rows
    new_tokens: int  # generated tokens over all rows (stop ids included: they were computed)
    prefill_s: float  # prompt forward and the first token
    decode_s: float  # every later step
    step_logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [B, V] per step, if asked

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.new_tokens - len(self.token_ids)  # the first token of each row is prefill's
        return steps / self.decode_s if self.decode_s > 0 else float("inf")


def _decoding(model: nn.Module) -> CachedDecoding:
    """The decoding hooks of `model`'s family, or a ValueError naming its class."""
    hooks = decoding_of(model)
    if hooks is None:
        raise ValueError(f"no model family decodes a {type(model).__name__} with a cache")
    return hooks


def default_stop_ids(model: nn.Module, tokenizer=None) -> set[int]:
    ids = _decoding(model).eos_token_ids(model)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def sample_next(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next ids [B] from fp32 logits: argmax at temperature 0, else a draw from the
    temperature-scaled distribution cut to the top_k most likely ids (0: all) and to the
    smallest set whose probability reaches top_p (the most likely id is always kept)."""
    if temperature == 0.0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / temperature
    if top_k > 0:
        kth_B1 = logits_BV.topk(min(top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        beyond_BV = probs_BV.cumsum(dim=-1) - probs_BV >= top_p  # the mass before this id already reaches top_p
        sorted_BV = sorted_BV.masked_fill(beyond_BV, float("-inf"))
        logits_BV = torch.full_like(logits_BV, float("-inf")).scatter(-1, order_BV, sorted_BV)
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, *, tokenizer=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             stop_token_ids: set[int] | None = None, stop_strings: tuple[str, ...] | list[str] = (),
             prefill_chunk: int = 512, return_logits: bool = False, lockstep=None) -> GenerationResult:
    """Generates up to `max_new_tokens` after each prompt (see the module docstring).
    `seed` seeds a torch.Generator on the model's device: the same seed, prompts and options
    give the same tokens. `lockstep`: the ranks of a sharded model (module docstring)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if temperature < 0 or not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError(f"temperature must be >= 0, top_p in (0, 1], top_k >= 0; got {temperature}, {top_p}, {top_k}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer")
    if stop_token_ids is None:
        stop_token_ids = default_stop_ids(model, tokenizer)
    hooks = _decoding(model)
    head = hooks.head(model)
    device = head.weight.device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    pad_id = hooks.pad_token_id(model)

    batch, longest = len(prompts), max(len(p) for p in prompts)
    ids_BP, valid_BP, positions_BP = _left_padded(prompts, pad_id, device)
    cache = hooks.new_cache(model, batch, longest + max_new_tokens)

    rows = _Rows(batch, max_new_tokens, stop_token_ids, tokenizer, stop_strings)
    step_logits: list[torch.Tensor] = []
    prefill_s = 0.0
    sync = lockstep if lockstep is not None else _ONE_PROCESS
    was_training = model.training
    model.eval()
    try:
        with sync.gathered(model):  # the root's own weights (embedding, final norm, head) for the whole call
            start = time.perf_counter()
            chunks = range(0, longest, prefill_chunk)
            for _ in range(sync.agree_max(len(chunks)) - len(chunks)):
                _idle_forward(hooks, model, sync)  # another rank prefills more chunks: take part in its collectives
            for chunk_start in chunks:
                cols = slice(chunk_start, chunk_start + prefill_chunk)
                hidden_BSD = hooks.forward(model, ids_BP[:, cols], positions_BP[:, cols], valid_BP[:, cols], cache,
                                           sync.gathered)
            next_pos_B1 = positions_BP[:, -1:] + 1
            for step in range(max_new_tokens):
                logits_BV = head(hidden_BSD[:, -1]).float()
                if return_logits:
                    step_logits.append(logits_BV)
                rows.accept(sample_next(logits_BV, temperature, top_k, top_p, generator).tolist())
                if step == 0:
                    prefill_s = time.perf_counter() - start
                    start = time.perf_counter()
                # Under lockstep a finished rank keeps stepping (its tokens ignored) until every rank is done.
                if sync.all_done(rows.done):
                    break
                next_B1 = torch.tensor(rows.last, device=device)[:, None]
                ones_B1 = torch.ones(batch, 1, dtype=torch.bool, device=device)
                hidden_BSD = hooks.forward(model, next_B1, next_pos_B1, ones_B1, cache, sync.gathered)
                next_pos_B1 = next_pos_B1 + 1
            decode_s = time.perf_counter() - start if max_new_tokens > 1 else 0.0
    finally:
        model.train(was_training)
    return GenerationResult(rows.tokens, rows.texts, [r or "length" for r in rows.reasons], sum(map(len, prompts)),
                            rows.new_tokens, prefill_s, decode_s, step_logits)


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device):
    """(ids [B, P], valid [B, P], rope positions [B, P]) of the prompts left-padded to the longest P."""
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    ids_BP = torch.tensor([[pad_id] * n + list(p) for n, p in zip(pads, prompts)], device=device)
    pad_B1 = torch.tensor(pads, device=device)[:, None]
    columns_P = torch.arange(longest, device=device)[None, :]
    return ids_BP, columns_P >= pad_B1, (columns_P - pad_B1).clamp(min=0)


class _Rows:
    """Each row's generated tokens, text and finish reason, one sampled token per row at a time."""

    def __init__(self, batch: int, max_new_tokens: int, stop_token_ids: set[int], tokenizer,
                 stop_strings) -> None:
        self.max_new_tokens, self.stop_token_ids = max_new_tokens, stop_token_ids
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch
        self.texts: list[str] | None = [""] * batch if tokenizer is not None else None
        self.new_tokens = 0  # stop ids included: they were computed
        self.last: list[int] = []

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def accept(self, next_ids: list[int]) -> None:
        self.last = next_ids
        for row, token in enumerate(next_ids):
            if self.reasons[row] is not None:
                continue
            self.new_tokens += 1
            if token in self.stop_token_ids:
                self.reasons[row] = "stop_token"
                continue
            self.tokens[row].append(token)
            if self.texts is not None:
                text = self.tokenizer.decode(self.tokens[row], skip_special_tokens=False)
                hits = [text.find(s) for s in self.stop_strings if s in text]
                self.texts[row] = text[:min(hits)] if hits else text
                if hits:
                    self.reasons[row] = "stop_string"
            if self.reasons[row] is None and len(self.tokens[row]) == self.max_new_tokens:
                self.reasons[row] = "length"


class _OneProcess:
    """The lockstep of a model in one process: nothing to gather, nobody to agree with."""

    @staticmethod
    def gathered(module):
        return contextlib.nullcontext()

    @staticmethod
    def agree_max(value: int) -> int:
        return value

    @staticmethod
    def all_done(done: bool) -> bool:
        return done


_ONE_PROCESS = _OneProcess()


def _idle_forward(hooks: CachedDecoding, model: nn.Module, sync) -> None:
    """One forward of one pad token on a scratch cache: this rank's share of a step the others take."""
    device = hooks.head(model).weight.device
    cache = hooks.new_cache(model, 1, 1)
    one_11 = torch.zeros(1, 1, dtype=torch.long, device=device)
    hooks.forward(model, one_11, one_11, torch.ones(1, 1, dtype=torch.bool, device=device), cache, sync.gathered)


def cached_decoding_supported(model: nn.Module) -> bool:
    """Whether `generate` can run `model` in one process (no lockstep): its family has decoding
    hooks and they run it as it is (GLM-5: a plain, unsharded model; the family's `supported`
    says why). Otherwise `glmtune.train.generate.greedy_generate` runs it."""
    hooks = decoding_of(model)
    return hooks is not None and hooks.supported(model)
