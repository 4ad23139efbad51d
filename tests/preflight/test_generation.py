"""Check 9 with a non-deterministic trained model (noise from a real forward hook) and with the two
models decoded under different settings."""

from __future__ import annotations

import dataclasses

import torch

from glmtune.data.chat_template import load_chat_template
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.preflight.generation import check_generation, decoding_for, fixed_prompts
from glmtune.preflight.trained import trained_model


def test_passing_run_shows_both_outputs(sft_done):
    samples = sft_done.check(9)["evidence"]["samples"]
    assert len(samples) == 3 and all({"prompt", "reference", "base", "trained"} <= s.keys() for s in samples)


def test_non_deterministic_decoding_fails(sft_done, fresh):
    pf, ref = fresh(), sft_done.reference()
    trained, _ = trained_model(pf, ref.run_dir)
    trained.model.norm.register_forward_hook(lambda module, args, out: out + 10 * torch.randn_like(out))
    result = check_generation(pf, ref, trained=trained)
    assert result.status == "fail"
    assert result.message.startswith("trained model: decoding prompt 1 twice gave different outputs")


def test_mismatched_decoding_fails(sft_done, fresh):
    pf = fresh()
    prompts = fixed_prompts(pf)
    decoding = decoding_for(load_tokenizer(None), load_chat_template(TINY_TOKENIZER_DIR), prompts)
    other = dataclasses.replace(decoding, max_new_tokens=8)
    result = check_generation(pf, sft_done.reference(), trained_decoding=other)
    assert result.status == "fail"
    assert result.message == "base and trained models were decoded differently: {'max_new_tokens': (24, 8)}"
