"""Check 9: base and trained outputs on fixed prompts under one decoding, side by side.

Prompts: the first `NUM_PROMPTS` conversations of the scratch data's validation split (the
training split when it has none), cut before their final assistant answer
(`glmtune.train.samples.prompts_from`), rendered with the run's chat template and a
generation prompt. Decoding: greedy, through `glmtune.train.samples.run_samples` as a
training run's samples are decoded (glmtune/generation's cached decoding for an unsharded
model), at most `MAX_NEW_TOKENS` new tokens, stopping at the template's end-of-turn tokens
(`chat_generation.stop_tokens`: GLM's `<|endoftext|>`, `<|user|>`, `<|observation|>`; ChatML's
`<|im_end|>`; Llama-3's `<|eot_id|>`; ...), thinking disabled. The base is the model the reference run
started from; the trained model is the base with the reference run's last checkpoint.

Two steps of training promise nothing about quality, so the criterion is about the decoding
itself, and it can fail: (1) both models complete a generation for every prompt; (2) each
model decoded twice gives the same outputs (greedy decoding of the same weights must be
deterministic); (3) the decoding settings and the prompt token ids are the same for both
models (a comparison under different settings proves nothing). How many outputs changed
is recorded, not judged.

A raw-text recipe (`data.kind: text`) has no conversations and no template: its prompts are the
first `PROMPT_TOKENS` tokens of the first documents of the same rows, as training tokenized them,
continued greedily until EOS or `MAX_NEW_TOKENS` (`glmtune.generation.generate`); the same three
criteria hold.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from glmtune.data.chat_generation import stop_tokens
from glmtune.data.chat_template import load_chat_template
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.generation import generate
from glmtune.io.json_file import json_lines
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, verdict
from glmtune.preflight.runs import ReferenceRun
from glmtune.preflight.trained import base_model, trained_model
from glmtune.train.model_source import tokenizer_dir_for
from glmtune.train.samples import SampleResult, prompt_ids, prompts_from, run_samples

NUM_PROMPTS = 3
MAX_NEW_TOKENS = 24
PROMPT_TOKENS = 16  # a raw-text prompt: the start of a document


@dataclass(frozen=True)
class Decoding:
    """Everything that decides what a model generates for a prompt, besides its weights."""

    max_new_tokens: int
    template_sha256: str
    prompt_ids_sha256: str  # the rendered, tokenized prompts
    stop_tokens: tuple[str, ...]  # the template's (run_samples stops at them)
    strategy: str = "greedy"
    enable_thinking: bool = False


def fixed_prompts(pf: Preflight) -> list[tuple[dict[str, Any], str]]:
    data = pf.data()
    conversations = data.val_conversations or [
        row for _, row, _ in json_lines(Path(data.manifest["train_file"]), "training data", max_line_bytes=1 << 30)]
    return prompts_from(conversations, NUM_PROMPTS)


def text_prompts(pf: Preflight) -> list[list[int]]:
    """data.kind text: the first PROMPT_TOKENS tokens of the first NUM_PROMPTS documents of the
    scratch data's validation rows (the training rows when it has none)."""
    data = pf.data()
    prompts: list[list[int]] = []
    for row in data.val_rows or data.train_rows:
        docs = row["document_ids"]
        for start, doc in enumerate(docs):
            if doc < 0 or (start and docs[start - 1] == doc):
                continue  # padding, or not a document's first token
            ids = [t for t, d in zip(row["input_ids"][start:start + PROMPT_TOKENS], docs[start:]) if d == doc]
            prompts += [ids] if len(ids) >= 2 else []
            if len(prompts) == NUM_PROMPTS:
                return prompts
    return prompts


class TextDecoding:
    """`decode_twice` for raw-text prompts: greedy continuations until EOS, as SampleResults."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, model: nn.Module, tokenizer, template: str, prompts, decoding: Decoding):
        def once() -> list[SampleResult]:
            result = generate(model, prompts, decoding.max_new_tokens, tokenizer=tokenizer,
                              stop_token_ids={tokenizer.eos_token_id})
            return [SampleResult(tokenizer.decode(p), "", text) for p, text in zip(prompts, result.texts)]
        return once(), once()


def decoding_for(tokenizer, template: str, prompts, max_new_tokens: int = MAX_NEW_TOKENS) -> Decoding:
    ids = [prompt_ids(tokenizer, template, row) for row, _ in prompts]  # as run_samples renders them
    return Decoding(max_new_tokens, hashlib.sha256(template.encode()).hexdigest(),
                    hashlib.sha256(json.dumps(ids).encode()).hexdigest(), stop_tokens(tokenizer, template))


def decode_twice(model: nn.Module, tokenizer, template: str, prompts, decoding: Decoding
                 ) -> tuple[list[SampleResult], list[SampleResult]]:
    return tuple(run_samples(model, tokenizer, template, prompts, decoding.max_new_tokens) for _ in range(2))


def check_generation(pf: Preflight, ref: ReferenceRun, base: nn.Module | None = None,
                     trained: nn.Module | None = None, trained_decoding: Decoding | None = None) -> CheckResult:
    """Check 9 on the reference run's base and trained models (or the ones given), with one decoding
    (or `trained_decoding` for the trained model: a test's planted mismatch)."""
    directory = resolve_tokenizer_dir(tokenizer_dir_for(pf.scratch(), pf.scratch_model_dir()))
    text = pf.cfg.data.kind == "text"
    tokenizer = load_tokenizer(directory)
    template = "" if text else load_chat_template(directory)  # raw text: no template
    prompts = text_prompts(pf) if text else fixed_prompts(pf)
    if not prompts:
        return CheckResult(9, "fail", "no document of the data has two tokens to prompt with" if text else
                           "no conversation of the data ends with an assistant answer to prompt with")
    decode = TextDecoding(tokenizer) if text else decode_twice
    decoding = (Decoding(MAX_NEW_TOKENS, "", hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
                         (tokenizer.eos_token,)) if text else decoding_for(tokenizer, template, prompts))
    trained_decoding = trained_decoding or decoding
    base = base if base is not None else base_model(pf)
    trained = trained if trained is not None else trained_model(pf, ref.run_dir)[0]
    problems, results = [], {}
    for label, model, settings in (("base", base, decoding), ("trained", trained, trained_decoding)):
        first, second = decode(model, tokenizer, template, prompts, settings)
        results[label] = first
        differ = [i for i, (a, b) in enumerate(zip(first, second)) if a.output != b.output]
        if differ:
            problems.append(f"{label} model: decoding prompt {differ[0] + 1} twice gave different outputs "
                            f"({first[differ[0]].output[:40]!r} vs {second[differ[0]].output[:40]!r}): "
                            "decoding is not deterministic")
    if decoding != trained_decoding:
        changed = {k: (v, asdict(trained_decoding)[k]) for k, v in asdict(decoding).items()
                   if asdict(trained_decoding)[k] != v}
        problems.append(f"base and trained models were decoded differently: {changed}")
    side_by_side = [{"prompt": b.prompt, "reference": b.reference, "base": b.output, "trained": t.output}
                    for b, t in zip(results["base"], results["trained"])]
    num_changed = sum(row["base"] != row["trained"] for row in side_by_side)
    evidence = {"decoding": asdict(decoding), "trained_decoding": asdict(trained_decoding),
                "dtype": str(next(trained.parameters()).dtype).removeprefix("torch."), "device": str(pf.device),
                "samples": side_by_side, "changed_by_training": num_changed}
    message = (f"{len(prompts)} prompts decoded greedily (max {decoding.max_new_tokens} new tokens), twice per "
               f"model, the same outputs each time; same settings and prompt ids for both; training changed "
               f"{num_changed} of {len(prompts)} outputs")
    return verdict(9, problems, message, evidence)
