"""Before/after generations on held-out prompts, scored against the reference answer.

For the prompts (validation conversations cut before their final assistant turn)
the model generates greedily (with the decoding cache of `glmtune.generation` when
the model is a plain unsharded `Glm5ForCausalLM`; else `greedy_generate`, which re-runs
the prefix and works under every parallel wrapper); each output is scored as parseable
JSON and as an exact match of the reference answer's JSON. A prompt is rendered with the
tokenizer's special tokens (Llama-3's template starts with its bos_token), as training data is;
generation stops at the end-of-turn tokens of the template's turn format
(`chat_generation.stop_token_ids`), not GLM's alone. Running the same prompts before and
after training shows, in the terminal, what the fine-tune changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from glmtune.data.chat_generation import stop_token_ids
from glmtune.data.chat_template import render_conversation
from glmtune.generation.generator import cached_decoding_supported, generate
from glmtune.io.text_limits import parse_json
from glmtune.train.generate import greedy_generate


@dataclass
class SampleResult:
    prompt: str
    reference: str
    output: str

    # What a model wrote and what a data row holds are parsed within parse_json's depth bound:
    # `[[[[...` is not valid JSON here, never a RecursionError at the end of a run.
    @property
    def valid_json(self) -> bool:
        try:
            parse_json(self.output, "the output")
            return True
        except ValueError:
            return False

    @property
    def exact(self) -> bool:
        try:
            return parse_json(self.output, "the output") == parse_json(self.reference, "the reference")
        except ValueError:
            return self.output.strip() == self.reference.strip()


def prompts_from(conversations: list[dict[str, Any]], count: int) -> list[tuple[dict[str, Any], str]]:
    """(conversation without its final answer, reference answer) for the first `count` rows."""
    out: list[tuple[dict[str, Any], str]] = []
    if count <= 0:
        return out
    for row in conversations:
        messages = row["messages"]
        if messages and messages[-1]["role"] == "assistant" and isinstance(messages[-1].get("content"), str):
            out.append(({**row, "messages": messages[:-1]}, messages[-1]["content"]))
        if len(out) == count:
            break
    return out


def prompt_ids(tokenizer, template: str, row: dict[str, Any]) -> list[int]:
    """The row's prompt as the model reads it: rendered with a generation prompt, thinking off, and
    the tokenizer's special tokens (what transformers' apply_chat_template gives)."""
    text = render_conversation(row["messages"], tools=row.get("tools") or None, template=template,
                               enable_thinking=False, add_generation_prompt=True, tokenizer=tokenizer)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_samples(model: nn.Module, tokenizer, template: str, prompts: list[tuple[dict[str, Any], str]],
                max_new_tokens: int = 64) -> list[SampleResult]:
    # The template's own end of turn (GLM's <|endoftext|>/<|user|>/<|observation|>, ChatML's <|im_end|>,
    # Llama-3's <|eot_id|>, ...), as eval's generation stops: data/chat_generation.py.
    stop_ids = stop_token_ids(tokenizer, template)
    results = []
    for row, reference in prompts:
        ids = prompt_ids(tokenizer, template, row)
        if cached_decoding_supported(model):
            output_ids = generate(model, [ids], max_new_tokens, stop_token_ids=stop_ids).token_ids[0]
        else:
            output_ids = greedy_generate(model, ids, max_new_tokens, stop_ids)
        user = next((m["content"] for m in reversed(row["messages"]) if m["role"] == "user"), "")
        results.append(SampleResult(str(user), reference, tokenizer.decode(output_ids, skip_special_tokens=False)))
    return results


def score(results: list[SampleResult]) -> dict[str, float]:
    n = max(len(results), 1)
    return {"valid_json": sum(r.valid_json for r in results) / n, "exact": sum(r.exact for r in results) / n}
