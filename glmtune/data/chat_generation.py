"""What generating under a chat template needs from it: where a generated turn stops, and what the
template writes between two generated turns (a tool-call turn's results and the next opening).

Stop tokens are the template's turn format's (turn_formats.py: GLM's <|endoftext|>, <|user|>,
<|observation|>; ChatML's <|im_end|>, <|endoftext|>; Llama-3's <|eot_id|>, <|eom_id|>,
<|end_of_text|>), those the tokenizer has. A template known only by its `{% generation %}` blocks
says its end of turn inside the block: the special tokens a one-exchange conversation's block holds
after the answer (Gemma's <end_of_turn>), with the tokenizer's eos.
"""

from __future__ import annotations

from typing import Any

from glmtune.data.chat_template import PROBE, PROBE_ANSWER, chat_format, render_with_blocks
from glmtune.data.turn_formats import GENERATION_ONLY, template_source, token_id


def stop_tokens(tokenizer: Any, template: str) -> tuple[str, ...]:
    """The tokens generation stops at under `template` (see module docstring)."""
    turns = chat_format(template).turns
    if turns is not GENERATION_ONLY:
        return tuple(token for token in turns.stop_tokens if token_id(tokenizer, token) is not None)
    text, blocks = render_with_blocks(PROBE, template=template, tokenizer=tokenizer)
    after = "".join(text[start:end] for start, end in blocks).rpartition(PROBE_ANSWER)[2]
    specials = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    found = sorted((token for token in specials | set(tokenizer.all_special_tokens) if token in after), key=after.index)
    tokens = tuple(dict.fromkeys([tokenizer.eos_token, *found] if tokenizer.eos_token else found))
    if not tokens:
        raise ValueError(f"{template_source(template)}: cannot tell where a generated assistant turn ends: the "
                         "tokenizer has no eos token and the template's {% generation %} block holds no special "
                         "token after the answer")
    return tokens


def stop_token_ids(tokenizer: Any, template: str) -> set[int]:
    """`stop_tokens` as ids."""
    return {token_id(tokenizer, token) for token in stop_tokens(tokenizer, template)}


def tool_turns_text(messages: list[dict[str, Any]], tokenizer: Any, *, tools: list[dict[str, Any]] | None,
                    template: str, enable_thinking: bool) -> str:
    """What the template renders after the end of the last assistant turn of `messages` (the tool
    turns that follow it) through the next generation prompt: a transcript's piece between two
    generated turns."""
    text, blocks = render_with_blocks(messages, tools=tools, template=template, enable_thinking=enable_thinking,
                                      add_generation_prompt=True, tokenizer=tokenizer)
    found = chat_format(template)
    if found.masks_by_blocks:
        return text[blocks[-1][1]:] if blocks else text
    spans = found.turns.assistant_char_spans(text)  # the last one: the generation prompt's open turn
    return text[spans[-2][1]:] if len(spans) >= 2 else text
