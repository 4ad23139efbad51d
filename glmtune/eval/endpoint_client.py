"""Requests to an OpenAI-compatible server that survive its faults, and the faults counted.

`call` runs one request (a closure over the `openai` client, whose own retries are off) and
retries it with exponential backoff when the fault is one a server recovers from: HTTP 408,
429 (after its Retry-After, capped; one past the request's deadline gives up at once) and 5xx,
a timeout, a refused or dropped connection.
Retries are bounded twice: at most `retries` more attempts, and none that would start after
`timeout_s * (retries + 1)` seconds from the first; and every attempt ends by that deadline too
(so one request cannot hold the run for longer than that, whatever the server does). Any other fault (a 4xx, a response that is
not the JSON it should be) fails the request at once. A request that fails raises
`RequestFailed`; the caller records it on that request and the run goes on.

`FaultLog` counts, over one model's evaluation and across the request threads: HTTP attempts,
retries, every fault by kind ("http 500", "http 429", "timeout", "connection", "malformed")
and the requests that failed in the end, by the kind of their last fault. It is the endpoint
part of the scorecard's operations (docs/eval.md, "Endpoint evaluation"), with the messages of the
first failed requests.

Each attempt runs inside `endpoint_http.attempt`: the transport ends it by the request's deadline
(the first attempt's start + timeout x (retries + 1)) and sends its own X-Request-Id, which
`RequestFailed` names with the server, so a failure can be found in the engine's log. A response
the transport or `endpoint_responses` refuses (`ServerFault`: "too large", "redirect",
"malformed") is not retried: the server would answer the same.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx2 as httpx  # the openai client's HTTP library (endpoint_http)

from glmtune.eval.endpoint_http import MalformedResponse, ServerFault, attempt, new_request_id
from glmtune.io.text_limits import clipped

T = TypeVar("T")

_BACKOFF_S = 0.5  # the first retry's wait; doubled each time
_MAX_BACKOFF_S = 8.0
_KEPT_FAILURES = 10  # failed requests' messages kept for the operations entry
__all__ = ["FaultLog", "MalformedResponse", "RequestFailed", "RetryPolicy", "ServerFailed", "call", "fault_kind"]


class RequestFailed(Exception):
    """A request that failed after its attempts; `kind` names its last fault, the message the server
    and the last attempt's request id."""

    def __init__(self, kind: str, attempts: int, cause: BaseException, server: str, request_id: str) -> None:
        detail = clipped(_cause_text(cause), 300)
        super().__init__(f"{kind} after {attempts} attempt{'s' * (attempts > 1)}: {type(cause).__name__}: {detail} "
                         f"(server {clipped(server, 100)}, request {request_id})")
        self.kind = kind
        self.attempts = attempts


class ServerFailed(Exception):
    """Every request of a part of the evaluation (a set, the general text) failed at one server: the
    server's trouble, neither an example's nor glmtune's; `glmtune eval` says so, naming the server
    and the fault kinds, and exits 3 (the evaluation could not finish)."""


def _cause_text(exc: BaseException) -> str:
    """The exception's message, and its cause's when the client wrapped it ("Request timed out.")."""
    cause = exc.__cause__
    return f"{exc}: {cause}" if cause is not None and str(cause) and str(cause) not in str(exc) else str(exc)


@dataclass(frozen=True)
class RetryPolicy:
    timeout_s: float  # per attempt, its whole duration (endpoint_http's watchdog)
    retries: int  # attempts after the first

    @property
    def budget_s(self) -> float:
        """The request's deadline after its first attempt began: no retry starts, no attempt runs, past it."""
        return self.timeout_s * (self.retries + 1)


def fault_kind(exc: BaseException) -> str:
    """The kind a fault is counted under: "http <status>", "timeout", "connection", "malformed", "too
    large", "redirect" (off the origin, turning a POST into a GET, or a loop), else the exception's
    type name (a bug or an unexpected library error; not retried)."""
    import openai  # torch-free; only an endpoint evaluation imports the client

    fault = next((e for e in _chain(exc) if isinstance(e, (ServerFault, httpx.TooManyRedirects))), None)
    if isinstance(fault, httpx.TooManyRedirects):  # a redirect loop on the origin: the server would loop again
        return "redirect"
    if fault is not None:  # raised by the transport or the reader, maybe wrapped by the client
        return fault.kind
    if isinstance(exc, openai.APITimeoutError):  # a subclass of APIConnectionError: first
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"http {exc.status_code}"
    if isinstance(exc, (json.JSONDecodeError, openai.APIResponseValidationError)):
        return "malformed"
    if isinstance(exc, httpx.TimeoutException):  # a plain GET through the guarded client (/version)
        return "timeout"
    if isinstance(exc, httpx.TransportError):
        return "connection"
    return type(exc).__name__


def _chain(exc: BaseException | None):
    seen = 0
    while exc is not None and seen < 8:
        yield exc
        exc, seen = exc.__cause__, seen + 1


def _retryable(kind: str) -> bool:
    if kind in ("timeout", "connection"):
        return True
    if kind.startswith("http "):
        status = int(kind[5:])
        return status in (408, 429) or status >= 500
    return False


def _wait_s(attempt: int, exc: BaseException) -> tuple[float, float]:
    """(the wait before retry `attempt` (0-based), the wait the server asked for): the backoff,
    doubling up to _MAX_BACKOFF_S, or the server's Retry-After in seconds (at most _MAX_BACKOFF_S
    waited; what it asked may be more, up to infinity)."""
    backoff = min(_BACKOFF_S * 2.0 ** min(attempt, 32), _MAX_BACKOFF_S)
    response = getattr(exc, "response", None)
    retry_after = response.headers.get("retry-after") if response is not None else None
    try:
        asked = max(float(retry_after), 0.0) if retry_after is not None else math.nan
    except ValueError:
        asked = math.nan  # an HTTP date: keep the backoff
    if math.isnan(asked):  # "nan" would reach time.sleep
        return backoff, backoff
    return min(asked, _MAX_BACKOFF_S), asked


class FaultLog:
    """Counts of one model's requests and faults (thread-safe; see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts = 0
        self.retries = 0
        self.faults: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.messages: list[str] = []  # the first failed requests' RequestFailed messages

    def count(self, *, attempt: bool = False, retry: bool = False, fault: str | None = None,
              failed: str | None = None, message: str | None = None) -> None:
        with self._lock:
            self.attempts += attempt
            self.retries += retry
            if fault is not None:
                self.faults[fault] += 1
            if failed is not None:
                self.failed[failed] += 1
            if message is not None and len(self.messages) < _KEPT_FAILURES:
                self.messages.append(message)

    def merge(self, other: FaultLog) -> None:
        """Add `other`'s counts (a probe's, once it is known to count)."""
        with other._lock:
            attempts, retries, faults, failed, messages = (other.attempts, other.retries, Counter(other.faults),
                                                           Counter(other.failed), list(other.messages))
        with self._lock:
            self.attempts += attempts
            self.retries += retries
            self.faults.update(faults)
            self.failed.update(failed)
            self.messages += messages[:max(_KEPT_FAILURES - len(self.messages), 0)]

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {"http_requests": self.attempts, "retries": self.retries,
                    "failed_requests": sum(self.failed.values()), "failures": dict(sorted(self.failed.items())),
                    "faults": dict(sorted(self.faults.items())), "failed_examples": list(self.messages)}


def call(request: Callable[[], T], log: FaultLog, policy: RetryPolicy, server: str) -> T:
    """request()'s result, retried as the module docstring says; RequestFailed (naming `server` and
    the request id) when it gives up. Every HTTP request request() makes ends by the deadline."""
    began = time.monotonic()
    deadline = began + policy.budget_s
    for number in range(policy.retries + 1):
        log.count(attempt=True)
        request_id = new_request_id()
        try:
            with attempt(deadline, request_id):
                return request()
        except Exception as exc:  # every fault is counted; which ones are retried is decided here
            kind = fault_kind(exc)
            wait, asked = _wait_s(number, exc)  # a Retry-After past the deadline: no retry can be in time
            give_up = (not _retryable(kind) or number == policy.retries
                       or time.monotonic() - began + asked > policy.budget_s)
            failed = RequestFailed(kind, number + 1, exc, server, request_id) if give_up else None
            log.count(fault=kind, failed=kind if give_up else None, retry=not give_up,
                      message=str(failed) if failed else None)
        if failed is not None:
            # Raised here, not in the except clause: chained to the fault, it would keep the fault's
            # traceback, and with it the parsed response of every failed request, alive (its message
            # already says what the fault was).
            raise failed
        time.sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")
