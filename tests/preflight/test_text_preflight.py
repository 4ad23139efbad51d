"""`glmtune preflight` on a raw-text recipe (`data.kind: text`, recipes/tiny/cpt_domain_text.yaml):
check 3 tokenizes the first document instead of rendering a chat template, the scratch runs read
the first documents of the corpus with their sources, and check 9 continues document prefixes.
(The whole preflight on this recipe passed all ten checks: 7 min on 2 loaded cores, 2026-12-05.)"""

from __future__ import annotations

import json

from glmtune.config.loader import RECIPES_DIR
from glmtune.data.text_corpus import tokenize_texts
from glmtune.data.tokenizer import load_tokenizer
from glmtune.preflight.generation import PROMPT_TOKENS, check_generation, text_prompts
from glmtune.preflight.loading import check_model
from glmtune.preflight.trained import base_model

TEXT = RECIPES_DIR / "tiny" / "cpt_domain_text.yaml"
CORPUS = RECIPES_DIR / "tiny" / "domain_text" / "corpus.jsonl"


def test_check_3_tokenizes_the_first_document(fresh):
    result = check_model(fresh(TEXT))
    assert result.status == "pass", result.message
    first = json.loads(CORPUS.read_text().splitlines()[0])
    [ids] = tokenize_texts(load_tokenizer(), [first["text"]])
    origin = f"{CORPUS.relative_to(RECIPES_DIR.parent)}:1"  # the recipe's path, relative to the repository root
    assert result.evidence["text"] == {"origin": origin, "source": first["source"], "tokens": len(ids)}
    assert f"raw text, no chat template: the first document ({origin}) is {len(ids)} tokens" in result.message


def test_scratch_runs_read_the_first_documents_and_check_9_continues_them(fresh):
    pf = fresh(TEXT)
    cfg = pf.scratch()
    assert cfg.data.kind == "text" and cfg.data.source_field == "source" and len(cfg.data.train) == 1
    copied = [json.loads(line) for line in open(cfg.data.train[0])]
    originals = [json.loads(line) for line in CORPUS.read_text().splitlines()[:pf.rows]]
    assert copied == [{"text": o["text"], "source": o["source"]} for o in originals]
    prompts = text_prompts(pf)
    tokenizer = load_tokenizer()
    starts = {tuple(ids[:PROMPT_TOKENS]) for ids in tokenize_texts(tokenizer, [o["text"] for o in originals])}
    assert len(prompts) == 3 and all(tuple(p) in starts for p in prompts)  # each a document's first tokens
    model = base_model(pf)
    result = check_generation(pf, None, base=model, trained=model)
    assert result.status == "pass", result.message
    assert result.evidence["decoding"]["stop_tokens"] == (tokenizer.eos_token,)
    assert result.message.endswith("training changed 0 of 3 outputs")
