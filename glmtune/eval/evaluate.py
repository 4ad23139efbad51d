"""`glmtune eval`: every check first, then one model at a time, then the scorecard on disk.

Order: the suite (every key, scorer option, schema file and gate), the models it names, the
output directory (refused before any work if it holds something and `overwrite` is off, or if
it is, is inside or contains an input), one tokenizer and chat template for all models (the
candidate's; a base with other tokenizer or template files is refused, naming both hashes), the
sets (data contract, file:line), the models' fingerprints (an adapter or run whose recorded base
differs is refused), the tool functions (each imports) and the reference tool calls, the
scorers' row checks, every row's prompt rendered once (a template the sandbox refuses is named
here). Then each model in turn (base, candidate, candidate-merged, each --compare arm: `compare.py`): load, answer every set (a
preference set's pairs are scored teacher-forced instead), score the general text and the
held-out domain documents (`domain_text.py`, by source), measure
operations (the serving metrics teacher-forced over the chat rows' reference answers:
`serving.py`), free it, so memory holds one model. Last, each candidate's implicit reward margins
against the base's log-probabilities of the same pairs (`scorers/preference.py`).

A model given as a server URL (`endpoint.py`) answers over HTTP instead of loading here: no
tokenizer check of its own (the local model's or --tokenizer's is used), no memory measured,
its request faults in its operations entry, and "not available from this engine" for the
teacher-forced metrics an engine without prompt log-probabilities cannot give.

What one example does cannot end the run: a request that fails (`answering`), a scorer or the
reference loss raising on one row, is recorded on that example (`failures`, `error`) and the
scorecard is written; the example fails. The same failure on every row of a set is not an
example's: it is raised (the model or the scorer is broken; `glmtune eval` exits 3).

The output directory is written in one step (`glmtune.io.outputs.output_dir`): scorecard.json,
scorecard.md, scorecard.html, suite.yaml (the suite file's bytes) and sets/<name>.jsonl (the
rows each set evaluated; their sha256 is in the scorecard).

The steps `glmtune decide` runs with eval's own machinery are public, in `run_eval`'s order:
`prompting_dir` (one tokenizer and chat template), `reference_tool_results`, `check_prompts`,
`evaluate_model` (one model's answers, scores and operations; a model already loaded may be
given), `implicit_margins` and `build_scorecard`; everything else here is eval's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from glmtune.data.chat_template import control_tokens, load_chat_template
from glmtune.data.tokenizer import load_tokenizer
from glmtune.eval import aggregate
from glmtune.eval.answering import Prompting, failure_text, run_rows
from glmtune.eval.gates import evaluate_gates
from glmtune.distributed.lockstep import ONE_PROCESS
from glmtune.eval.backends import Backend, NotAvailable
from glmtune.eval.endpoint import Endpoint, EndpointOptions, is_endpoint, resolve_endpoint
from glmtune.eval.compare import ROLE as COMPARE_ROLE, check_prompting, compare_targets, resolve_targets
from glmtune.eval.endpoint_client import RequestFailed
from glmtune.eval.general_text import GENERAL_TEXT_METRIC, text_windows
from glmtune.eval.domain_loss import domain_losses
from glmtune.eval.domain_text import domain_metric_records, suite_domain_windows
from glmtune.eval.models import Fingerprints, ModelSource, merged_variant, resolve_model
from glmtune.eval.operations import OPERATIONS_METRICS, PeakMemory, operations_values, parameter_counts, summarize
from glmtune.eval.placement import Placement
from glmtune.eval.sharded import ShardedLayout
from glmtune.eval.report_html import render_html
from glmtune.eval.report_md import render_markdown
from glmtune.eval.scorers.base import ModelOutput, RowScore
from glmtune.eval.scorers.preference import summary_text
from glmtune.eval.scorers.reference_loss import ReferenceLoss
from glmtune.eval.serving import SERVING_METRICS, serving_count, serving_entry
from glmtune.eval.sets import LoadedSet, check_rows, load_sets, tools_offered
from glmtune.eval.suite import Suite, load_suite
from glmtune.eval.targets import redact, secrets_of, without_secrets
from glmtune.eval.tools import ToolExecutor
from glmtune.io import json_out
from glmtune.io.outputs import check_output, output_dir
from glmtune.io.regular import kind_of, open_regular
from glmtune.io.revisions import glmtune_pin

FORMAT = "glmtune.scorecard/1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model")


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def tokenizer_sha256(directory: Path) -> str:
    """One hash over a directory's tokenizer files (names and bytes; the chat template apart)."""
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = directory / name
        if not os.path.lexists(path):
            continue
        if (kind := kind_of(path)) is not None:  # a FIFO would block the read
            raise ValueError(f"{path}: {kind}, not a tokenizer file")
        with open_regular(path, "tokenizer file") as fh:
            digest.update(name.encode() + b"\0" + fh.read())
    return digest.hexdigest()


def _check_same_prompting(base: ModelSource, candidate: ModelSource) -> tuple[Path, str]:
    """The candidate's tokenizer directory and chat template, after checking the base uses the same."""
    tok_base, tok_cand = base.tokenizer_dir, candidate.tokenizer_dir
    for what, hash_of in (("tokenizer", tokenizer_sha256), ("chat template", lambda d: _sha256(load_chat_template(d)))):
        a, b = hash_of(tok_base), hash_of(tok_cand)
        if a != b:
            raise ValueError(f"the base and the candidate use different {what}s (base {tok_base}: sha256 {a[:12]}…, "
                             f"candidate {tok_cand}: sha256 {b[:12]}…); a scorecard compares models under one "
                             "prompt wrapper")
    return tok_cand, load_chat_template(tok_cand)


def prompting_dir(base, candidate, tokenizer: Path | None) -> tuple[Path, str]:
    """The tokenizer directory and chat template every model is prompted with: the local models'
    (`_check_same_prompting`), else `--tokenizer`'s (an endpoint model has no files here); a local
    model's must then be the same."""
    local = [m for m in (base, candidate) if m.kind != "endpoint"]
    if len(local) == 2:
        found = _check_same_prompting(base, candidate)
    elif local:
        found = (local[0].tokenizer_dir, load_chat_template(local[0].tokenizer_dir))
    elif tokenizer is None:
        raise ValueError("--tokenizer DIR is needed: both models are endpoints, and the suite's prompts are "
                         "rendered with a tokenizer and chat template on disk (the served model's HF directory)")
    else:
        return Path(tokenizer), load_chat_template(Path(tokenizer))
    if tokenizer is not None:
        theirs = (tokenizer_sha256(found[0]), _sha256(found[1]))
        if (tokenizer_sha256(Path(tokenizer)), _sha256(load_chat_template(Path(tokenizer)))) != theirs:
            raise ValueError(f"--tokenizer {tokenizer}: not the tokenizer and chat template of {found[0]} (the "
                             "local model's); a scorecard compares models under one prompt wrapper")
    return found


def _prompting(models: list, tokenizer: Path | None) -> tuple[Path, str]:
    """`prompting_dir` of the base and the candidate (a local compared model's when both are
    endpoints and no --tokenizer is given), every local compared model held to it."""
    base, candidate, compared = models[0], models[1], [m for m in models if m.role == COMPARE_ROLE]
    local = [m for m in compared if m.kind != "endpoint"]
    if tokenizer is None and base.kind == candidate.kind == "endpoint" and local:
        found = prompting_dir(local[0], local[0], None)
    else:
        found = prompting_dir(base, candidate, tokenizer)
    check_prompting(found, compared, lambda directory, template: (tokenizer_sha256(directory), _sha256(template)))
    return found


def default_out(candidate: ModelSource, suite: Suite) -> Path:
    """RUN_DIR/eval/<suite name> for a run directory candidate, else ./eval/<suite name>."""
    root = candidate.source / "eval" if candidate.kind == "run" else Path("eval")
    return root / suite.name


def _glmtune_pin() -> dict[str, Any]:
    pin = glmtune_pin()
    return {"version": pin["version"], "commit": pin.get("commit"), "dirty": pin.get("dirty")}


def run_eval(suite_path: str | Path, base_arg: str | Path, candidate_arg: str | Path, out: str | Path | None = None,
             *, overwrite: bool = False, device: str = "auto", dtype: torch.dtype | None = None,
             merged: bool = False, sharded: ShardedLayout | None = None, fp8_base: str = "none",
             endpoint: EndpointOptions | None = None, compare: list[str] | tuple[str, ...] = (),
             log: Callable[[str], None] = print) -> tuple[dict[str, Any], Path]:
    """Evaluate and write the eval directory; returns (scorecard, its directory). ValueError: user errors.
    `sharded`: run as one rank of a torchrun job (`sharded.py`); rank 0 logs and writes.
    `endpoint`: the options of a model given as a server URL (`endpoint.py`). `compare`: the
    `--compare` values, more models reported beside base and candidate, not gated (`compare.py`);
    the API keys of their key-env variables reach no log, message, scorecard or file."""
    targets = compare_targets(list(compare), sharded is not None)
    secrets = secrets_of(targets)
    try:
        return _run_eval(suite_path, base_arg, candidate_arg, out, overwrite=overwrite, device=device, dtype=dtype,
                         merged=merged, sharded=sharded, fp8_base=fp8_base, endpoint=endpoint or EndpointOptions(),
                         targets=targets, secrets=secrets, log=lambda message: log(redact(message, secrets)))
    except Exception as exc:  # a server may echo the key back in an error
        clean = without_secrets(exc, secrets)
        if clean is None:
            raise
        raise clean from None


def _resolve_models(suite: Suite, base_arg, candidate_arg, merged: bool, targets: list, endpoint: EndpointOptions,
                    sharded: ShardedLayout | None) -> tuple[list, list[str]]:
    """(every model: base, candidate, candidate-merged, the compared ones; the labels the gates check)."""
    if sharded is not None and (is_endpoint(base_arg) or is_endpoint(candidate_arg)):
        raise ValueError("--nproc-per-node with an endpoint model: the engine holds that model; evaluate it "
                         "in one process")
    base, candidate = (resolve_endpoint(arg, role, endpoint) if is_endpoint(arg) else resolve_model(arg, role)
                       for arg, role in ((base_arg, "base"), (candidate_arg, "candidate")))
    models = [base, candidate] + ([merged_variant(candidate)] if merged else [])
    labels = [m.label for m in models]
    for i, gate in enumerate(suite.file.gates):
        if gate.model is not None and gate.model in {t.label for t in targets}:
            raise ValueError(f"{suite.path}: gates[{i}].model: {gate.model} is a --compare arm, which is reported, "
                             "not gated (the gates decide the candidate against the base)")
        if gate.model is not None and gate.model not in labels:
            raise ValueError(f"{suite.path}: gates[{i}].model: {gate.model} is not evaluated (pass --merged to "
                             "evaluate candidate-merged)")
    if sharded is not None and merged:
        raise ValueError("--merged with --nproc-per-node: merge the adapter with `glmtune merge` (it streams shard "
                         "by shard) and pass the merged directory as --candidate")
    return models + resolve_targets(targets, endpoint), labels


def _run_eval(suite_path, base_arg, candidate_arg, out, *, overwrite: bool, device: str, dtype, merged: bool,
              sharded: ShardedLayout | None, fp8_base: str, endpoint: EndpointOptions, targets: list,
              secrets: list[str], log: Callable[[str], None]) -> tuple[dict[str, Any], Path]:
    suite = load_suite(suite_path)
    endpoint.check(base_arg, candidate_arg, tuple(t.source for t in targets))
    models, gated = _resolve_models(suite, base_arg, candidate_arg, merged, targets, endpoint, sharded)
    candidate, labels = models[1], [m.label for m in models]
    out = Path(out) if out is not None else default_out(candidate, suite)
    reads = [("SUITE", suite.path)] + [(f"set {s.name}", s.path) for s in suite.sets if s.path is not None]
    reads += [r for m in models for r in m.reads()]
    reads += [("--tokenizer", endpoint.tokenizer)] if endpoint.tokenizer is not None else []
    check_output(out, overwrite=overwrite, sources=reads, what="--out", command="eval")
    tokenizer_dir, template = _prompting(models, endpoint.tokenizer)
    tokenizer = load_tokenizer(tokenizer_dir)
    loaded = load_sets(suite, candidate, control_tokens(template, tokenizer))
    placement = Placement.choose(device, dtype, sharded, candidate, fp8_base)
    log = log if placement.is_main else _quiet
    fingerprints = Fingerprints()  # one for all models: a base directory they share is hashed once
    prints = placement.on_main(lambda: {m.label: m.fingerprint() if m.kind == "endpoint" else fingerprints.of(m)
                                        for m in models})
    prompting = Prompting(tokenizer, template, suite.file.enable_thinking, suite.file.decoding)
    windows = None
    if suite.general_text_path is not None:
        g = suite.file.general_text
        windows = text_windows(tokenizer, suite.general_text_path, g.max_tokens, g.window)
    domain = suite_domain_windows(tokenizer, suite.domain_text_path, suite.file.domain_text)  # before a model loads
    with ToolExecutor(suite.file.tools.functions, suite.file.tools.timeout_s, suite.dir) as executor:
        executor.check()
        reference_tool_results(loaded, executor, placement)
        check_rows(loaded)
        check_prompts(loaded, prompting)
        results = {m.label: evaluate_model(m, loaded, prompting, executor if suite.file.tools.functions else None,
                                            windows, placement, log, endpoint, domain=domain) for m in models}
    implicit_margins(loaded, results, labels)
    card = redact(build_scorecard(suite, loaded, models, prints, results, template, labels, gated), secrets)
    if placement.is_main:
        _write(out, overwrite, reads, suite, loaded, card)
    placement.close()
    return card, out


def _quiet(message: str) -> None:
    """The log of a rank other than 0: rank 0 speaks for the job."""


def reference_tool_results(loaded: list[LoadedSet], executor: ToolExecutor, placement: Placement) -> None:
    """The reference tool calls' results on each tool_execution row, executed once (rank 0's, shared)."""
    def run_all() -> dict:
        return {(i, j): [executor.run(c["name"], c["arguments"], row.tools) for c in row.reference_calls]
                for i, s in enumerate(loaded) if any(sc.name == "tool_execution" for sc in s.spec.scorers)
                for j, row in enumerate(s.rows)}
    for (i, j), results in placement.on_main(run_all).items():
        loaded[i].rows[j].reference_results = results


def check_prompts(loaded: list[LoadedSet], prompting: Prompting) -> None:
    """Every row's first prompt renders (ValueError naming the row): the template, before a model loads."""
    for s in loaded:
        for row in s.rows:
            try:
                prompting.render(row.prompt, row.tools)
            except ValueError as exc:
                raise ValueError(f"{row.origin}: set {s.spec.name}: {exc}") from None


def _score_rows(scorer, rows: list, outs: list) -> list[RowScore]:
    """The scorer's score of each row; a row it raises on gets no values and the reason."""
    scores, raised = [], []
    for row, out in zip(rows, outs):
        try:
            scores.append(scorer.score(row, out))
        except Exception as exc:  # one example's trouble, recorded on it; the run goes on
            raised.append(exc)
            scores.append(RowScore(dict.fromkeys(m.name for m in scorer.metrics(scorer.options)),
                                   [f"{scorer.name} failed: {failure_text(exc)}"]))
    if raised and len(raised) == len(rows):
        raise raised[0]  # every row: the scorer is broken, not an example
    return scores


def _reference_losses(backend: Backend, rows: list, outs: list, prompting: Prompting) -> None:
    raised = []
    for row, out in zip(rows, outs):
        try:
            out.reference_loss = backend.reference_loss(row, prompting)
        except NotAvailable as exc:  # the backend cannot, for any row: no values, and no row fails
            for each in outs:
                each.reference_loss_not_available = str(exc)
            return
        except Exception as exc:
            raised.append(exc)
            out.reference_loss_error = failure_text(exc)
    if raised and len(raised) == len(rows):
        raise raised[0]


def _pair_logps(backend: Backend, rows: list, prompting: Prompting) -> list[ModelOutput]:
    """A preference set's outputs: nothing generated, each pair's log-probabilities (or why not)."""
    outs = [ModelOutput("", "", [], 0.0, 0, "teacher_forced") for _ in rows]
    raised = []
    for row, out in zip(rows, outs):
        try:
            out.preference = backend.pair_logps(row, prompting)
            out.text = summary_text(out.preference)
        except NotAvailable as exc:  # the backend cannot, for any row: no values, and no row fails
            for each in outs:
                each.preference_not_available = str(exc)
            return outs
        except Exception as exc:
            raised.append(exc)
            out.preference_error = failure_text(exc)
    if raised and len(raised) == len(rows):
        raise raised[0]
    return outs


def answer_set(backend: Backend, s: LoadedSet, prompting: Prompting, executor, set_index: int,
               ranks=ONE_PROCESS):
    """(outputs, {scorer name: row scores}, generate seconds) of one model on one set."""
    if s.spec.row_kind == "preference":  # pairs, teacher-forced: nothing to generate
        outs = _pair_logps(backend, s.rows, prompting)
        return outs, {scorer.name: _score_rows(scorer, s.rows, outs) for scorer in s.spec.scorers}, 0.0
    outs, seconds = run_rows(backend, s.rows, prompting, executor, set_index, ranks)
    if any(isinstance(scorer, ReferenceLoss) for scorer in s.spec.scorers):
        _reference_losses(backend, s.rows, outs, prompting)
    scores = {scorer.name: _score_rows(scorer, s.rows, outs) for scorer in s.spec.scorers}
    return outs, scores, seconds


def evaluate_model(model: ModelSource, loaded: list[LoadedSet], prompting: Prompting, executor, windows,
                   placement: Placement, log, endpoint: EndpointOptions | None = None,
                   backend: Backend | None = None, domain: dict | None = None) -> dict[str, Any]:
    """One model's outputs, scores, losses and operations on every set. `backend`: a model already
    loaded (`glmtune decide` answers several prompt arms with one load), which the caller frees;
    None: this model is loaded here and freed at the end. `domain`: the suite's domain windows by
    source (`domain_text.suite_domain_windows`); None without a domain set."""
    what = f"{model.label} ({model.kind}{', merged' if model.merged else ''}: {model.source})"
    memory = PeakMemory(placement.device)
    memory.start()
    owned = backend is None
    if owned:
        backend = Endpoint(model, endpoint) if model.kind == "endpoint" else placement.load(model)
    not_available: dict[str, str] = {}  # metric id -> why the backend cannot compute it
    outputs, scores, latencies, tokens, generate_s = {}, {}, [], 0, 0.0
    stage = "the evaluation"  # what the requests in flight are for (a server failing all of them is named)
    try:
        for index, s in enumerate(loaded):
            stage = f"set {s.spec.name}"
            began = time.perf_counter()
            outs, scores[s.spec.name], seconds = answer_set(backend, s, prompting, executor, index, placement.ranks)
            outputs[s.spec.name] = outs
            if s.spec.row_kind == "preference":  # no requests: not part of the operations
                log(f"{what}: {s.spec.name}, {len(outs)} pairs scored in {time.perf_counter() - began:.1f} s")
                not_available.update(_pairs_not_available(s, outs))
                continue
            latencies += [o.latency_s for o in outs]
            tokens += sum(o.generated_tokens for o in outs)
            generate_s += seconds
            log(f"{what}: {s.spec.name}, {len(outs)} rows in {seconds:.1f} s")
            not_available.update({f"{s.spec.name}/reference_loss/loss": o.reference_loss_not_available
                                  for o in outs[:1] if o.reference_loss_not_available})
        stage = "the general text"
        loss = _text_loss(backend, windows, not_available)
        stage = "the domain text"
        domain_sums = domain_losses(backend, domain, not_available)
        began = time.perf_counter()
        serving = _serving(backend, loaded, prompting, not_available)
        if serving is not None:
            log(f"{what}: serving metrics over {serving['rows']} rows in {time.perf_counter() - began:.1f} s")
        served_ops = backend.operations(latencies, tokens, generate_s) if isinstance(backend, Endpoint) else None
    except RequestFailed as exc:  # an endpoint's, every request of a set (or every window) failing: the server's
        raise backend.failed_every(stage, exc) from exc
    finally:
        if owned and isinstance(backend, Endpoint):
            backend.close()
        del backend
        if owned:
            placement.release()
    ops = served_ops or placement.with_ranks(summarize(latencies, tokens, generate_s, memory.gib(), placement.device))
    ops = {**ops, "serving": serving} if serving is not None else ops
    ops = ops if model.kind == "endpoint" else {**ops, **parameter_counts(model.spec, model.weights_dir)}
    return {"outputs": outputs, "scores": scores, "loss": loss, "domain": domain_sums, "operations": ops,
            "not_available": not_available}


def _pairs_not_available(s: LoadedSet, outs: list[ModelOutput]) -> dict[str, str]:
    """Metric id -> why, for every metric of a preference set the backend could not compute."""
    why = outs[0].preference_not_available if outs else None
    return {f"{s.spec.name}/{scorer.name}/{m.name}": why for scorer in s.spec.scorers
            for m in scorer.metrics(scorer.options)} if why else {}


def implicit_margins(loaded: list[LoadedSet], results: dict, labels: list[str]) -> None:
    """Each candidate's preference scores again, now with its implicit reward margin against the
    base's log-probabilities of the same pairs (`Preference.with_base`)."""
    for s in loaded:
        if s.spec.row_kind != "preference":
            continue
        name, base = s.spec.name, results["base"]["outputs"][s.spec.name]
        for label in labels[1:]:
            outs = results[label]["outputs"][name]
            for scorer in s.spec.scorers:
                for out, base_out in zip(outs, base):
                    scorer.with_base(out, base_out)
                    out.text = summary_text(out.preference) if out.preference is not None else out.text
                results[label]["scores"][name][scorer.name] = _score_rows(scorer, s.rows, outs)
                why = base[0].preference_not_available if base else None
                for m in scorer.metrics(scorer.options):
                    if why and m.candidate_only and not outs[0].preference_not_available:
                        results[label]["not_available"][f"{name}/{scorer.name}/{m.name}"] = f"{why} (the base)"


def _serving(backend: Backend, loaded: list[LoadedSet], prompting: Prompting,
             not_available: dict[str, str]) -> dict[str, Any] | None:
    """The operations entry's `serving`: each serving metric's (sum, count) over the rows of the
    chat sets (`serving.py`); None, the reasons in `not_available`, when the backend cannot. A row
    that raises is counted in the entry and left out; every row raising is raised."""
    rows = [row for s in loaded if s.spec.row_kind == "chat" for row in s.rows]
    totals: dict[str, list[float]] = {}
    failed, raised = [], []
    for row in rows:
        try:
            sums = backend.serving_sums(row, prompting)
        except NotAvailable as exc:  # the backend cannot, for any row
            not_available.update({f"operations/serving/{m.definition.name}": str(exc) for m in SERVING_METRICS})
            return None
        except Exception as exc:  # one row's trouble (a row too long for memory, say): the others still count
            raised.append(exc)
            failed.append(f"{row.origin}: {failure_text(exc)}")
            continue
        for name, (total, count) in sums.items():
            totals.setdefault(name, [0.0, 0.0])
            totals[name][0] += total
            totals[name][1] += count
    if raised and len(raised) == len(rows):
        raise raised[0]
    entry, why = serving_entry(totals, rows, failed, prompting)
    not_available.update(why)
    return entry


def _text_loss(backend: Backend, windows, not_available: dict[str, str]) -> tuple[float | None, int] | None:
    """The general-text loss (None without general text); (None, 0) and the reason when the backend cannot."""
    if windows is None:
        return None
    try:
        return backend.text_loss(windows)
    except NotAvailable as exc:
        not_available["general_text/loss/loss"] = str(exc)
        return None, 0


def build_scorecard(suite: Suite, loaded: list[LoadedSet], models: list[ModelSource], prints: dict,
                    results: dict, template: str, labels: list[str],
                    gated: list[str] | None = None) -> dict[str, Any]:
    """The `glmtune.scorecard/1` document of `models` (`labels` in order, the first the base) from
    their `evaluate_model` results: per-set metrics by category with deltas against the base, fields,
    examples, the general text, operations, and the suite's gates checked for every label but the first (`gated`: the labels the
    gates check, the base first; eval's --compare arms are reported, not gated)."""
    scores = {label: results[label]["scores"] for label in labels}
    outputs = {label: results[label]["outputs"] for label in labels}
    metrics, fields, examples = [], [], []
    for s in loaded:
        name = s.spec.name
        metrics += aggregate.set_metrics(name, s.rows, s.spec.scorers, scores, labels)
        if any(scorer.name == "task_success" for scorer in s.spec.scorers):
            fields += aggregate.field_records(name, s.rows, scores, labels)
        examples += aggregate.example_records(name, s.rows, {lb: outputs[lb][name] for lb in labels}, scores, labels,
                                              pairs=s.spec.row_kind == "preference")
    if suite.general_text_path is not None:
        losses = {label: results[label]["loss"] for label in labels}
        metrics.append(aggregate.single_metric("general_text/loss/loss", GENERAL_TEXT_METRIC,
                                               {lb: loss[0] for lb, loss in losses.items()},
                                               max(loss[1] for loss in losses.values()), labels))
    if suite.domain_text_path is not None:  # held-out domain loss and perplexity, by source (domain_text.py)
        metrics += domain_metric_records(results, labels)
    operations = {label: results[label]["operations"] for label in labels}
    for group, definition in OPERATIONS_METRICS:
        values = {label: operations_values(operations[label])[definition.name] for label in labels}
        n = operations[labels[0]]["requests"]
        if group == "serving":  # positions (queries) counted, not requests
            n = max(serving_count(operations[label], definition.name) for label in labels)
        metrics.append(aggregate.single_metric(f"operations/{group}/{definition.name}", definition, values, n, labels))
    for metric in metrics:  # null values a backend could not compute say so (never a silent zero)
        reasons = {lb: results[lb].get("not_available", {}).get(metric["id"]) for lb in labels}
        if any(reasons.values()):
            metric["not_available"] = {lb: why for lb, why in reasons.items() if why}

    gates = evaluate_gates(suite.file.gates, metrics, (gated or labels)[1:])
    offered = tools_offered(loaded)
    system_prompt = suite.file.system_prompt
    return {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "glmtune": _glmtune_pin(),
        "suite": {"name": suite.name, "version": suite.version, "path": str(suite.path), "sha256": suite.sha256,
                  "sets": [{"name": s.spec.name, "source": s.source, "sha256": _sha256(s.jsonl), "rows": len(s.rows),
                            "scorers": [scorer.name for scorer in s.spec.scorers]} for s in loaded]},
        "decoding": dict(vars(suite.file.decoding)),
        "prompt": {"system_prompt_sha256": _sha256(system_prompt) if system_prompt is not None else None,
                   "chat_template_sha256": _sha256(template), "enable_thinking": suite.file.enable_thinking,
                   "tool_schema_sha256": _sha256(json.dumps(offered, sort_keys=True, ensure_ascii=False))
                   if offered else None,
                   "tool_functions": dict(suite.file.tools.functions)},
        "models": [{"label": m.label, "role": m.role, "source": str(m.source), "kind": m.kind,
                    "fingerprint": prints[m.label], "merged": m.merged} for m in models],
        "metrics": metrics,
        "fields": fields,
        "operations": operations,
        "gates": gates,
        "passed": all(g["passed"] for g in gates),
        "examples": examples,
    }


def _write(out: Path, overwrite: bool, reads: list, suite: Suite, loaded: list[LoadedSet], card: dict) -> None:
    html = render_html(card)
    markdown = render_markdown(card)
    with output_dir(out, overwrite=overwrite, sources=reads, what="--out", command="eval") as tmp:
        # RFC 8259 JSON: a NaN from a row or a tool is the string "NaN"; a lone surrogate (a tool's
        # result) is written as its escape rather than failing the write after the whole evaluation.
        (tmp / "scorecard.json").write_text(json_out.dumps(card, indent=1, ensure_ascii=False) + "\n",
                                            encoding="utf-8", errors="backslashreplace")
        (tmp / "scorecard.md").write_text(markdown, encoding="utf-8")
        (tmp / "scorecard.html").write_text(html, encoding="utf-8")
        (tmp / "suite.yaml").write_bytes(suite.data)
        (tmp / "sets").mkdir()
        for s in loaded:
            (tmp / "sets" / f"{s.spec.name}.jsonl").write_bytes(s.jsonl)
