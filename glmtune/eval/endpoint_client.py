"""Requests to an OpenAI-compatible server that survive its faults, and the faults counted.

`call` runs one request (a closure over the `openai` client, whose own retries are off) and
retries it with exponential backoff when the fault is one a server recovers from: HTTP 408,
429 (after its Retry-After, capped) and 5xx, a timeout, a refused or dropped connection.
Retries are bounded twice: at most `retries` more attempts, and none that would start after
`timeout_s * (retries + 1)` seconds from the first (so one request cannot hold the run for
longer than about that, whatever the server does). Any other fault (a 4xx, a response that is
not the JSON it should be) fails the request at once. A request that fails raises
`RequestFailed`; the caller records it on that request and the run goes on.

`FaultLog` counts, over one model's evaluation and across the request threads: HTTP attempts,
retries, every fault by kind ("http 500", "http 429", "timeout", "connection", "malformed")
and the requests that failed in the end, by the kind of their last fault. It is the endpoint
part of the scorecard's operations (docs/eval.md, "Endpoint evaluation").
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_BACKOFF_S = 0.5  # the first retry's wait; doubled each time
_MAX_BACKOFF_S = 8.0


class MalformedResponse(Exception):
    """A response that is not the JSON the API defines (not JSON, or without its fields)."""


class RequestFailed(Exception):
    """A request that failed after its attempts; `kind` names its last fault."""

    def __init__(self, kind: str, attempts: int, cause: BaseException) -> None:
        detail = " ".join(str(cause).split())[:300]
        super().__init__(f"{kind} after {attempts} attempt{'s' * (attempts > 1)}: {type(cause).__name__}: {detail}")
        self.kind = kind
        self.attempts = attempts


@dataclass(frozen=True)
class RetryPolicy:
    timeout_s: float  # per attempt (the client's timeout)
    retries: int  # attempts after the first

    @property
    def budget_s(self) -> float:
        """No retry starts later than this after the first attempt began."""
        return self.timeout_s * (self.retries + 1)


def fault_kind(exc: BaseException) -> str:
    """The kind a fault is counted under: "http <status>", "timeout", "connection", "malformed", else
    the exception's type name (a bug or an unexpected library error; not retried)."""
    import openai  # torch-free; only an endpoint evaluation imports the client

    if isinstance(exc, openai.APITimeoutError):  # a subclass of APIConnectionError: first
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"http {exc.status_code}"
    if isinstance(exc, (MalformedResponse, json.JSONDecodeError, openai.APIResponseValidationError)):
        return "malformed"
    return type(exc).__name__


def _retryable(kind: str) -> bool:
    if kind in ("timeout", "connection"):
        return True
    if kind.startswith("http "):
        status = int(kind[5:])
        return status in (408, 429) or status >= 500
    return False


def _wait_s(attempt: int, exc: BaseException) -> float:
    """Backoff before retry `attempt` (0-based): doubling, or the server's Retry-After when it gives one."""
    wait = _BACKOFF_S * (2 ** attempt)
    response = getattr(exc, "response", None)
    retry_after = response.headers.get("retry-after") if response is not None else None
    if retry_after is not None:
        try:
            wait = float(retry_after)
        except ValueError:
            pass  # an HTTP date: keep the backoff
    return min(max(wait, 0.0), _MAX_BACKOFF_S)


class FaultLog:
    """Counts of one model's requests and faults (thread-safe; see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts = 0
        self.retries = 0
        self.faults: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()

    def count(self, *, attempt: bool = False, retry: bool = False, fault: str | None = None,
              failed: str | None = None) -> None:
        with self._lock:
            self.attempts += attempt
            self.retries += retry
            if fault is not None:
                self.faults[fault] += 1
            if failed is not None:
                self.failed[failed] += 1

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {"http_requests": self.attempts, "retries": self.retries,
                    "failed_requests": sum(self.failed.values()), "failures": dict(sorted(self.failed.items())),
                    "faults": dict(sorted(self.faults.items()))}


def call(request: Callable[[], T], log: FaultLog, policy: RetryPolicy) -> T:
    """request()'s result, retried as the module docstring says; RequestFailed when it gives up."""
    began = time.monotonic()
    for attempt in range(policy.retries + 1):
        log.count(attempt=True)
        try:
            return request()
        except Exception as exc:  # every fault is counted; which ones are retried is decided here
            kind = fault_kind(exc)
            wait = _wait_s(attempt, exc)
            give_up = (not _retryable(kind) or attempt == policy.retries
                       or time.monotonic() - began + wait > policy.budget_s)
            log.count(fault=kind, failed=kind if give_up else None, retry=not give_up)
            if give_up:
                raise RequestFailed(kind, attempt + 1, exc) from exc
            time.sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")
