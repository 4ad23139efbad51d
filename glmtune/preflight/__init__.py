"""`glmtune preflight`: the ten checks that should pass before a real run, each with its evidence.

The checks follow the "proof of compatibility" of a GLM-5 fine-tuning guide, in order:

    1  pins.py          versions, commit, model revision, recipe and config hashes
    2  shards.py        every shard present and intact; disk space for what follows
    3  loading.py       config and tokenizer without weights; architecture; chat template
    4  trainable.py     what trains, by group; LoRA targets that train nothing
    5  step.py          one forward, backward and optimizer step on the recipe's data
    6  step.py          finite, non-zero gradient norms per path
    7  resume.py        save, SIGKILL, resume in a fresh process, the same loss
    8  export.py        HF / PEFT export reloaded by transformers (+ PEFT): the same logits
    9  generation.py    base and trained outputs under one greedy decoding
   10  multiprocess.py  the recipe's parallel layout scaled down (layout.py), against one process

Around them: context.py (the user's run and the scratch runs that stand in for it: an HF
checkpoint's first K layers, the model spec's `truncated_view`, for checks 5-10 on a model
too large to step), runs.py (the scratch training runs), trained.py (base and trained models
from them), result.py (one check's outcome), runner.py (order, dependencies, skips) and
report.py (preflight.md, preflight.json, the console table). The model is reached only
through its family's spec (`glmtune.models.registry`). docs/preflight.md says what each
check proves and how to run it on a real checkpoint.
"""
