"""A kept answer's top-K records laid on the tokens the student trains on.

The training side (`train.objective: distill`) tokenizes each row as SFT does (the chat template,
the teacher's tokenizer, which the student must share for the KL) and reads one sidecar position per
supervised token of the row's last assistant turn. Those tokens are not exactly the teacher's: the
template may add tokens the teacher never generated (GLM's `</think>` of a non-thinking turn sits in
the prompt the teacher saw but in the turn the student learns), strip the answer's edges (a leading
space tokenizes differently), and end the turn with its own end-of-turn token.

So a record holds one position per supervised token of the rendered last turn. The teacher's tokens
(its answer, and the end-of-turn token it stopped at when the engine reports it) are matched to
them with `difflib.SequenceMatcher` (longest common runs, in order): a matched position carries the
teacher's top-K before that token and `generated` = the token; any other carries no entry (ids -1,
log-probs -inf, generated -1), which the loss leaves out. The manifest counts matched positions.
"""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np

from glmtune.data.chat_template import last_turn_span, tokenize_row
from glmtune.distill.teacher_logprobs import TopK


def rendered_targets(row: dict[str, Any], tokenizer: Any, template: str, enable_thinking: bool) -> list[int]:
    """The supervised tokens of the row's last assistant turn as training renders it (the last run of
    supervised labels)."""
    labels = list(tokenize_row(row, tokenizer, template=template, enable_thinking=enable_thinking).labels)
    start, end = last_turn_span(labels)
    return labels[start:end]



def align(topk: TopK, rendered: list[int]) -> TopK:
    """`topk` (the teacher's positions) on the `rendered` positions (module docstring)."""
    n, k = len(rendered), topk.ids.shape[1]
    ids = np.full((n, k), -1, np.int32)
    logprobs = np.full((n, k), -np.inf, np.float32)
    generated = np.full(n, -1, np.int32)
    matcher = difflib.SequenceMatcher(None, topk.generated.tolist(), rendered, autojunk=False)
    for block in matcher.get_matching_blocks():
        teacher, student = slice(block.a, block.a + block.size), slice(block.b, block.b + block.size)
        ids[student], logprobs[student], generated[student] = topk.ids[teacher], topk.logprobs[teacher], \
            topk.generated[teacher]
    return TopK(generated, ids, logprobs)
