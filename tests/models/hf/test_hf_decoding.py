"""Cached decoding of the hf family (`glmtune.models.hf.decoding`, driven by `glmtune.generation`):
on tiny Llama, Qwen3, Qwen3-MoE and GLM-4 models, greedy tokens and every step's logits equal
transformers' own `generate` on the same left-padded batch (prefill whole or in chunks through
the cache), stop ids end a row as transformers' eos does, seeded sampling draws what transformers'
sampling draws from the same seed, and the default stop and pad ids are the config's. Before the
family had decoding hooks, `generate` refused these models ("no model family decodes a ...")."""

from __future__ import annotations

import pytest
import torch

from glmtune.generation import default_stop_ids, generate
from glmtune.generation.generator import cached_decoding_supported
from glmtune.models.hf.spec import HF
from glmtune.train.generate import greedy_generate
from tests.models.hf.conftest import VOCAB

NEW = 10
PAD = 0


def _prompts(lengths=(9, 3, 14, 6), seed=1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _left_padded(prompts):
    longest = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _transformers_generate(model, prompts, **options):
    """transformers' `generate` of the left-padded batch: (new tokens per row, fp32 logits per step)."""
    ids, mask = _left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True,
                         output_logits=True, **options)
    return out.sequences[:, ids.shape[1]:].tolist(), [logits.float() for logits in out.logits]


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu").eval()


@pytest.mark.parametrize("prefill_chunk", [512, 4])  # 4: the prompt prefilled in chunks through the cache
def test_greedy_equals_transformers_generate(tiny_model, prefill_chunk):
    prompts = _prompts()
    ours = generate(tiny_model, prompts, NEW, stop_token_ids=set(), prefill_chunk=prefill_chunk, return_logits=True)
    tokens, logits = _transformers_generate(tiny_model, prompts, do_sample=False, min_new_tokens=NEW,
                                            eos_token_id=None)
    assert ours.token_ids == tokens and ours.finish_reasons == ["length"] * len(prompts)
    worst = max((a - b).abs().max().item() for a, b in zip(ours.step_logits, logits, strict=True))
    assert worst <= 1e-5, worst
    for prompt, row in zip(prompts[:2], tokens):  # alone (no padding) as in the batch
        assert generate(tiny_model, [prompt], NEW, stop_token_ids=set()).token_ids[0] == row


def test_stop_ids_end_rows_as_transformers_eos_does(tiny_model):
    prompts = _prompts()
    free = generate(tiny_model, prompts, NEW, stop_token_ids=set()).token_ids
    stop = free[0][3]  # row 0 stops before its 4th token; the others wherever it first appears, if at all
    ours = generate(tiny_model, prompts, NEW, stop_token_ids={stop})
    tokens, _ = _transformers_generate(tiny_model, prompts, do_sample=False, eos_token_id=stop)
    for row, (mine, theirs) in enumerate(zip(ours.token_ids, tokens, strict=True)):
        stopped = stop in theirs
        assert mine == (theirs[:theirs.index(stop)] if stopped else theirs), row
        assert ours.finish_reasons[row] == ("stop_token" if stopped else "length"), row
    assert ours.token_ids[0] == free[0][:free[0].index(stop)] and ours.finish_reasons[0] == "stop_token"


@pytest.mark.parametrize("options", [dict(temperature=0.8), dict(temperature=1.3, top_k=20),
                                     dict(temperature=1.0, top_p=0.7)])
def test_seeded_sampling_draws_what_transformers_draws(tiny_model, options):
    """glmtune samples from a torch.Generator seeded with `seed`, transformers from the global RNG:
    seeded alike (CPU), the same filtered distribution gives the same draws, step after step."""
    prompts = _prompts()
    ours = generate(tiny_model, prompts, NEW, seed=11, stop_token_ids=set(), **options).token_ids
    torch.manual_seed(11)
    theirs, _ = _transformers_generate(tiny_model, prompts, do_sample=True, min_new_tokens=NEW, eos_token_id=None,
                                       **{"top_k": 0, "top_p": 1.0, **options})
    assert ours == theirs
    assert generate(tiny_model, prompts, NEW, seed=11, stop_token_ids=set(), **options).token_ids == ours
    assert generate(tiny_model, prompts, NEW, seed=12, stop_token_ids=set(), **options).token_ids != ours


def test_default_ids_cache_and_samples(tiny_model):
    assert cached_decoding_supported(tiny_model)
    assert default_stop_ids(tiny_model) == {2}  # conftest's eos_token_id
    prompt = _prompts((7,))[0]
    result = generate(tiny_model, [prompt], NEW, stop_token_ids=set())
    # the before/after samples take the cached path now; the uncached loop gives the same tokens
    assert greedy_generate(tiny_model, prompt, NEW, stop_ids=set()) == result.token_ids[0]
    hooks = HF.decoding
    cache = hooks.new_cache(tiny_model, 2, 8)
    ids = torch.tensor([[PAD, 5, 6], [7, 8, 9]])
    hooks.forward(tiny_model, ids, torch.tensor([[0, 0, 1], [0, 1, 2]]), ids != PAD, cache)
    assert cache.length == 3 and cache.valid_BT[:, :3].tolist() == [[0, 1, 1], [1, 1, 1]]
    config = tiny_model.config
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * 4  # K and V, head_dim 16, fp32
    assert cache.nbytes() == 2 * 3 * per_position + 2 * 8 * 8  # + the int64 mask of 8 positions
    with pytest.raises(ValueError, match="cache holds 8 positions; 9 asked for"):
        hooks.forward(tiny_model, ids.repeat(1, 2), torch.tensor([[2, 3, 4, 5, 6, 7]] * 2), ids.repeat(1, 2) > 0, cache)
