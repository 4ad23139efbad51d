"""The before/after samples of an hf-family run: `greedy_generate` asks the family for the next
token's logits (`Compute.last_token_logits`), so a transformers model decodes what transformers'
own greedy `generate` does (it called GLM-5's forward signature: a TypeError on every hf run with
`train.generate_samples` > 0)."""

from __future__ import annotations

import torch

from glmtune.models.hf.spec import HF
from glmtune.train.generate import greedy_generate

NEW = 8


def test_greedy_samples_of_a_transformers_model_are_transformers_greedy_decoding(tiny_dir):
    model = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    prompt = [t % model.config.vocab_size for t in (5, 17, 42, 7, 99, 3)]
    ours = greedy_generate(model, prompt, NEW, stop_ids=set())
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs and len(ours) == NEW
    assert greedy_generate(model, prompt, NEW, stop_ids={ours[2]}) == ours[:2]  # a stop id ends it, excluded
