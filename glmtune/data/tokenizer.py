"""Tokenizer loading: a model directory's own tokenizer, or the bundled tiny one.

The tiny tokenizer (assets/tiny_tokenizer, built by scripts/train_tiny_tokenizer.py)
is a 4096-entry byte-level BPE trained on the synthetic support-ticket task. It has
every GLM-5 special token, in GLM-5's order and at the top of the vocabulary as in
the real 154880-entry tokenizer, and ships the GLM-5 chat template. Tests and tiny
debug models use it; nothing here touches the network.

Any family's fast tokenizer loads (Qwen's, Llama-3's, GLM's): the chat template's turn format says
which of its tokens open and end turns (turn_formats.py), and one without a pad token pads with its
eos. A tokenizer directory is read as untrusted: its JSON files are parsed bounded first
(`glmtune.io.json_file`: size, nesting, an object), and anything transformers then cannot
load is one ValueError naming the directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.io.json_file import read_json_file
from glmtune.io.regular import check_entries
from glmtune.io.text_limits import clipped

TINY_TOKENIZER_DIR = Path(__file__).parent / "assets" / "tiny_tokenizer"
TINY_VOCAB_SIZE = 4096

# Control tokens: special (dropped by decode(skip_special_tokens=True)). The first ten
# are in GLM-5's id order (<|endoftext|>=154820 ... <|observation|>=154829).
GLM5_CONTROL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
)
# Markup tokens: single ids, but kept by decode because they carry the reasoning and
# tool-call structure that parsers read back from generated text.
GLM5_MARKUP_TOKENS: tuple[str, ...] = (
    "/nothink", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
)
GLM5_SPECIAL_TOKENS: tuple[str, ...] = GLM5_CONTROL_TOKENS + GLM5_MARKUP_TOKENS

# GLM's role tokens delimit turns: GLM has no end-of-turn token, a turn ends at the next one.
# (A tokenizer of another family has its own: turn_formats.py reads the template's.)
ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
EOS_TOKEN = "<|endoftext|>"
# Where a generated GLM assistant turn ends: the end of text, or the next user or tool turn
# (turn_formats.GLM.stop_tokens; chat_template.stop_tokens gives any template's).
CHAT_STOP_TOKENS: tuple[str, ...] = (EOS_TOKEN, "<|user|>", "<|observation|>")

# Files that define a tokenizer's behaviour; cache keys hash exactly these.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)
# The JSON ones: read bounded by glmtune first (`[[[[...` is a RecursionError inside transformers).
TOKENIZER_JSON_FILES = tuple(name for name in TOKENIZER_FILES if name.endswith(".json"))
MAX_TOKENIZER_FILE_BYTES = 512 << 20  # GLM-5's tokenizer.json is about 20 MB


def resolve_tokenizer_dir(path: str | Path | None) -> Path:
    """The directory `load_tokenizer(path)` reads: `path`, or the tiny tokenizer for None."""
    if path is None:
        return TINY_TOKENIZER_DIR
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path} (pass a local model or tokenizer directory)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    check_entries(path, "tokenizer directory entry")  # transformers opens what it finds: a FIFO would block
    return path


def load_tokenizer(path: str | Path | None = None) -> Any:
    """Load a fast HF tokenizer from a local directory, or the bundled tiny one.

    Args:
        path: a model or tokenizer directory (e.g. a GLM-5 checkpoint), or None for
            the tiny tokenizer. Never downloads: the directory must exist locally.

    Returns:
        A `transformers` fast tokenizer (offset mappings are needed for loss masks).
    """
    from transformers import AutoTokenizer  # heavy import; only callers that tokenize pay for it

    directory = resolve_tokenizer_dir(path)
    for name in TOKENIZER_JSON_FILES:  # bounded and objects before transformers parses them unbounded
        if (directory / name).is_file():
            read_json_file(directory / name, "tokenizer file", max_bytes=MAX_TOKENIZER_FILE_BYTES)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers' own errors for a file it cannot use (wrong types, cut short)
        raise ValueError(f"tokenizer in {directory} does not load: {type(exc).__name__}: {clipped(exc)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer in {directory} is not a fast (tokenizers-backed) tokenizer; "
                         "loss masks need offset mappings")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Llama-3's tokenizer has no pad token; packing fills rows with it and never makes it a target.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
