"""transformers' progress bars kept out of glmtune's output, for the span of one call.

transformers draws a tqdm bar while it writes a model's shards ("Writing model shards") and while
it loads its weights ("Loading weights"). glmtune prints its own one-line report of each export
and load, so inside the family's `save_pretrained` / `load_pretrained` the bars are switched off
with transformers' own switch (`transformers.utils.logging.disable_progress_bar`, which also
switches huggingface_hub's) and each switch is put back as it was on the way out: a caller that
turned the bars off keeps them off, one that has them on gets them back. Warnings and errors are
untouched (they go through transformers' logger, not the bars).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' (and huggingface_hub's) progress bars off inside the block, as they were after it."""
    transformers_on, hub_on = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if transformers_on:
            hf_logging.enable_progress_bar()  # turns huggingface_hub's on too: put it back below
        if hub_on:
            enable_progress_bars()
        else:
            disable_progress_bars()
