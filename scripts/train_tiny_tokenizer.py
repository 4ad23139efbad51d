"""Train the bundled tiny GLM-5-style tokenizer (glmtune/data/assets/tiny_tokenizer).

A byte-level BPE with exactly 4096 entries: 4064 learned (256 byte symbols + merges)
followed by GLM-5's 32 special tokens in GLM-5's order, so the control tokens sit at
the top of the vocabulary as in the real tokenizer (<|endoftext|> first). Pre-
tokenization follows GLM's style: a regex split (letters, 1-3 digit groups,
punctuation, whitespace) then byte-level mapping, so digits of ids tokenize the same
wherever they appear (the synthetic task copies order ids into tool calls).

Corpus: the synthetic support-ticket conversations rendered with the GLM-5 template
(special tokens cut out so BPE never learns pieces of them). Those alone saturate at
about 1.9k entries (the task has a small vocabulary), so Python's own reference
documentation (`pydoc_data.topics`, shipped with every CPython) is appended as
general English to fill the vocabulary; synthetic words are far more frequent, so
their merges come first. Regenerating on another Python version may change the
tail of the merges; the committed files are the reference.

Usage: .venv/bin/python scripts/train_tiny_tokenizer.py [--out DIR] [--rows N] [--seed S]
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from glmtune.data.chat_template import bundled_template, render_conversation
from glmtune.data.synthetic import generate_rows
from glmtune.data.tokenizer import (
    EOS_TOKEN,
    GLM5_CONTROL_TOKENS,
    GLM5_MARKUP_TOKENS,
    GLM5_SPECIAL_TOKENS,
    TINY_TOKENIZER_DIR,
    TINY_VOCAB_SIZE,
)

# GLM-4/GLM-5 style split: contractions, words (with one leading non-letter), 1-3 digit
# groups, punctuation runs, newlines, other whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MODEL_MAX_LENGTH = 202752  # GLM-5 max_position_embeddings


def corpus(num_rows: int, seed: int) -> Iterator[str]:
    """Text pieces to train on, with every special token removed."""
    special = re.compile("|".join(re.escape(token) for token in GLM5_SPECIAL_TOKENS))
    for row in generate_rows(num_rows, seed=seed):
        for thinking in (True, False):
            text = render_conversation(row["messages"], tools=row.get("tools"), enable_thinking=thinking)
            yield from (piece for piece in special.split(text) if piece)
    for key in sorted(pydoc_data.topics.topics):
        yield pydoc_data.topics.topics[key]


def build_tokenizer(num_rows: int, seed: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets exact; loss masks map character spans to tokens.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    num_learned = TINY_VOCAB_SIZE - len(GLM5_SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=num_learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(num_rows, seed), trainer)
    if tokenizer.get_vocab_size() != num_learned:
        raise ValueError(f"BPE learned {tokenizer.get_vocab_size()} entries, need {num_learned}; add corpus text")
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in GLM5_CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in GLM5_MARKUP_TOKENS])
    assert tokenizer.get_vocab_size() == TINY_VOCAB_SIZE
    return tokenizer


def save(tokenizer: Tokenizer, out: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # Control tokens other than eos are listed as extra special tokens, as in GLM's own
    # tokenizer_config, so `all_special_tokens` and skip_special_tokens cover them.
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        extra_special_tokens=[token for token in GLM5_CONTROL_TOKENS if token != EOS_TOKEN])
    hf_tokenizer.chat_template = bundled_template()
    # Write to a scratch dir first so a failed run never leaves a half-written asset.
    with tempfile.TemporaryDirectory() as scratch:
        hf_tokenizer.save_pretrained(scratch)
        reloaded = AutoTokenizer.from_pretrained(scratch, local_files_only=True)
        assert len(reloaded) == TINY_VOCAB_SIZE, len(reloaded)
        for token in GLM5_SPECIAL_TOKENS:
            assert reloaded.encode(token, add_special_tokens=False) == [reloaded.convert_tokens_to_ids(token)]
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(scratch, out)
    # mkdtemp creates 0700 directories; assets must be readable by everyone.
    out.chmod(0o755)
    for path in out.iterdir():
        path.chmod(0o644)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_TOKENIZER_DIR)
    parser.add_argument("--rows", type=int, default=4000, help="synthetic conversations in the corpus")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    tokenizer = build_tokenizer(args.rows, args.seed)
    save(tokenizer, args.out)
    ids = {token: tokenizer.token_to_id(token) for token in
           ("<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>")}
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"saved {args.out} ({tokenizer.get_vocab_size()} tokens, {size / 1024:.0f} KiB): {ids}")


if __name__ == "__main__":
    main()
