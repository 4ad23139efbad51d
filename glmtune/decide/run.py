"""`glmtune decide`: every check first, then the arms, one model at a time, then the decision on disk.

Order (as `glmtune eval`'s, whose steps these are: `glmtune.eval.evaluate`): the suite (it must
have gates, none naming an eval model label), the cost options, the alternatives' specs, the
models (`--base`, each `--compare`; an endpoint answers GET /v1/models), the output directory
(refused before any work), one tokenizer and chat template for the local models, the sets, the
examples (data contract, none from the eval set's groups), the documents and their index, the
recipe's plan, the tool functions and the reference tool calls, the scorers' row checks, and every
arm's every prompt rendered once. Then the base's arms with one load of the base (its three arms
answer in turn), then each alternative, loaded and freed in turn. Last the scorecard (eval's, the
arms as its columns, every gate checked in every arm), the verdict (`verdict.py`) and the
decision directory (`report.py`), written in one step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glmtune.data.chat_template import control_tokens
from glmtune.data.tokenizer import load_tokenizer
from glmtune.decide.arms import ArmSpec, prompted_arm, retrieval_arm
from glmtune.decide.cost import CostOptions, plan_cost
from glmtune.decide.embeddings import EmbeddingIndex, parse_retriever
from glmtune.decide.documents import DEFAULT_CHUNK_WORDS, DEFAULT_OVERLAP, read_documents
from glmtune.decide.examples import MAX_SHOTS, SHOTS_BY, eval_split_keys, load_examples
from glmtune.decide.grounding import grounding_metrics
from glmtune.decide.passages import DEFAULT_PASSAGES, MAX_PASSAGES, Passages
from glmtune.decide.report import decision_document, redact, write_decision
from glmtune.decide.targets import Target, check_key_env, check_labels, parse_target
from glmtune.decide.verdict import Arm, decide
from glmtune.eval.answering import Prompting
from glmtune.eval.endpoint import EndpointOptions, is_endpoint, resolve_endpoint
from glmtune.eval.evaluate import (  # eval's own steps, in run_eval's order (its public API)
    build_scorecard, check_prompts, evaluate_model, implicit_margins, prompting_dir, reference_tool_results)
from glmtune.eval.gates import evaluate_gates
from glmtune.eval.general_text import text_windows
from glmtune.eval.models import Fingerprints, resolve_model
from glmtune.eval.placement import Placement, check_device as placement_check_device
from glmtune.eval.sharded import ShardedLayout
from glmtune.eval.sets import check_rows, load_sets
from glmtune.eval.suite import Suite, load_suite
from glmtune.eval.targets import without_secrets
from glmtune.eval.tools import ToolExecutor
from glmtune.io.outputs import check_output


@dataclass
class DecideOptions:
    suite: str
    base: str
    out: str | None = None
    overwrite: bool = False
    examples: str | None = None
    shots: int | None = None  # default 3 with --examples
    shots_by: str | None = None  # default fixed with --examples
    docs: str | None = None
    passages: int | None = None  # default 3 with --docs
    chunk_words: int | None = None
    chunk_overlap: int | None = None
    compare: list[str] = field(default_factory=list)
    base_key_env: str | None = None
    endpoint: EndpointOptions = field(default_factory=EndpointOptions)  # the base's and the shared options
    device: str = "auto"
    dtype: torch.dtype | None = None
    cost: CostOptions = field(default_factory=CostOptions)
    sharded: ShardedLayout | None = None  # one rank of a torchrun job (eval's layout), else one process
    retriever: str | None = None  # bm25 (None) or embeddings:DIR, with --docs

    def check(self) -> None:
        """The device, and the arms' options: each given only with what it applies to, each in range
        (one sentence); before anything is read."""
        check_device(self.device, self.sharded is not None)
        for option, value, needs, given in (("--shots", self.shots, "--examples", self.examples),
                                            ("--shots-by", self.shots_by, "--examples", self.examples),
                                            ("--passages", self.passages, "--docs", self.docs),
                                            ("--chunk-words", self.chunk_words, "--docs", self.docs),
                                            ("--chunk-overlap", self.chunk_overlap, "--docs", self.docs),
                                            ("--retriever", self.retriever, "--docs", self.docs)):
            if value is not None and given is None:
                raise ValueError(f"{option} applies to the {'prompted' if needs == '--examples' else 'retrieval'} "
                                 f"arm, which runs with {needs}; add {needs}")
        if self.shots is not None and not 1 <= self.shots <= MAX_SHOTS:
            raise ValueError(f"--shots {self.shots}: expected 1 to {MAX_SHOTS} examples")
        if self.shots_by is not None and self.shots_by not in SHOTS_BY:
            raise ValueError(f"--shots-by {self.shots_by}: expected one of {', '.join(SHOTS_BY)}")
        parse_retriever(self.retriever)
        if self.passages is not None and not 1 <= self.passages <= MAX_PASSAGES:
            raise ValueError(f"--passages {self.passages}: expected 1 to {MAX_PASSAGES} passages")
        if self.base_key_env is not None:
            if not is_endpoint(self.base):
                raise ValueError(f"--base-key-env applies to an endpoint --base (http(s)://HOST:PORT/v1); --base "
                                 f"{self.base} is a local model")
            check_key_env("--base-key-env", self.base_key_env)
        if self.endpoint.api is not None and not is_endpoint(self.base):
            raise ValueError("--api applies to an endpoint --base; give an alternative its own with "
                             "--compare URL,api=chat")


def check_device(device: str, sharded: bool) -> None:
    """decide's `--device`, refused as eval's is (`placement.check_device`, decide named), before
    anything is read or launched."""
    placement_check_device(device, sharded, "decide")


def _check_suite(suite: Suite) -> None:
    if not suite.file.gates:
        raise ValueError(f"{suite.path}: no gates: decide compares the arms by the suite's gates (its targets); "
                         "add gates (docs/eval.md, Gates)")
    for i, gate in enumerate(suite.file.gates):
        if gate.model is not None:
            raise ValueError(f"{suite.path}: gates[{i}].model: {gate.model}: decide checks every gate in every arm; "
                             "remove model (it names an eval candidate label)")
    if suite.domain_text_path is not None:  # continued pretraining's held-out documents: eval scores them
        raise ValueError(f"{suite.path}: domain_text: decide compares ways to serve a task (prompts, retrieval, "
                         "fine-tunes) by its sets' gates and does not score held-out domain text; use glmtune eval "
                         "for a continued-pretraining run's domain perplexity (docs/eval.md)")


def _resolve(arg: str, label: str, role: str, options: EndpointOptions, option: str):
    """The model `arg` names, labelled `label` (`role`: eval's, base or candidate): an endpoint (its
    /v1/models asked) or a local model."""
    if is_endpoint(arg):
        try:
            source = resolve_endpoint(arg, role, options)
        except ValueError as exc:  # eval names its own options; decide's are --base / --compare ...,model=
            raise ValueError(str(exc).replace("--candidate-model", f"model= ({option},model=ID)").replace(
                "--candidate", "--compare")) from None
    else:
        source = resolve_model(arg, role)
    return dataclasses.replace(source, label=label, role=role)


def _target_options(shared: EndpointOptions, t: Target) -> EndpointOptions:
    return dataclasses.replace(shared, api=t.api, base_model=None, candidate_model=t.model, api_key_env=t.key_env)


def _models(o: DecideOptions) -> tuple[ArmSpec, list[ArmSpec]]:
    """The base arm and one arm per alternative, their models resolved (endpoints asked)."""
    targets = [parse_target(spec) for spec in o.compare]
    check_labels(targets)
    first_endpoint = next((a for a in [o.base] + [t.source for t in targets] if is_endpoint(a)), o.base)
    try:
        o.endpoint.check(o.base, first_endpoint)  # ranges; --base-model with an endpoint --base
    except ValueError as exc:  # in eval's words: "(--base or --candidate http(s)://HOST:PORT/v1)"
        raise ValueError(str(exc).replace("--candidate", "--compare")) from None
    base_options = dataclasses.replace(o.endpoint, api_key_env=o.base_key_env)
    base = ArmSpec("base", "base", _resolve(o.base, "base", "base", base_options, "--base"), [],
                   "the model as it is", base_options if is_endpoint(o.base) else None,
                   info={"api_key_env": o.base_key_env} if o.base_key_env else {})
    alternatives = []
    for t in targets:
        options = _target_options(o.endpoint, t)
        model = _resolve(t.source, t.label, "candidate", options, f"--compare {t.source}")
        via = f" ({model.model} over the {model.api} API)" if t.is_endpoint else ""
        alternatives.append(ArmSpec(t.label, "alternative", model, [], f"{model.kind} {t.source}{via}",
                                    options if t.is_endpoint else None, t.cost_per_1k,
                                    info={"api_key_env": t.key_env} if t.key_env else {}))
    return base, alternatives


def _run_source(suite: Suite, arms: list[ArmSpec]):
    """The run directory whose held-out split a `run_split` set reads: the base's, else the first
    alternative's; ValueError when a set needs one and none is a run directory."""
    runs = [a.model for a in arms if a.model.kind == "run"]
    needs = [s.name for s in suite.sets if s.run_split is not None]
    if needs and not runs:
        raise ValueError(f"set {needs[0]} reads run_split: {suite.sets[0].run_split or 'validation'}, the held-out "
                         "split of a run directory, and neither --base nor a --compare is one; give the set a path")
    return runs[0] if runs else arms[0].model


def _prompting(arms: list[ArmSpec], tokenizer: Path | None) -> tuple[Path, str]:
    """One tokenizer directory and chat template for every arm: the local models' (all the same,
    eval's check), or --tokenizer's when none is local."""
    local = [a.model for a in arms if a.model.kind != "endpoint"]
    if not local and tokenizer is None:
        raise ValueError("--tokenizer DIR is needed: no model is local, and the suite's prompts are rendered with a "
                         "tokenizer and chat template on disk (the served model's HF directory)")
    first = local[0] if local else arms[0].model
    found = prompting_dir(first, first, tokenizer)
    for model in local[1:]:
        try:
            found = prompting_dir(first, model, tokenizer)
        except ValueError as exc:  # eval's words: "the base and the candidate use different tokenizers ..."
            raise ValueError(f"--compare {model.source}: {exc}") from None
    return found


def _reads(suite: Suite, arms: list[ArmSpec], o: DecideOptions) -> list[tuple[str, Path]]:
    reads = [("SUITE", suite.path)] + [(f"set {s.name}", s.path) for s in suite.sets if s.path is not None]
    reads += [r for a in arms for r in a.model.reads()]
    reads += [(option, Path(value)) for option, value in (("--tokenizer", o.endpoint.tokenizer),
                                                          ("--examples", o.examples), ("--docs", o.docs)) if value]
    embedder = parse_retriever(o.retriever)
    reads += [("--retriever", embedder)] if embedder is not None else []
    return reads


def run_decide(o: DecideOptions, log: Callable[[str], None] = print) -> tuple[dict[str, Any] | None, Path]:
    """Run every arm and write the decision directory; returns (the decision as written, its
    directory); sharded (`o.sharded`), the ranks other than 0 return None and write nothing.
    ValueError: user errors, before any model runs. No API key the endpoints were given reaches the
    log, an error message, the decision or a file (a server may echo one back)."""
    secrets = _secrets(o)
    try:
        return _run(o, lambda message: log(redact(message, secrets)), secrets)
    except Exception as exc:  # a server may echo the key back in an error
        clean = without_secrets(exc, secrets)
        if clean is None:
            raise
        raise clean from None


@dataclass
class _Inputs:
    """What every check before the models run produced (`_inputs`)."""

    suite: Suite
    arms: list[ArmSpec]  # the base, the alternatives; the prompt arms are added once the tools are checked
    out: Path
    reads: list[tuple[str, Path]]
    tokenizer_dir: Path
    template: str
    loaded: list
    pool: Any
    passages: Passages | None


def _inputs(o: DecideOptions) -> _Inputs:
    """Every check that needs no model loaded, in eval's order (module docstring); ValueError."""
    o.check()  # the options alone first: a device that cannot be used is refused before the suite is read
    suite = load_suite(o.suite)
    _check_suite(suite)
    o.cost.check()
    base, alternatives = _models(o)
    if o.sharded is not None and any(a.model.kind == "endpoint" for a in [base] + alternatives):
        raise ValueError("--nproc-per-node with an endpoint model: the engine holds that model; decide it in one "
                         "process")
    out = Path(o.out) if o.out is not None else Path("decide") / suite.name
    reads = _reads(suite, [base] + alternatives, o)
    check_output(out, overwrite=o.overwrite, sources=reads, what="--out", command="decide")
    tokenizer_dir, template = _prompting([base] + alternatives, o.endpoint.tokenizer)
    # the rows are held to the control tokens of the template and tokenizer the prompts are rendered with
    forbidden = control_tokens(template, load_tokenizer(tokenizer_dir))
    loaded = load_sets(suite, _run_source(suite, [base] + alternatives), forbidden)
    base.sets = loaded
    pool = load_examples(o.examples, eval_split_keys(loaded), o.shots_by or "fixed", forbidden) if o.examples else None
    passages = _passages(o) if o.docs else None
    return _Inputs(suite, [base] + alternatives, out, reads, tokenizer_dir, template, loaded, pool, passages)


def _passages(o: DecideOptions) -> Passages:
    """The documents' chunks and their index: BM25's, or the embedding model's (`--retriever`)."""
    corpus = read_documents(o.docs, o.chunk_words or DEFAULT_CHUNK_WORDS,
                            DEFAULT_OVERLAP if o.chunk_overlap is None else o.chunk_overlap)
    embedder = parse_retriever(o.retriever)
    if embedder is None:
        return Passages(corpus, o.passages or DEFAULT_PASSAGES)
    index = EmbeddingIndex(embedder, [chunk.text for chunk in corpus.chunks])
    return Passages(corpus, o.passages or DEFAULT_PASSAGES, index, f"embeddings:{embedder}")


def _quiet(message: str) -> None:
    """The log of a rank other than 0: rank 0 speaks for the job."""


def _run(o: DecideOptions, log: Callable[[str], None], secrets: list[str]) -> tuple[dict[str, Any] | None, Path]:
    i = _inputs(o)
    suite, loaded, base = i.suite, i.loaded, i.arms[0]
    placement = Placement.choose(o.device, o.dtype, o.sharded, base.model)
    log = log if placement.is_main else _quiet
    cost = placement.on_main(lambda: plan_cost(o.cost))
    fingerprints = Fingerprints()
    prints = placement.on_main(lambda: {a.label: a.model.fingerprint() if a.model.kind == "endpoint"
                                        else fingerprints.of(a.model) for a in i.arms})
    tokenizer = load_tokenizer(i.tokenizer_dir)
    prompting = Prompting(tokenizer, i.template, suite.file.enable_thinking, suite.file.decoding)
    g = suite.file.general_text
    windows = text_windows(tokenizer, suite.general_text_path, g.max_tokens, g.window) if g is not None else None
    with ToolExecutor(suite.file.tools.functions, suite.file.tools.timeout_s, suite.dir) as executor:
        executor.check()
        reference_tool_results(loaded, executor, placement)
        check_rows(loaded)
        arms = [base] + ([prompted_arm(base, i.pool, o.shots or 3)] if i.pool else []) + (
            [retrieval_arm(base, i.passages)] if i.passages else []) + i.arms[1:]
        for arm in arms:
            arm.sets = arm.sets or loaded
            check_prompts(arm.sets, prompting)
        prints.update({a.label: prints["base"] for a in arms if a.kind in ("prompted", "retrieval")})
        results = _run_arms(arms, prompting, executor if suite.file.tools.functions else None, windows, placement, log)
    decision = _decision(suite, loaded, arms, prints, results, i.template, o, cost)
    written = (write_decision(i.out, o.overwrite, i.reads, suite, loaded, decision, secrets)
               if placement.is_main else None)
    placement.close()
    return written, i.out


def _run_arms(arms: list[ArmSpec], prompting, executor, windows, placement: Placement, log) -> dict[str, dict]:
    """Each arm's results (eval's per-model results); the base's arms share one load of the base."""
    results: dict[str, dict] = {}
    own = [a for a in arms if a.kind != "alternative"]
    backend = placement.load(own[0].model) if own[0].model.kind != "endpoint" else None
    try:
        for arm in own:
            log(f"arm {arm.label}: {arm.how}")
            results[arm.label] = evaluate_model(arm.model, arm.sets, prompting, executor, windows, placement, log,
                                                arm.endpoint, backend=backend)
    finally:
        del backend
        placement.release()
    for arm in arms:
        if arm.kind == "alternative":
            log(f"arm {arm.label}: {arm.how}")
            results[arm.label] = evaluate_model(arm.model, arm.sets, prompting, executor, windows, placement, log,
                                                arm.endpoint)
    return results


def _decision(suite: Suite, loaded, arms: list[ArmSpec], prints: dict, results: dict, template: str,
              o: DecideOptions, cost: dict | None) -> dict[str, Any]:
    labels = [a.label for a in arms]
    implicit_margins(loaded, results, labels)
    card = build_scorecard(suite, loaded, [a.model for a in arms], prints, results, template, labels)
    retrieval = next((a for a in arms if a.kind == "retrieval"), None)
    grounding_failures: dict = {}
    if retrieval is not None:
        outputs = {label: results[label]["outputs"] for label in labels}
        records, grounding_failures = grounding_metrics(loaded, outputs, retrieval.added, labels, retrieval.label)
        card["metrics"] += records
    card["gates"] = evaluate_gates(suite.file.gates, card["metrics"], labels)
    not_tried = {kind: why for kind, why in (("prompted", "no --examples"), ("retrieval", "no --docs"))
                 if kind not in {a.kind for a in arms}}
    verdict = decide([Arm(a.label, a.kind, a.cost_per_1k) for a in arms], card["gates"], not_tried)
    card["passed"] = verdict.exit_code == 0
    return decision_document(card, arms, verdict, not_tried, cost, grounding_failures)


def _secrets(o: DecideOptions) -> list[str]:
    """The API keys the endpoints are given (the values of the variables --base-key-env and each
    --compare's key-env name), which nothing written or printed may hold."""
    names = [o.base_key_env] + [parse_target(spec).key_env for spec in o.compare]
    return [os.environ[name] for name in names if name and os.environ.get(name)]
