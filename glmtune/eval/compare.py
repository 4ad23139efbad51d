"""`glmtune eval --compare TARGET` (repeatable): more models on the same scorecard, reported beside
the base and the candidate, not gated.

Each target (`targets.py`: an endpoint, or a local HF directory, run or adapter; name=, model=,
api=, key-env=) answers the same suite, with the same prompt wrapper and decoding, and becomes one
more arm of the scorecard: its values and deltas against the base, its operations (parameters,
active parameters, tokens/s and peak memory when it runs here), its failures. The gates still
decide the candidate against the base. A local target uses the same tokenizer and chat template
as the other local models (a scorecard compares models under one prompt wrapper); an endpoint
takes the shared endpoint options (--api unless its api= says otherwise, --concurrency,
--timeout, --retries, --max-response-bytes) and the key in its key-env variable, which nothing
written or printed holds (`redact`). Under sharded evaluation each rank loads its shards of one
model, a layout a compare arm does not take: --compare with --nproc-per-node is refused.
"""

from __future__ import annotations

import dataclasses

from glmtune.data.chat_template import load_chat_template
from glmtune.eval.endpoint_source import EndpointOptions, resolve_endpoint
from glmtune.eval.models import resolve_model
from glmtune.eval.targets import Target, check_labels, parse_target, redact, secrets_of

__all__ = ["ROLE", "compare_targets", "resolve_targets", "check_prompting", "redact", "secrets_of"]

ROLE = "compare"
RESERVED = ("base", "candidate", "candidate-merged")  # eval's own labels
SHARDED = ("--compare with --nproc-per-node: a sharded evaluation lays out the base and the candidate over the "
           "ranks; evaluate the compared models in one process")


def compare_targets(specs: list[str], sharded: bool) -> list[Target]:
    """The targets of the `--compare` values, each checked (one sentence), before anything is read."""
    if specs and sharded:
        raise ValueError(SHARDED)
    targets = [parse_target(spec) for spec in specs]
    check_labels(targets, RESERVED)
    return targets


def _endpoint_options(shared: EndpointOptions, t: Target) -> EndpointOptions:
    return dataclasses.replace(shared, api=t.api or shared.api, base_model=None, candidate_model=t.model,
                               api_key_env=t.key_env)


def resolve_targets(targets: list[Target], shared: EndpointOptions) -> list:
    """Each target's model (an endpoint asked for its /v1/models, or a local model resolved as a
    candidate is: a run directory is the model it trained), labelled with the target's label."""
    models = []
    for t in targets:
        try:
            if t.is_endpoint:
                options = _endpoint_options(shared, t)
                model = resolve_endpoint(t.source, "candidate", options)
            else:
                model = resolve_model(t.source, "candidate")
        except ValueError as exc:  # named by its option: --compare TARGET (model= for the served model)
            raise ValueError(f"--compare {t.spec}: " + str(exc).replace("--candidate-model", "model=").replace(
                "--candidate ", "")) from None
        models.append(dataclasses.replace(model, label=t.label, role=ROLE))
    return models


def check_prompting(found: tuple, models: list, hashes) -> None:
    """Every local compared model uses the tokenizer and chat template the suite's prompts are
    rendered with (`found`: their directory and template); `hashes(directory, template)` -> the pair
    of hashes compared (evaluate's). ValueError naming the target."""
    want = hashes(found[0], found[1])
    for model in models:
        if model.kind == "endpoint":
            continue
        theirs = hashes(model.tokenizer_dir, load_chat_template(model.tokenizer_dir))
        for what, a, b in (("tokenizer", want[0], theirs[0]), ("chat template", want[1], theirs[1])):
            if a != b:
                raise ValueError(f"--compare {model.source}: its {what} ({model.tokenizer_dir}: sha256 {b[:12]}…) "
                                 f"is not the one the suite's prompts are rendered with ({found[0]}: sha256 "
                                 f"{a[:12]}…); a scorecard compares models under one prompt wrapper")
