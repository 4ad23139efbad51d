"""Small tokenizers of the chat families glmtune knows, built in the test (nothing downloaded), and
a conversation that exercises their turns.

Each is a byte-level BPE trained here (`tokenizers`) on a few conversations rendered with the
family's template, holding that family's special tokens as single tokens (as the published
tokenizers do: special ones dropped by `decode(skip_special_tokens=True)`, markup ones such as
Qwen's `<think>` kept), saved as a `PreTrainedTokenizerFast` directory with the template, so it
loads through `AutoTokenizer` as a model directory's tokenizer does.

The templates under chat_templates/ are the published texts, as trl 1.16.0 ships them
(trl/chat_templates/): `qwen3.jinja` (Qwen3's, thinking switch included), `llama3_1.jinja`
(Llama-3.1-Instruct's, tools in the first user message), `gemma.jinja` (Gemma's: a format glmtune
does not know), and trl's training variants with `{% generation %}` blocks, `qwen3_training.jinja`
(ChatML) and `gemma_training.jinja` (Gemma).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from glmtune.data.chat_template import render_conversation
from glmtune.data.contract import normalize_row
from glmtune.data.synthetic import generate_rows

TEMPLATES = Path(__file__).parent / "chat_templates"

TOOL = {"type": "function", "function": {"name": "lookup_order", "description": "Finds an order",
                                         "parameters": {"type": "object",
                                                        "properties": {"order_id": {"type": "string"}}}}}
# A system prompt, a tool call and its result, a second user turn, reasoning on the last answer.
CONVERSATION = normalize_row({"tools": [TOOL], "messages": [
    {"role": "system", "content": "You triage tickets."},
    {"role": "user", "content": "Where is order 7?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": "7"}}}]},
    {"role": "tool", "content": '{"status": "shipped"}'},
    {"role": "assistant", "content": "It shipped."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": "Be polite."},
]})


@dataclass(frozen=True)
class Family:
    template: str  # file under chat_templates/
    special: tuple[str, ...]  # special tokens (single ids, dropped by decode(skip_special_tokens=True))
    markup: tuple[str, ...] = ()  # added tokens kept by decode
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None

    def template_text(self) -> str:
        return (TEMPLATES / self.template).read_text(encoding="utf-8")


_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_LLAMA_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>")
_GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
FAMILIES = {
    "qwen3": Family("qwen3.jinja", _QWEN_SPECIAL, _QWEN_MARKUP, eos="<|im_end|>", pad="<|endoftext|>"),
    "qwen3_training": Family("qwen3_training.jinja", _QWEN_SPECIAL, _QWEN_MARKUP, eos="<|im_end|>",
                             pad="<|endoftext|>"),
    "llama3_1": Family("llama3_1.jinja", _LLAMA_SPECIAL, bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "gemma": Family("gemma.jinja", _GEMMA_SPECIAL, bos="<bos>", eos="<eos>", pad="<pad>"),
    "gemma_training": Family("gemma_training.jinja", _GEMMA_SPECIAL, bos="<bos>", eos="<eos>", pad="<pad>"),
}


def _corpus(family: Family, extra: list[str]) -> list[str]:
    """Texts the BPE learns from: support tickets as the family's template renders them (so a ticket
    packs into a few hundred tokens), then `extra`."""
    rows = [normalize_row(row) for row in generate_rows(200, seed=11)]
    tickets = []
    for row in rows:
        messages = row["messages"]
        if family.template.startswith("gemma"):  # no system turn, no tools: the users' and answers' text
            tickets.append("\n".join(str(m.get("content") or "") for m in messages))
        else:
            tickets.append(render_conversation(messages, tools=row.get("tools"), template=family.template_text()))
    return tickets + extra


def build_tokenizer(directory: Path, name: str, *, vocab_size: int = 1024, extra: list[str] | None = None) -> Any:
    """The family's tokenizer saved into `directory` (tokenizer files + chat_template.jinja); returned loaded."""
    family = FAMILIES[name]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_corpus(family, extra or []), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=family.bos, eos_token=family.eos,
                                        pad_token=family.pad)
    tokenizer.add_tokens(list(family.markup))
    tokenizer.chat_template = family.template_text()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return tokenizer
