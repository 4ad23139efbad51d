"""Chat template rendering and assistant-only loss masks, for the chat formats of turn_formats.py.

Rendering uses jinja2's immutable sandbox configured like `transformers`
(`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that is `json.dumps` with
`ensure_ascii=False` by default, `raise_exception`, `strftime_now`, the tokenizer's special
tokens such as `bos_token` as variables), so the text is identical to
`tokenizer.apply_chat_template(..., tokenize=False)`. The template is the tokenizer directory's
own (`chat_template.jinja`, else `tokenizer_config.json`) or the bundled GLM-5 one
(templates/glm5.jinja, from the GLM-5 spec section 5).

Loss mask. Every assistant message's targets are one span of the rendered text, found by the
template's turn format (`chat_format`, turn_formats.py): everything after the turn's opening
(GLM's `<|assistant|>`, ChatML's `<|im_start|>assistant\n`, Llama-3's assistant header), the
token that ends the turn included, because the model must generate it to stop:
  * GLM has no end-of-turn token: the span runs to the next `<|user|>` / `<|observation|>`
    (included) or, after the final turn, an appended `<|endoftext|>` (eos, included);
    `<think>...</think>` or `</think>`, the visible content and tool calls are targets;
  * ChatML: through the turn's `<|im_end|>` (the newline after it is prompt);
  * Llama-3: through the turn's `<|eot_id|>` (or `<|eom_id|>`);
  * a template with `{% generation %}...{% endgeneration %}` blocks (not GLM's): the blocks, and
    tokens overlapping them, exactly as transformers' `return_assistant_tokens_mask` (the
    template's author says what is generated).
The turn opening is prompt (inference writes it), as is everything from system/user/tool turns.
Spans are found on the rendered text, not by rendering prefixes: GLM's and Qwen3's templates drop
the reasoning of turns before the last user message, so a prefix does not render the same as the
full conversation. There must be one span per assistant message (message text that forges a turn
is refused). Character spans are mapped to tokens with the tokenizer's offset mapping; a token
straddling a span edge of a turn format means its tokens are not atomic tokens (wrong tokenizer).
A template glmtune cannot tell the turns of is refused (`chat_format`).

With `enable_thinking=False`, reasoning (`reasoning_content`, inline `<think>`
blocks) is removed before rendering, so targets teach the model to answer without
thinking; with True it is kept wherever the template shows it. The switch reaches the template
as `enable_thinking` (Qwen3's closes an empty think block in the generation prompt when False).

A template comes with the checkpoint, so it is input, not code: one that does not
compile, that the sandbox stops (an attribute such as `__class__`, a list's `append`),
or that calls `raise_exception` is a ValueError naming the file it was read from
(`ChatTemplate.source`), never a jinja traceback.
"""

from __future__ import annotations

import bisect
import io
import json
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from glmtune.data.tokenizer import GLM5_CONTROL_TOKENS, resolve_tokenizer_dir
from glmtune.data.turn_formats import GLM, ChatFormat, check_tokenizer, detect_format
from glmtune.io.regular import open_regular
from glmtune.io.text_limits import parse_json

BUNDLED_TEMPLATE_PATH = Path(__file__).parent / "templates" / "glm5.jinja"
IGNORE_INDEX = -100
LossOn = Literal["all_assistant", "last_assistant"]
LOSS_ON_CHOICES: tuple[str, ...] = ("all_assistant", "last_assistant")



@dataclass
class TokenizedSample:
    """One conversation as model inputs: `labels[i]` is `input_ids[i]` where the token
    is an assistant target, else -100 (unshifted, aligned with input_ids)."""

    input_ids: list[int]
    labels: list[int]
    # Where each assistant message's targets start (token index), whatever loss_on kept: a
    # preference pair's prompt ends at its answer's. Not stored in the token cache.
    turn_starts: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        assert len(self.input_ids) == len(self.labels)

    @property
    def num_targets(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


class ChatTemplate(str):
    """Template text that remembers where it was read from, for error messages; a plain str
    everywhere else (hashing, caching, comparing)."""

    source: str = "<chat template text>"  # a template given as text, read from no file

    def __new__(cls, text: str, source: str) -> "ChatTemplate":
        template = super().__new__(cls, text)
        template.source = source
        return template

    def __reduce__(self):  # pickled as itself (data loader workers), source included
        return ChatTemplate, (str(self), self.source)


def bundled_template() -> str:
    return ChatTemplate(BUNDLED_TEMPLATE_PATH.read_text(encoding="utf-8"), str(BUNDLED_TEMPLATE_PATH))


def load_chat_template(tokenizer_dir: str | Path | None = None) -> str:
    """The chat template text for a tokenizer directory, falling back to GLM-5's.

    Order: `chat_template.jinja`, then `tokenizer_config.json`'s `chat_template`
    (a string, or a list of named templates where "default" wins), then the bundled one.
    """
    if tokenizer_dir is not None:
        directory = Path(tokenizer_dir)
        jinja_file = directory / "chat_template.jinja"
        # A FIFO or a directory under either name is refused, not skipped for another template.
        if jinja_file.exists():
            with io.TextIOWrapper(open_regular(jinja_file, "chat template"), encoding="utf-8") as f:
                return ChatTemplate(f.read(), str(jinja_file))  # universal newlines, as read_text
        config_file = directory / "tokenizer_config.json"
        if config_file.exists():
            with open_regular(config_file, "tokenizer config") as f:
                config = parse_json(f.read(), str(config_file), max_bytes=64 << 20)
            template = config.get("chat_template") if isinstance(config, dict) else None
            if isinstance(template, list):
                named = {entry.get("name"): entry.get("template") for entry in template}
                template = named.get("default")
            if isinstance(template, str) and template:
                return ChatTemplate(template, f"{config_file} (chat_template)")
    return bundled_template()


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` markers: the body renders unchanged, and while a
    render tracks them (`_render(..., blocks=[...])`) each block's character span is recorded, as
    transformers' AssistantTracker does for `return_assistant_tokens_mask` (the same rule: the
    span starts at the length of what the template has put out so far)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
            "glmtune_generation_blocks", default=None)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller: Any) -> str:
        text = caller()
        tracking = self.tracking.get()
        if tracking is not None:
            pieces, blocks = tracking
            start = sum(len(piece) for piece in pieces)
            blocks.append((start, start + len(text)))
        return text


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes `<>&'`; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _source(template: str) -> str:
    return getattr(template, "source", ChatTemplate.source)


def _refused(template: str, exc: Exception) -> ValueError:
    return ValueError(f"{_source(template)}: the chat template sandbox refused an unsafe operation ({exc}); "
                      "a chat template may only read the conversation, not Python objects' internals")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.SecurityError as exc:
        raise _refused(template, exc) from None
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"{_source(template)}: the chat template does not compile (template line {exc.lineno}): "
                         f"{exc.message}") from None


def _render(template: str, blocks: list[tuple[int, int]] | None = None, **variables: Any) -> str:
    """The compiled template rendered; its failures as ValueErrors naming its source. With `blocks`,
    the character spans of its `{% generation %}` blocks are appended to it."""
    compiled = _compile(template)
    try:
        if blocks is None:
            return compiled.render(**variables)
        pieces: list[str] = []
        tracking = compiled.environment.extensions[_GenerationTag.identifier].tracking
        token = tracking.set((pieces, blocks))
        try:
            for piece in compiled.generate(**variables):
                pieces.append(piece)
        finally:
            tracking.reset(token)
        return "".join(pieces)
    except jinja2.exceptions.SecurityError as exc:
        raise _refused(template, exc) from None
    except jinja2.exceptions.TemplateError as exc:  # raise_exception, an undefined value used
        raise ValueError(f"{_source(template)}: the chat template failed: {type(exc).__name__}: {exc}") from None
    except RecursionError:  # a macro that calls itself
        raise ValueError(f"{_source(template)}: the chat template recursed too deeply") from None


def _without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stripped = []
    for message in messages:
        message = {key: value for key, value in message.items() if key != "reasoning_content"}
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, str) and "</think>" in content:
            message["content"] = content.split("</think>")[-1].lstrip("\n")
        stripped.append(message)
    return stripped


def _variables(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tokenizer: Any,
               enable_thinking: bool, add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The template's variables as transformers' apply_chat_template gives them: the tokenizer's
    special tokens (Llama-3's template starts with `bos_token`), then the conversation and switches."""
    special = dict(tokenizer.special_tokens_map) if tokenizer is not None else {}
    if not enable_thinking:
        messages = _without_reasoning(messages)
    return {**special, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking, **template_kwargs}


# A one-exchange conversation: its rendering shows the turn markers of a template that builds them
# from role names (and, chat_generation.py, what a template of unknown format puts in a generation
# block after the answer).
PROBE_ANSWER = "Hello"
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE_ANSWER}]


@lru_cache(maxsize=16)
def chat_format(template: str) -> ChatFormat:
    """The template's turn format (turn_formats.detect_format: its text, else the probe conversation
    as it renders); a ValueError naming the template for one glmtune cannot tell the turns of."""
    try:
        probe = _render(template, **_variables(PROBE, None, None, True, False, {}))
    except ValueError:  # a template that cannot render the probe is judged by its text
        probe = ""
    return detect_format(template, probe)


def control_tokens(template: str, tokenizer: Any) -> tuple[str, ...]:
    """Text no message of a row may hold under `template` and `tokenizer` (the data contract's
    control tokens): tokenized, it would be a control token and could forge a turn. GLM: GLM-5's
    control tokens, as always; another format: the tokenizer's special tokens (bos, eos, pad and the
    special added ones: ChatML's <|im_start|>/<|im_end|>, Llama-3's <|start_header_id|>, ...) with
    the format's markers, longest first (a message names the longest it holds). A template whose
    turns glmtune cannot tell (training refuses it; `glmtune eval` renders it as it is): the
    tokenizer's special tokens alone."""
    try:
        turns = chat_format(template).turns
    except ValueError:
        turns = None
    if turns is GLM:
        return GLM5_CONTROL_TOKENS
    special = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    tokens = special | set(tokenizer.all_special_tokens) | set(turns.markers if turns is not None else ())
    return tuple(sorted((token for token in tokens if token), key=lambda token: (-len(token), token)))


def template_format_of(tokenizer_dir: str | Path | None) -> ChatFormat:
    """The turn format of the template a run with the tokenizer in `tokenizer_dir` renders with (its
    own, else GLM-5's); a ValueError naming the template file for one glmtune cannot tell the turns
    of. Reads the template alone, so `glmtune train` asks before the model is built or anything written."""
    return chat_format(load_chat_template(resolve_tokenizer_dir(tokenizer_dir)))


def render_conversation(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                        template: str | None = None, enable_thinking: bool = True,
                        add_generation_prompt: bool = False, tokenizer: Any = None, **template_kwargs: Any) -> str:
    """Render contract-normalized messages (see contract.normalize_row) to text.

    Args:
        messages: chat messages; tool-call arguments must already be dicts.
        tools: JSON tool specs shown in the system preamble.
        template: template text; None uses the bundled GLM-5 template.
        enable_thinking: False strips reasoning and, with add_generation_prompt,
            ends the prompt with `</think>` instead of `<think>`.
        add_generation_prompt: append the assistant turn's opening (GLM: `<|assistant|>`) for inference.
        tokenizer: the tokenizer whose special tokens the template may read (`bos_token`, ...).
        template_kwargs: extra template variables (e.g. clear_thinking).
    """
    return _render(template if template is not None else bundled_template(),
                   **_variables(messages, tools, tokenizer, enable_thinking, add_generation_prompt, template_kwargs))


def render_with_blocks(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                       template: str | None = None, enable_thinking: bool = True, add_generation_prompt: bool = False,
                       tokenizer: Any = None) -> tuple[str, list[tuple[int, int]]]:
    """`render_conversation`'s text, and the `[start, end)` character spans of the template's
    `{% generation %}` blocks in it (none for a template without them)."""
    blocks: list[tuple[int, int]] = []
    text = _render(template if template is not None else bundled_template(), blocks=blocks,
                   **_variables(messages, tools, tokenizer, enable_thinking, add_generation_prompt, {}))
    return text, blocks


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Which tokens lie in `spans` (a turn format's: its edges sit at special tokens, so a token
    across one means the format's tokens are not this tokenizer's single tokens)."""
    starts = [start for start, _ in spans]
    edges = sorted({edge for span in spans for edge in span})

    def inside(char: int) -> bool:
        k = bisect.bisect_right(starts, char) - 1
        return k >= 0 and char < spans[k][1]

    mask: list[bool | None] = []
    for start, end in offsets:
        if end == start:
            mask.append(None)  # offsets trimmed to nothing (whitespace); resolved below
            continue
        k = bisect.bisect_right(edges, start)
        if k < len(edges) and edges[k] < end:
            raise ValueError(f"token at characters [{start}, {end}) straddles a loss-mask edge at {edges[k]}; "
                             "role tokens must be single special tokens of this tokenizer")
        mask.append(inside(start))
    # Span edges sit right after special tokens, so a zero-width token belongs with the
    # text that follows it.
    following = False
    for i in range(len(mask) - 1, -1, -1):
        if mask[i] is None:
            mask[i] = following
        following = bool(mask[i])
    return [bool(m) for m in mask]


def _overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Which tokens overlap `spans` (generation blocks): transformers' rule for
    `return_assistant_tokens_mask`, so the mask is the one apply_chat_template gives."""
    mask, k = [False] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[i] = end > spans[k][0]
    return mask


@dataclass
class _Conversation:
    """A conversation rendered and tokenized: its text, format, one span per assistant message."""

    text: str
    chat_format: ChatFormat
    spans: list[tuple[int, int]]
    input_ids: list[int]
    offsets: list[tuple[int, int]]

    def mask(self, spans: list[tuple[int, int]]) -> list[bool]:
        by_blocks = _overlap_mask if self.chat_format.masks_by_blocks else _token_mask
        return by_blocks(self.offsets, spans)

    def labels(self, spans: list[tuple[int, int]]) -> list[int]:
        return [token if supervised else IGNORE_INDEX for token, supervised in zip(self.input_ids, self.mask(spans))]

    def token_at(self, char: int) -> int:
        """The index of the first token that starts at or after character `char`."""
        return bisect.bisect_left([start for start, _ in self.offsets], char)

    def token_opening(self, char: int) -> int:
        """The index of the first token of some width that starts at or after character `char`."""
        return next((i for i, (start, end) in enumerate(self.offsets) if start >= char and end > start),
                    len(self.offsets))


def _conversation(messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None,
                  template: str | None, enable_thinking: bool) -> _Conversation:
    """Render (the format's eos appended), detect the format, find one span per assistant message, tokenize."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("conversation must end with an assistant turn to have a training target")
    template = template if template is not None else bundled_template()
    text, blocks = render_with_blocks(messages, tools=tools, template=template, enable_thinking=enable_thinking,
                                      tokenizer=tokenizer)
    format_ = chat_format(template)  # after rendering: a template that fails says so first
    check_tokenizer(format_, tokenizer, template)
    turns = format_.turns
    text += turns.appended_eos or ""
    spans = blocks if format_.masks_by_blocks else turns.assistant_char_spans(text)
    num_assistant = sum(message.get("role") == "assistant" for message in messages)
    if len(spans) != num_assistant:
        if format_.masks_by_blocks:
            raise ValueError(f"{_source(template)}: the chat template renders {len(spans)} {{% generation %}} "
                             f"blocks for {num_assistant} assistant messages; it must put each assistant turn's "
                             "output in one block")
        raise ValueError(f"rendered conversation has {len(spans)} {turns.label} tokens for {num_assistant} "
                         "assistant messages; message text must not contain role tokens and the template must "
                         "render every assistant turn")
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return _Conversation(text, format_, spans, list(encoding["input_ids"]),
                         [tuple(offset) for offset in encoding["offset_mapping"]])


def tokenize_conversation(messages: list[dict[str, Any]], tokenizer: Any, *,
                          tools: list[dict[str, Any]] | None = None, template: str | None = None,
                          loss_on: LossOn = "all_assistant", enable_thinking: bool = True) -> TokenizedSample:
    """Render, tokenize, and label assistant spans (see module docstring).

    Args:
        messages: contract-normalized messages ending with an assistant turn.
        tokenizer: a fast HF tokenizer (needs `return_offsets_mapping`).
        tools, template, enable_thinking: as in `render_conversation`.
        loss_on: "all_assistant" supervises every assistant turn, "last_assistant"
            only the final one (earlier turns become context).
    """
    if loss_on not in LOSS_ON_CHOICES:
        raise ValueError(f"loss_on must be one of {LOSS_ON_CHOICES}, got {loss_on!r}")
    conversation = _conversation(messages, tokenizer, tools, template, enable_thinking)
    spans = conversation.spans[-1:] if loss_on == "last_assistant" else conversation.spans
    return TokenizedSample(conversation.input_ids, conversation.labels(spans),
                           turn_starts=tuple(conversation.token_at(start) for start, _ in conversation.spans))


def tokenize_reply(messages: list[dict[str, Any]], tokenizer: Any, *, tools: list[dict[str, Any]] | None = None,
                   template: str | None = None, enable_thinking: bool = True) -> TokenizedSample:
    """`tokenize_conversation` with labels only from where the last user turn opens (the format's
    `user_start`): the assistant turns that answer it, each with the token that ends it. GLM's
    boundary is the last `<|user|>` token, itself the target that ends the turn before it. A
    template known only by its generation blocks: the blocks of the assistant messages after the
    last user message."""
    conversation = _conversation(messages, tokenizer, tools, template, enable_thinking)
    user_indices = [i for i, message in enumerate(messages) if message.get("role") == "user"]
    if not user_indices:
        raise ValueError("conversation has no user turn to answer")
    pattern = conversation.chat_format.turns.user_start
    if pattern is None:
        answers = sum(message.get("role") == "assistant" for message in messages[user_indices[-1]:])
        return TokenizedSample(conversation.input_ids, conversation.labels(conversation.spans[-answers:]))
    openings = [match.start() for match in pattern.finditer(conversation.text)]
    if len(openings) != len(user_indices):
        raise ValueError(f"rendered conversation has {len(openings)} user turn openings for {len(user_indices)} "
                         "user messages; message text must not contain role tokens")
    boundary = conversation.token_opening(openings[-1])
    labels = conversation.labels(conversation.spans)
    return TokenizedSample(conversation.input_ids, [IGNORE_INDEX] * boundary + labels[boundary:])


def tokenize_row(row: dict[str, Any], tokenizer: Any, *, template: str | None = None,
                 loss_on: LossOn = "all_assistant", enable_thinking: bool = True) -> TokenizedSample:
    """`tokenize_conversation` for a contract-normalized data row (messages + optional tools)."""
    return tokenize_conversation(row["messages"], tokenizer, tools=row.get("tools") or None, template=template,
                                 loss_on=loss_on, enable_thinking=enable_thinking)


def last_turn_span(labels: list[int]) -> tuple[int, int]:
    """[start, end) of the last run of supervised labels (the last assistant turn's tokens)."""
    end = len(labels)
    while end and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start, end
