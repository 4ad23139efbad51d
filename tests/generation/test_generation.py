"""Cached decoding (`glmtune.generation`) on the tiny preset: logits equal the no-cache full
forward at every step, greedy tokens equal transformers' `generate`, seeded sampling is
reproducible, stops are honoured, and `run_samples` gives what `greedy_generate` gave.

The tiny preset with `index_topk=8` (prompts of 13-40 tokens: the sparse path runs in prefill
and in every decode step) and `index_n_heads=16`: with the preset's 4 indexer heads, ReLU
often zeroes every head and index scores tie exactly at 0, and torch.topk breaks such ties
differently over different key ranges (seen here: 0.26 on a logit at 3 of 12 steps of one
row); the parity tests use 16 heads for the same reason (tests/parity/hf_reference.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GlmMoeDsaForCausalLM
from transformers.utils import logging as hf_logging

from glmtune import save_pretrained
from glmtune.data.tokenizer import load_tokenizer
from glmtune.generation import default_stop_ids, generate, sample_next
from glmtune.generation.generator import cached_decoding_supported
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.kv_cache import DecodeCache, bytes_per_token
from glmtune.models.glm5.model import build_model
from glmtune.train.generate import greedy_generate

ARGS = get_preset("tiny").replace(index_topk=8, index_n_heads=16)
LENGTHS = (20, 5, 13, 40)  # a batch of different lengths; 5 < top-k < the others
NEW = 16


def _prompts(lengths=LENGTHS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return build_model(ARGS, seed=0, attention_backend="eager", moe_backend="loop").eval()


@pytest.fixture(scope="module")
def hf_model(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-tiny")
    save_pretrained(model, path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the MTP layer (dropped by transformers) is reported as unexpected
    try:
        return GlmMoeDsaForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("prefill_chunk", [512, 7])  # 7: the prompt prefilled in chunks through the cache
def test_cached_logits_equal_full_forward(model, backend, prefill_chunk):
    for layer in model.model.layers:
        layer.self_attn.backend = backend
    try:
        prompts = _prompts()
        result = generate(model, prompts, NEW, stop_token_ids=set(), prefill_chunk=prefill_chunk,
                          return_logits=True)
        worst = 0.0
        for row, prompt in enumerate(prompts):
            with torch.no_grad():
                full_TV = model(torch.tensor([prompt + result.token_ids[row]])).logits[0]
            for step, logits_BV in enumerate(result.step_logits):
                worst = max(worst, (full_TV[len(prompt) - 1 + step] - logits_BV[row]).abs().max().item())
        assert len(result.step_logits) == NEW and result.finish_reasons == ["length"] * len(prompts)
        assert worst <= 1e-5, worst  # measured: 5.7e-7 (eager)
    finally:
        for layer in model.model.layers:
            layer.self_attn.backend = "eager"


def _hf_greedy(hf_model, prompts, use_cache):
    longest, pad = max(map(len, prompts)), ARGS.pad_token_id
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                            use_cache=use_cache, pad_token_id=pad)
    return out[:, longest:].tolist()


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_equals_transformers_generate(model, hf_model, use_cache):
    # min_new_tokens and no stop ids here: every row runs all NEW steps in both
    prompts = _prompts() + _prompts((33, 9), seed=5)
    ours = generate(model, prompts, NEW, stop_token_ids=set()).token_ids
    assert ours == _hf_greedy(hf_model, prompts, use_cache)
    for prompt, row in zip(prompts[:2], ours):  # alone (no padding) as in the batch
        assert generate(model, [prompt], NEW, stop_token_ids=set()).token_ids[0] == row
        assert _hf_greedy(hf_model, [prompt], use_cache)[0] == row


def test_seeded_sampling_reproducible(model):
    prompts = _prompts()
    options = dict(temperature=0.9, top_k=50, top_p=0.9, stop_token_ids=set())
    first = generate(model, prompts, NEW, seed=7, **options).token_ids
    assert generate(model, prompts, NEW, seed=7, **options).token_ids == first
    assert generate(model, prompts, NEW, seed=8, **options).token_ids != first
    greedy = generate(model, prompts, NEW, stop_token_ids=set()).token_ids
    assert generate(model, prompts, NEW, temperature=1.0, top_k=1, seed=3, stop_token_ids=set()).token_ids == greedy


def test_sample_next_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample_next(logits, 1.0, top_p=0.5, generator=gen)) for _ in range(50)}
    assert draws == {0}  # p(0) = .657 already reaches 0.5
    draws = {int(sample_next(logits, 1.0, top_p=0.85, generator=gen)) for _ in range(300)}
    assert draws == {0, 1}  # p = .657, .242, .089, .012: the first two reach 0.85


def test_stops(model):
    tokenizer = load_tokenizer()
    prompt = _prompts((20,))[0]
    free = generate(model, [prompt], NEW, tokenizer=tokenizer, stop_token_ids=set())
    text, tokens = free.texts[0], free.token_ids[0]
    assert free.finish_reasons == ["length"] and text == tokenizer.decode(tokens, skip_special_tokens=False)
    # a stop string: the text ends just before it; the tokens end at the one completing it
    needle = text[len(text) // 2:len(text) // 2 + 3]
    cut = generate(model, [prompt], NEW, tokenizer=tokenizer, stop_strings=[needle, "never-there"],
                   stop_token_ids=set())
    assert cut.finish_reasons == ["stop_string"] and cut.texts[0] == text[:text.index(needle)]
    assert tokens[:len(cut.token_ids[0])] == cut.token_ids[0] and needle in tokenizer.decode(cut.token_ids[0])
    # a stop id (excluded from the tokens); in a batch the finished row stops, the other runs on
    stop = tokens[5]
    batch = generate(model, [prompt, _prompts((9,), seed=2)[0]], NEW, stop_token_ids={stop})
    assert batch.finish_reasons[0] == "stop_token" and batch.token_ids[0] == tokens[:tokens.index(stop)]
    # the config's eos ids by default
    assert default_stop_ids(model) == set(ARGS.eos_token_id) == {4064, 4071, 4073}
    assert default_stop_ids(model, tokenizer) == set(ARGS.eos_token_id) | {tokenizer.eos_token_id}


def test_timing_and_cache_size(model):
    result = generate(model, _prompts(), NEW, stop_token_ids=set())
    assert result.prompt_tokens == sum(LENGTHS) and result.new_tokens == NEW * len(LENGTHS)
    assert result.prefill_s > 0 and result.decode_s > 0 and result.decode_tokens_per_s > 0
    cache = DecodeCache(ARGS, batch=2, max_len=10, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.nbytes() == 2 * 10 * bytes_per_token(ARGS, dtype_bytes=4)
    # GLM-5: 78 layers with their own indexer; GLM-5.2: 21 of 78 (bf16)
    assert bytes_per_token(get_preset("glm5")) == 78 * (512 + 64 + 128) * 2 + 1 == 109_825
    assert bytes_per_token(get_preset("glm5.2")) == (78 * (512 + 64) + 21 * 128) * 2 + 1 == 95_233


def test_run_samples_uses_the_cache(model, monkeypatch):
    """`run_samples` (before/after samples) through the cache gives greedy_generate's outputs."""
    from glmtune.data.chat_template import load_chat_template
    from glmtune.data.tokenizer import resolve_tokenizer_dir
    from glmtune.train import samples

    assert cached_decoding_supported(model)
    tokenizer = load_tokenizer()
    template = load_chat_template(resolve_tokenizer_dir(None))
    rows = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "{}"}]}
            for text in ("printer offline since update", "refund for order 1182, charged twice")]
    prompts = samples.prompts_from(rows, 2)
    cached = samples.run_samples(model, tokenizer, template, prompts, max_new_tokens=NEW)
    monkeypatch.setattr(samples, "cached_decoding_supported", lambda _: False)
    uncached = samples.run_samples(model, tokenizer, template, prompts, max_new_tokens=NEW)
    assert [r.output for r in cached] == [r.output for r in uncached] and cached[0].output
    prompt = _prompts((30,))[0]
    eos = set(ARGS.eos_token_id)
    assert generate(model, [prompt], NEW, stop_token_ids=eos).token_ids[0] == greedy_generate(model, prompt, NEW, eos)


@pytest.mark.parametrize("style", ["glm5", "yarn"])  # every layer its own indexer; YaRN rope
def test_greedy_equals_transformers_other_styles(style, tmp_path):
    """transformers' tiny random models of tests/parity (index_topk 8, 16 indexer heads), loaded
    into glmtune: cached greedy tokens equal transformers' generate, logits the full forward's."""
    from glmtune import load_pretrained
    from tests.parity.hf_reference import make_hf_model

    hf = make_hf_model(style)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32, attention_backend="eager", moe_backend="loop").eval()
    prompts = [[t % 500 + 1 for t in p] for p in _prompts((24, 6, 17), seed=4)]  # vocab 512
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    expected = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                           pad_token_id=0)[:, longest:].tolist()
    result = generate(ours, prompts, NEW, stop_token_ids=set(), return_logits=True)
    assert result.token_ids == expected
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            full_TV = ours(torch.tensor([prompt + result.token_ids[row]])).logits[0]
        diffs = [(full_TV[len(prompt) - 1 + step] - logits_BV[row]).abs().max().item()
                 for step, logits_BV in enumerate(result.step_logits)]
        assert max(diffs) <= 1e-5, diffs
