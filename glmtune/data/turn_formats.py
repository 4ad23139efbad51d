"""Turn formats: how a chat template marks its turns, detected from the template and the tokenizer.

The loss mask, generation's stop tokens and eval's reference-loss boundary all depend on where an
assistant turn starts and ends, and each model family's template says it differently:

  * GLM: opens with `<|assistant|>` (prompt); ends with the next `<|user|>` / `<|observation|>`, or
    the `<|endoftext|>` appended after the last turn (a target); stops at `<|endoftext|>`,
    `<|user|>`, `<|observation|>`;
  * ChatML: opens with `<|im_start|>assistant\n`; ends with `<|im_end|>`; stops at `<|im_end|>`,
    `<|endoftext|>`;
  * Llama-3: opens with `<|start_header_id|>assistant<|end_header_id|>\n\n`; ends with `<|eot_id|>`
    or `<|eom_id|>`; stops at those and `<|end_of_text|>`.

GLM has no end-of-turn token: a turn ends where the next role token starts, and the model must
generate that token to stop (GLM-4/GLM-5's `eos_token_id` lists it), so it is supervised; the other
role tokens (`<|system|>`, `<|assistant|>`) end a span unsupervised. ChatML (Qwen2, Qwen2.5, Qwen3)
and Llama-3 (3, 3.1, 3.2, 3.3) close every turn with their own token, which the template renders;
what follows it (ChatML's newline) is prompt. A user turn (eval's reference-loss boundary) opens
with `<|user|>`, `<|im_start|>user\n` (not a tool result: Qwen renders those as user turns that
start with `<tool_response>`), or `<|start_header_id|>user<|end_header_id|>\n\n`.

Detection reads the template text: a format is the template's when every one of its marker
tokens appears in it, or in a one-exchange conversation it renders (GLM first, then ChatML, then
Llama-3; chat_template.chat_format). A template of none of them is accepted when it marks
assistant text with transformers' `{% generation %}...{% endgeneration %}` blocks
(`apply_chat_template(..., return_assistant_tokens_mask=True)`): the blocks are then the mask
(`GENERATION_ONLY`), and generation stops at the tokenizer's eos and at the special tokens the
template puts in a block after the answer (chat_generation.stop_tokens). Any other template is
refused in one sentence naming its file and saying what to add. The tokenizer must hold each
marker token as one token (`check_tokenizer`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# How transformers recognises a template with generation blocks (chat_template_utils.render_jinja_template).
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TurnFormat:
    """One row of the table above: what opens and closes turns, as text of the rendered conversation."""

    name: str  # how messages name it ("GLM", "ChatML", "Llama-3"; "generation blocks" for GENERATION_ONLY)
    markers: tuple[str, ...]  # special tokens the template text must hold; each must be one token
    assistant_start: str  # opens an assistant turn; prompt (inference writes it)
    supervised_ends: tuple[str, ...]  # end an assistant turn and are its targets
    other_starts: tuple[str, ...]  # open another turn: an assistant span ends before them, unsupervised
    user_start: re.Pattern | None  # opens a user turn (eval's reference-loss boundary); None: by message count
    stop_tokens: tuple[str, ...]  # generation stops at those the tokenizer has
    appended_eos: str | None = None  # appended after the rendered conversation (GLM's template stops short)

    @property
    def label(self) -> str:
        """The assistant opening as a message shows it: its tokens, without the trailing newlines."""
        return self.assistant_start.rstrip("\n")

    def assistant_char_spans(self, text: str) -> list[tuple[int, int]]:
        """`[start, end)` of every assistant turn's targets in `text`, in order: from the end of its
        opening to the end of the supervised token that closes it, to the start of another turn's
        opening, or to the end of the text (a turn left open, as a generation prompt is)."""
        boundary = re.compile("|".join(re.escape(t) for t in (*self.supervised_ends, *self.other_starts)))
        spans = []
        for opening in re.finditer(re.escape(self.assistant_start), text):
            start = opening.end()
            end = boundary.search(text, start)
            if end is None:
                spans.append((start, len(text)))
            else:
                spans.append((start, end.end() if end.group() in self.supervised_ends else end.start()))
        return spans


GLM = TurnFormat(
    name="GLM", markers=("<|user|>", "<|assistant|>"), assistant_start="<|assistant|>",
    supervised_ends=("<|user|>", "<|observation|>", "<|endoftext|>"), other_starts=("<|system|>", "<|assistant|>"),
    user_start=re.compile(re.escape("<|user|>")), stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
    appended_eos="<|endoftext|>")
CHATML = TurnFormat(
    name="ChatML", markers=("<|im_start|>", "<|im_end|>"), assistant_start="<|im_start|>assistant\n",
    supervised_ends=("<|im_end|>",), other_starts=("<|im_start|>",),
    user_start=re.compile(re.escape("<|im_start|>user\n") + "(?!" + re.escape("<tool_response>") + ")"),
    stop_tokens=("<|im_end|>", "<|endoftext|>"))
LLAMA3 = TurnFormat(
    name="Llama-3", markers=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    assistant_start="<|start_header_id|>assistant<|end_header_id|>\n\n",
    supervised_ends=("<|eot_id|>", "<|eom_id|>"), other_starts=("<|start_header_id|>",),
    user_start=re.compile(re.escape("<|start_header_id|>user<|end_header_id|>\n\n")),
    stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"))
# A template of no known format whose {% generation %} blocks mark the assistant text: the blocks
# are the spans (one per assistant message), the reference boundary counts messages.
GENERATION_ONLY = TurnFormat(name="generation blocks", markers=(), assistant_start="", supervised_ends=(),
                             other_starts=(), user_start=None, stop_tokens=())
FORMATS: tuple[TurnFormat, ...] = (GLM, CHATML, LLAMA3)


@dataclass(frozen=True)
class ChatFormat:
    """What a template is: its turn format, and whether its generation blocks give the loss mask."""

    turns: TurnFormat
    generation_blocks: bool  # the mask comes from the template's {% generation %} blocks

    @property
    def masks_by_blocks(self) -> bool:
        # GLM's mask is its role-token rule even in a template with blocks: the eos glmtune appends
        # after the last turn lies outside any block, and GLM's own turn ends (the next role token)
        # belong to the next turn's rendering.
        return self.generation_blocks and self.turns is not GLM


def template_source(template: str) -> str:
    """Where the template was read from (chat_template.ChatTemplate.source), for messages."""
    return getattr(template, "source", "<chat template text>")


def detect_format(template: str, rendered: str = "") -> ChatFormat:
    """The template's turn format (see module docstring), from its text or, for a template that
    builds its tokens (`<|{{ m.role }}|>`), from `rendered`, a conversation it rendered; a ValueError
    naming the template file for one glmtune cannot tell the turns of."""
    blocks = GENERATION_TAG.search(template) is not None
    for turns in FORMATS:
        if any(all(marker in text for marker in turns.markers) for text in (template, rendered)):
            return ChatFormat(turns, blocks)
    if blocks:
        return ChatFormat(GENERATION_ONLY, True)
    raise ValueError(f"{template_source(template)}: the chat template is not of a turn format glmtune knows "
                     f"({', '.join(f.name for f in FORMATS)}) and marks no assistant text with "
                     "{% generation %}...{% endgeneration %}; wrap each assistant turn's output, the token that "
                     "ends the turn included, in such a block (as transformers' return_assistant_tokens_mask "
                     "expects)")


def token_id(tokenizer: Any, token: str) -> int | None:
    """`token`'s id when the tokenizer encodes it as that one token, else None."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        return None
    return ids[0]


def check_tokenizer(chat_format: ChatFormat, tokenizer: Any, template: str) -> None:
    """Every marker token of the template's format is one token of `tokenizer` (a ValueError naming both)."""
    turns = chat_format.turns
    required = (*turns.markers, turns.appended_eos) if turns.appended_eos else turns.markers
    missing = [t for t in required if token_id(tokenizer, t) is None]
    if missing:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!s}: {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not one token, but the chat template "
                         f"{template_source(template)} has {chat_format.turns.name} turns, which need "
                         f"{'it' if len(missing) == 1 else 'them'}; use the tokenizer the template came with")
