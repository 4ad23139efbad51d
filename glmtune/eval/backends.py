"""Where a model's answers and teacher-forced losses come from during `glmtune eval`.

A backend answers a batch of requests (each: chat messages and the row's tools) with one `Turn`
per request, or the reason that request failed (`Failed`), and scores token windows
teacher-forced:

  * `LocalModel`: a model in this process, whole or sharded over the ranks of a torchrun job
    (`sharded.py` gives it the lockstep that sharding needs). It renders each prompt with the
    suite's chat template and decodes left-padded batches with `glmtune.generation.generate`;
    the tool calls are parsed from the text by the caller (`answering.py`);
  * an OpenAI-compatible server (`endpoint.py`).

`answering.run_rows` owns the tool-call loop, the rounds and the batches; a backend only turns
prompts into text. Latency is per request: a local batch's wall time is the latency of each
request in it (what a server batching the same way would show). A preference set generates
nothing: the backend scores each pair's two answers teacher-forced (`pair_logps`). The serving
metrics (`serving.py`) are teacher-forced too: `serving_sums` of each chat row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol


from glmtune.eval.scorers.preference import PairLogps, local_pair_logps
from glmtune.eval.scorers.reference_loss import row_loss
from glmtune.eval.general_text import general_text_loss
from glmtune.eval.serving import row_serving_sums
from glmtune.eval.tool_calls import ParsedCall
from glmtune.generation import generate
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.model_spec import Compute


@dataclass
class Turn:
    """One generated assistant turn of one request."""

    text: str  # the generated text (tool-call markup included when `calls` is None)
    finish: str  # "stop_token" | "stop_string" | "length" (an engine's "stop" is "stop_token")
    tokens: int  # generated tokens
    latency_s: float  # this request's wall time for the turn
    calls: list[ParsedCall] | None = None  # tool calls the engine parsed itself; None: parse `text`


@dataclass
class Failed:
    """A request that got no turn: where it failed and why."""

    stage: str  # "rendering the prompt" | "generation"
    error: BaseException


class NotAvailable(Exception):
    """A metric the backend cannot compute (an engine without prompt log-probabilities)."""


class Backend(Protocol):
    def batch_size(self, decoding) -> int: ...

    def answer(self, requests: list[tuple[list[dict[str, Any]], list | None]], prompting,
               seed: int) -> tuple[list[Turn | Failed], float]: ...

    def reference_loss(self, row, prompting) -> float: ...

    def text_loss(self, windows: list[list[int]]) -> tuple[float, int]: ...

    def pair_logps(self, row, prompting) -> PairLogps: ...

    def serving_sums(self, row, prompting) -> dict[str, tuple[float, float]]: ...


class LocalModel:
    """A model in this process: `glmtune.generation.generate` in batches of `decoding.batch_size`.

    A batch whose generation raises is retried one request at a time, so only the request that
    breaks it (its prompt too long, say) fails. `lockstep` (sharded runs, `sharded.Lockstep`) keeps
    the ranks' collectives in step; None in one process. `spec`: the model family's `ModelSpec`,
    which scores the teacher-forced batches (`teacher_forced.py`): `loss` (reference and general
    text loss), `token_logps` (the preference scorer), `serving_metrics` (`serving.py`)."""

    def __init__(self, net, lockstep=None, spec=None) -> None:
        self.net = net
        self.lockstep = lockstep
        self.spec = spec

    def batch_size(self, decoding) -> int:
        return decoding.batch_size

    def answer(self, requests, prompting, seed):
        results: list[Turn | Failed | None] = [None] * len(requests)
        prompts = {}
        for i, (messages, tools) in enumerate(requests):
            try:
                prompts[i] = prompting.render(messages, tools)
            except Exception as exc:  # e.g. a tool result the template cannot render
                results[i] = Failed("rendering the prompt", exc)
        live = sorted(prompts)
        seconds = 0.0
        if not live:
            return results, seconds
        try:
            turns, seconds = self._generate([prompts[i] for i in live], prompting, seed)
            for i, turn in zip(live, turns):
                results[i] = turn
            return results, seconds
        except Exception:
            if self.lockstep is not None:
                raise  # the other ranks are inside this batch's collectives: one at a time would desync them
        for i in live:  # one request may break the batch: one at a time, the others answer
            try:
                [results[i]], took = self._generate([prompts[i]], prompting, seed)
                seconds += took
            except Exception as exc:
                results[i] = Failed("generation", exc)
        return results, seconds

    def _generate(self, prompts: list[list[int]], prompting, seed: int) -> tuple[list[Turn], float]:
        d = prompting.decoding
        began = time.perf_counter()
        result = generate(self.net, prompts, d.max_new_tokens, tokenizer=prompting.tokenizer,
                          temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, seed=seed,
                          stop_token_ids=prompting.stop_ids, stop_strings=d.stop_strings, lockstep=self.lockstep)
        seconds = time.perf_counter() - began
        return [Turn(text, reason, len(ids), seconds)
                for text, ids, reason in zip(result.texts, result.token_ids, result.finish_reasons)], seconds

    def idle(self, prompting) -> None:
        """This rank's share of a batch another rank answers (sharded): a one-token prompt whose
        row counts as done at once, stepping until the other ranks' rows are done."""
        assert self.lockstep is not None, "idle: only the ranks of a sharded model take idle steps"
        with self.lockstep.idling():
            generate(self.net, [[0]], prompting.decoding.max_new_tokens, stop_token_ids=set(),
                     lockstep=self.lockstep)

    def reference_loss(self, row, prompting) -> float:
        # Sharded: every rank computes every row's loss in step (a forward is collective), so each
        # holds the one process's value without exchanging it.
        assert self.spec is not None, "the reference loss needs the family's spec (Placement.load)"
        return row_loss(self.net, self._runner_loss, row, prompting)

    def text_loss(self, windows: list[list[int]]) -> tuple[float, int]:
        assert self.spec is not None, "the general text loss needs the family's spec (Placement.load)"
        return general_text_loss(self.net, self._runner_loss, windows)

    def pair_logps(self, row, prompting) -> PairLogps:
        # Sharded: as reference_loss, every rank scores every pair in step.
        assert self.spec is not None, "a preference set needs the family's token_logps (Placement.load)"
        return local_pair_logps(self.net, self._runner_token_logps, row, prompting)

    # The teacher-forced micro-batches run through the model family's step runner, as training's do.
    def _runner_loss(self, net, mb: MicroBatch) -> tuple:
        return self.spec.compute.step_runner(net).evaluate(mb)

    def _runner_token_logps(self, net, mb: MicroBatch):
        return self.spec.compute.step_runner(net).token_logps(mb)

    def serving_sums(self, row, prompting) -> dict[str, tuple[float, float]]:
        # Sharded: as reference_loss, every rank runs every row in step.
        assert self.spec is not None, "the serving metrics need the family's spec (Placement.load)"
        if type(self.spec.compute).serving_metrics is Compute.serving_metrics:  # the family has neither part
            raise NotAvailable(f"not available from this model family: {self.spec.family.name} models have no "
                               "multi-token-prediction layer or sparse-attention indexer (GLM-5's)")
        return row_serving_sums(self.net, self.spec.compute.serving_metrics, row, prompting)
