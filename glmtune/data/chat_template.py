"""Chat template rendering and assistant-only loss masks for GLM-5 conversations.

Rendering uses jinja2's immutable sandbox configured like `transformers`
(`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that is `json.dumps` with
`ensure_ascii=False` by default, `raise_exception`, `strftime_now`), so the text is
identical to `tokenizer.apply_chat_template(..., tokenize=False)`. The template is the
tokenizer directory's own (`chat_template.jinja`, else `tokenizer_config.json`) or
the bundled GLM-5 one (templates/glm5.jinja, from the GLM-5 spec section 5).

Loss mask. GLM has no end-of-turn token: a turn ends where the next role token
starts. An assistant turn's supervised span is therefore
  * everything after its `<|assistant|>` token: `</think>` or `<think>...</think>`,
    the visible content, tool calls;
  * plus the token that ends the turn, because the model must generate it to stop:
    the next `<|user|>` / `<|observation|>`, or, after the final turn, an appended
    `<|endoftext|>` (eos).
The `<|assistant|>` token itself is prompt (inference writes it), as is everything
from system/user/tool turns. Spans are found on the rendered text by role tokens,
not by rendering prefixes: the GLM template drops the reasoning of turns before the
last user message, so a prefix does not render the same as the full conversation.
Character spans are mapped to tokens with the tokenizer's offset mapping; a token
straddling a span edge means the role tokens are not atomic tokens (wrong tokenizer).

With `enable_thinking=False`, reasoning (`reasoning_content`, inline `<think>`
blocks) is removed before rendering, so targets teach the model to answer without
thinking; with True it is kept wherever the template shows it.

A template comes with the checkpoint, so it is input, not code: one that does not
compile, that the sandbox stops (an attribute such as `__class__`, a list's `append`),
or that calls `raise_exception` is a ValueError naming the file it was read from
(`ChatTemplate.source`), never a jinja traceback.
"""

from __future__ import annotations

import bisect
import io
import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from glmtune.data.tokenizer import EOS_TOKEN, ROLE_TOKENS
from glmtune.io.regular import open_regular
from glmtune.io.text_limits import parse_json

BUNDLED_TEMPLATE_PATH = Path(__file__).parent / "templates" / "glm5.jinja"
IGNORE_INDEX = -100
LossOn = Literal["all_assistant", "last_assistant"]
LOSS_ON_CHOICES: tuple[str, ...] = ("all_assistant", "last_assistant")

# Role tokens after which the model itself must produce the turn end (see docstring).
_SUPERVISED_TURN_ENDS = ("<|user|>", "<|observation|>")
_ROLE_PATTERN = re.compile("|".join(re.escape(token) for token in ROLE_TOKENS))


@dataclass
class TokenizedSample:
    """One conversation as model inputs: `labels[i]` is `input_ids[i]` where the token
    is an assistant target, else -100 (unshifted, aligned with input_ids)."""

    input_ids: list[int]
    labels: list[int]

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
    """Accept HF's `{% generation %}...{% endgeneration %}` markers and render their body
    unchanged; masks come from role tokens here, not from these markers."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


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


def _render(template: str, **variables: Any) -> str:
    """The compiled template rendered; its failures as ValueErrors naming its source."""
    compiled = _compile(template)
    try:
        return compiled.render(**variables)
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


def render_conversation(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                        template: str | None = None, enable_thinking: bool = True,
                        add_generation_prompt: bool = False, **template_kwargs: Any) -> str:
    """Render contract-normalized messages (see contract.normalize_row) to text.

    Args:
        messages: chat messages; tool-call arguments must already be dicts.
        tools: JSON tool specs shown in the system preamble.
        template: template text; None uses the bundled GLM-5 template.
        enable_thinking: False strips reasoning and, with add_generation_prompt,
            ends the prompt with `</think>` instead of `<think>`.
        add_generation_prompt: append `<|assistant|>` for inference.
        template_kwargs: extra template variables (e.g. clear_thinking).
    """
    if not enable_thinking:
        messages = _without_reasoning(messages)
    return _render(template if template is not None else bundled_template(), messages=messages, tools=tools,
                   add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **template_kwargs)


def assistant_char_spans(text: str, num_assistant_messages: int, loss_on: LossOn = "all_assistant"
                         ) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of supervised assistant text in a rendered conversation.

    `text` must already end with the appended eos; the final assistant span runs to it.
    """
    if loss_on not in LOSS_ON_CHOICES:
        raise ValueError(f"loss_on must be one of {LOSS_ON_CHOICES}, got {loss_on!r}")
    roles = list(_ROLE_PATTERN.finditer(text))
    assistant_indices = [i for i, match in enumerate(roles) if match.group() == "<|assistant|>"]
    if len(assistant_indices) != num_assistant_messages:
        raise ValueError(f"rendered conversation has {len(assistant_indices)} <|assistant|> tokens for "
                         f"{num_assistant_messages} assistant messages; message text must not contain role "
                         "tokens and the template must render every assistant turn")
    spans = []
    for i in assistant_indices:
        start = roles[i].end()
        if i + 1 == len(roles):
            end = len(text)
        elif roles[i + 1].group() in _SUPERVISED_TURN_ENDS:
            end = roles[i + 1].end()
        else:
            end = roles[i + 1].start()
        spans.append((start, end))
    return spans[-1:] if loss_on == "last_assistant" else spans


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
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


def tokenize_conversation(messages: list[dict[str, Any]], tokenizer: Any, *,
                          tools: list[dict[str, Any]] | None = None, template: str | None = None,
                          loss_on: LossOn = "all_assistant", enable_thinking: bool = True) -> TokenizedSample:
    """Render, append eos, tokenize, and label assistant spans (see module docstring).

    Args:
        messages: contract-normalized messages ending with an assistant turn.
        tokenizer: a fast HF tokenizer (needs `return_offsets_mapping`).
        tools, template, enable_thinking: as in `render_conversation`.
        loss_on: "all_assistant" supervises every assistant turn, "last_assistant"
            only the final one (earlier turns become context).
    """
    num_assistant = sum(message.get("role") == "assistant" for message in messages)
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("conversation must end with an assistant turn to have a training target")
    text = render_conversation(messages, tools=tools, template=template, enable_thinking=enable_thinking)
    text += EOS_TOKEN
    spans = assistant_char_spans(text, num_assistant, loss_on)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    mask = _token_mask([tuple(offset) for offset in encoding["offset_mapping"]], spans)
    labels = [token if supervised else IGNORE_INDEX for token, supervised in zip(input_ids, mask)]
    return TokenizedSample(input_ids=input_ids, labels=labels)


def tokenize_row(row: dict[str, Any], tokenizer: Any, *, template: str | None = None,
                 loss_on: LossOn = "all_assistant", enable_thinking: bool = True) -> TokenizedSample:
    """`tokenize_conversation` for a contract-normalized data row (messages + optional tools)."""
    return tokenize_conversation(row["messages"], tokenizer, tools=row.get("tools") or None, template=template,
                                 loss_on=loss_on, enable_thinking=enable_thinking)
