"""The one HTTP path of endpoint evaluation: every request to a server (GET /v1/models, GET
/version, the completions and chat requests) goes through `guarded_client`'s transport, which
trusts nothing the server does:

  * the body is capped (`max_bytes`, `--max-response-bytes`): a stated Content-Length over the
    cap is refused before a byte is read, and the streamed body is cut as soon as it passes the
    cap (`ResponseTooLarge`); a compressed body is refused (the request asks for `identity`, and
    a decompressed size is not what the cap counted);
  * a deadline holds per attempt and per request: each attempt ends by `timeout_s` after it
    started or by the request's deadline (`attempt`, set by `endpoint_client.call` to the first
    attempt's start + timeout x (retries + 1)), whichever is first. Connecting, sending, the wait
    for the headers and the body read all count: a watchdog timer shuts the connection's socket
    down at the deadline, so a server dripping a byte a second is cut then, not a read timeout
    later (the attempt fails as a timeout). Connections are not kept alive, so each attempt's
    socket is the one the watchdog holds;
  * a redirect off the endpoint's origin (scheme, host, port) is refused naming both URLs
    (`RedirectRefused`), and so is a 301, 302 or 303 answering a POST (the client would follow it
    with a GET, whose answer is no completion); one on the origin is followed (the deadline still
    holds; a loop ends at httpx's 20 redirects, counted as "redirect" by endpoint_client);
  * the address that answered (the socket's peer) is recorded (`peers`, the response's
    `glmtune_peer` extension): the fingerprint names the server that answered, not only its URL.

A refused response raises a `ServerFault` whose `kind` is how the fault is counted ("too large",
"redirect", "malformed"); a deadline raises the HTTP library's ReadTimeout ("timeout").
"""

from __future__ import annotations

import contextlib
import contextvars
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator

import httpx2 as httpx  # the openai client's HTTP library (openai >= 3); huggingface_hub needs it too

from glmtune.io.text_limits import clipped

DEFAULT_MAX_RESPONSE_BYTES = 16 << 20  # a prompt's echoed log-probabilities (~100 bytes a token) up to ~160k tokens
MIN_MAX_RESPONSE_BYTES = 1 << 10
MAX_MAX_RESPONSE_BYTES = 1 << 30
_REDIRECTS = (301, 302, 303, 307, 308)
_METHOD_CHANGING = (301, 302, 303)  # httpx (as browsers) follows them with a GET, losing a POST's body
_MAX_PEERS = 16  # addresses kept for the operations entry (a round-robin name may answer from several)


class ServerFault(Exception):
    """A response glmtune refuses; `kind` is the fault kind it is counted under."""

    kind = "malformed"


class MalformedResponse(ServerFault):
    """A response that is not what the API defines (not JSON, a field missing, of the wrong type or
    out of range)."""


class ResponseTooLarge(ServerFault):
    kind = "too large"


class RedirectRefused(ServerFault):
    kind = "redirect"


def origin(url: str | httpx.URL) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in: what a redirect may not leave."""
    url = httpx.URL(str(url))
    port = url.port if url.port is not None else {"http": 80, "https": 443}.get(url.scheme)
    return url.scheme, url.host, port


def origin_text(url: str | httpx.URL) -> str:
    scheme, host, port = origin(url)
    return f"{scheme}://{host}:{port}"


_ATTEMPT: contextvars.ContextVar[tuple[float, str] | None] = contextvars.ContextVar("glmtune_attempt", default=None)


@contextlib.contextmanager
def attempt(deadline: float, request_id: str) -> Iterator[None]:
    """Requests sent inside this block end by `deadline` (time.monotonic()) and carry `request_id`
    as their X-Request-Id (vLLM and SGLang log it: the id names the request on both sides)."""
    token = _ATTEMPT.set((deadline, request_id))
    try:
        yield
    finally:
        _ATTEMPT.reset(token)


def new_request_id() -> str:
    return f"glmtune-{uuid.uuid4().hex[:16]}"


class _Watchdog:
    """Shuts the attempt's socket down at its deadline (the socket comes from httpcore's trace of the
    connect, which may come before or after the deadline)."""

    def __init__(self, deadline: float) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.fired = False
        self.peer: str | None = None
        self._timer = threading.Timer(max(deadline - time.monotonic(), 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def trace(self, event: str, info: dict) -> None:
        # "connection.connect_tcp.complete", "connection.start_tls.complete", "proxy.start_tls.complete"
        # (TLS through a proxy's tunnel): the latest stream's socket is the one that holds the fd.
        if not event.endswith((".connect_tcp.complete", ".start_tls.complete")):
            return
        sock = info["return_value"].get_extra_info("socket")
        if sock is None:
            return
        with contextlib.suppress(OSError):
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        with self._lock:
            self._sock, fired = sock, self.fired
        if fired:
            _shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired, sock = True, self._sock
        if sock is not None:
            _shutdown(sock)

    def stop(self) -> None:
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed: the attempt ended as the deadline came
        sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv (a close from another thread may not)


class _CappedStream(httpx.SyncByteStream):
    """The response body, cut past `max_bytes`; the watchdog stops when the body is read or closed."""

    def __init__(self, inner, max_bytes: int, watchdog: _Watchdog, url: str, timeout_error) -> None:
        self._inner, self._max_bytes, self._watchdog = inner, max_bytes, watchdog
        self._url, self._timeout_error = url, timeout_error

    def __iter__(self) -> Iterator[bytes]:
        read = 0
        try:
            for chunk in self._inner:
                read += len(chunk)
                if read > self._max_bytes:
                    raise ResponseTooLarge(f"{self._url}: the response passed the {self._max_bytes:,}-byte cap "
                                           "(--max-response-bytes); the rest was not read")
                yield chunk
        except httpx.TransportError as exc:
            if self._watchdog.fired:
                raise self._timeout_error() from exc
            raise
        finally:
            self._watchdog.stop()

    def close(self) -> None:
        self._watchdog.stop()
        self._inner.close()


class GuardedTransport(httpx.BaseTransport):
    """The module docstring's policy around an HTTPTransport (no keep-alive; proxies from the
    environment as httpx would take them)."""

    def __init__(self, base_url: str, timeout_s: float, max_bytes: int) -> None:
        self.base_url, self.timeout_s, self.max_bytes = base_url, timeout_s, max_bytes
        self.origin = origin(base_url)
        self.peers: set[str] = set()
        self._peers_lock = threading.Lock()
        scheme, host, _ = self.origin
        proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(scheme)
        self._inner = httpx.HTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
                                          proxy=proxy)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if origin(request.url) != self.origin:  # a redirect the client would follow, or a bug
            raise RedirectRefused(f"{clipped(request.url)} is off the endpoint's origin "
                                  f"{origin_text(self.base_url)}; refused")
        scope = _ATTEMPT.get()
        deadline = time.monotonic() + self.timeout_s
        if scope is not None:
            deadline = min(deadline, scope[0])
            request.headers["X-Request-Id"] = scope[1]
        request.headers["Accept-Encoding"] = "identity"
        left = max(deadline - time.monotonic(), 1e-3)
        request.extensions["timeout"] = dict.fromkeys(("connect", "read", "write", "pool"), left)
        watchdog = _Watchdog(deadline)
        request.extensions["trace"] = watchdog.trace
        what = f"{request.method} {clipped(request.url)}"

        def timeout_error() -> httpx.ReadTimeout:
            return httpx.ReadTimeout(f"{what}: no complete response within the deadline "
                                     f"({self.timeout_s:g} s an attempt, timeout x (retries + 1) a request)",
                                     request=request)

        try:
            response = self._inner.handle_request(request)
        except httpx.TransportError as exc:
            watchdog.stop()
            if watchdog.fired:
                raise timeout_error() from exc
            raise
        except BaseException:
            watchdog.stop()
            raise
        try:
            self._check(request, response, what)
        except BaseException:
            watchdog.stop()
            response.close()
            raise
        if watchdog.peer is not None:
            response.extensions = {**response.extensions, "glmtune_peer": watchdog.peer}
            with self._peers_lock:
                if len(self.peers) < _MAX_PEERS:
                    self.peers.add(watchdog.peer)
        response.stream = _CappedStream(response.stream, self.max_bytes, watchdog, what, timeout_error)
        return response

    def _check(self, request: httpx.Request, response: httpx.Response, what: str) -> None:
        """Refuse a redirect off the origin, a compressed body, a stated length over the cap."""
        location = response.headers.get("location")
        if response.status_code in _REDIRECTS and location is not None:
            try:
                target = request.url.join(location)
                off = origin(target) != self.origin
            except Exception:  # httpx.InvalidURL and the like: the header is not a URL
                raise MalformedResponse(f"{what}: a {response.status_code} redirect to {clipped(location)}, which "
                                        "is not a URL") from None
            if off:
                raise RedirectRefused(f"{clipped(request.url)} answered {response.status_code}, a redirect to "
                                      f"{clipped(target)}, off the endpoint's origin "
                                      f"{origin_text(self.base_url)}; refused (give that server's URL instead)")
            if request.method == "POST" and response.status_code in _METHOD_CHANGING:
                raise RedirectRefused(f"{what} answered {response.status_code}, a redirect to {clipped(target)} "
                                      "that the client would follow with a GET; refused (a completion needs the "
                                      "POST: give the URL that answers it)")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise MalformedResponse(f"{what}: a body in Content-Encoding "
                                    f"{encoding[:40]!r} though identity was asked")
        stated = response.headers.get("content-length", "")
        if stated.isdigit() and int(stated) > self.max_bytes:
            raise ResponseTooLarge(f"{what}: the response states {int(stated):,} bytes, over "
                                   f"the {self.max_bytes:,}-byte cap (--max-response-bytes); not read")

    def close(self) -> None:
        self._inner.close()


def guarded_client(base_url: str, timeout_s: float, max_bytes: int) -> tuple[httpx.Client, GuardedTransport]:
    """An HTTP client for the openai client (`http_client=`) and plain GETs, and its transport."""
    transport = GuardedTransport(base_url, timeout_s, max_bytes)
    client = httpx.Client(transport=transport, follow_redirects=True, timeout=timeout_s)
    return client, transport
