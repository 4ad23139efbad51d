"""General capability as loss: nats per token on a held-out plain text outside the tuned task.

The text (UTF-8, no chat template, no special tokens) is tokenized once, cut to its first
`max_tokens` tokens, and split into non-overlapping windows of `window` tokens; each window is
one forward pass and every token after a window's first is predicted from the tokens before it
in that window. The loss is the mean cross-entropy over all predicted tokens, in nats: a
fine-tune that damaged general language modelling raises it (the gate `max_increase`).
Windows are identical for every model (same tokenizer: `glmtune eval` refuses different ones).

Only a prefix of the file is read and tokenized: BYTES_PER_TOKEN bytes per scored token, far more
than any tokenizer's average (~4 for English), so the prefix holds `max_tokens` tokens; a 90 MB
file scored on its first 256 tokens costs 16 KiB, not the whole file and its token list.
"""

from __future__ import annotations

import codecs
import re
from pathlib import Path


from glmtune.eval.scorers.base import MetricDef
from glmtune.eval.teacher_forced import one_document, summed_loss
from glmtune.io.regular import open_regular

BYTES_PER_TOKEN = 64
GENERAL_TEXT_METRIC = MetricDef("loss", "mean next-token loss on the held-out general text", "nats_per_token", False)


def read_prefix(path: Path, max_bytes: int) -> str:
    """The file's text up to `max_bytes` bytes; when that cuts it, up to its last whitespace, so
    the last word is whole and tokenizes as it does in the full text."""
    with open_regular(path, "general_text") as f:  # a FIFO would block the read
        data = f.read(max_bytes + 1)
    cut = len(data) > max_bytes
    try:
        # Incremental: a multi-byte character the cut splits is held back, not an error.
        text = codecs.getincrementaldecoder("utf-8")().decode(data[:max_bytes], final=not cut)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: general_text must be UTF-8 ({exc.reason} at byte {exc.start})") from None
    whitespace = re.search(r"\s\S*\Z", text) if cut else None
    return text[:whitespace.start()] if whitespace else text


def text_windows(tokenizer, path: Path, max_tokens: int, window: int) -> list[list[int]]:
    """Token windows of the text (the last one may be shorter; a 1-token tail is dropped)."""
    text = read_prefix(path, max_tokens * BYTES_PER_TOKEN)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError(f"{path}: general_text has fewer than 2 tokens; nothing to score")
    return windows


def general_text_loss(model, loss, windows: list[list[int]]) -> tuple[float, int]:
    """(mean loss in nats per predicted token, number of predicted tokens); `loss`: the model
    family's `spec.compute.loss`, each window one document whose every token but the first is predicted."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for ids in windows:
            window_sum, window_count = summed_loss(model, loss, one_document(ids, ids))
            total += window_sum
            count += window_count
    finally:
        model.train(was_training)
    return total / count, count
