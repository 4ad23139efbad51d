"""A hostile OpenAI-compatible server for the endpoint tests (tests/eval/test_endpoint_hostile.py):
http.server in a thread, answering each request as the first of its `behaviours` whose marker the
prompt holds (a text prompt as it is, a token-id prompt decoded with the bundled tokenizer, a chat
request's messages as JSON), else as an honest engine: "Sure, here is the answer." for a
completion or a chat, log-probabilities of -1.0 for an echo request, one model ("stub-model") for
GET /v1/models (or the `models` behaviour), a 404 for GET /version (or the `version` behaviour).

A behaviour is a function (handler, request body) that writes the whole response. The ones here:
a huge body (stated or streamed), a drip (one byte every `DRIP_S`, of the body or of the headers),
a redirect, a completion with given fields, a chat message, echoed log-probabilities with one
value replaced, any bytes with any headers, a body shorter than its Content-Length.
`Server.seen` counts the requests per marker (and per path for GET), `Server.sent` the body bytes a
huge answer got out before the client went away.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from glmtune.data.tokenizer import load_tokenizer

DRIP_S = 0.05  # one byte every DRIP_S seconds
DRIP_FOR_S = 30.0  # a drip gives up after this long (the client should have left long before)
ANSWER = "Sure, here is the answer."
Behaviour = Callable[[BaseHTTPRequestHandler, dict], None]


def reply(handler: BaseHTTPRequestHandler, status: int, body: Any, **headers: str) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    for name, value in headers.items():
        handler.send_header(name.replace("_", "-"), value)
    handler.end_headers()
    handler.wfile.write(data)


def completion(text: str = ANSWER, **fields: Any) -> Behaviour:
    """A completion of `text` with extra top-level fields (a `usage`, say)."""
    def write(handler, body):
        reply(handler, 200, {"id": "c", "object": "text_completion", "created": 0, "model": "stub-model",
                             "choices": [{"index": 0, "text": text, "finish_reason": "stop"}], **fields})
    return write


def chat(message: dict[str, Any]) -> Behaviour:
    """A chat completion answering `message` (its content, its tool_calls)."""
    def write(handler, body):
        reply(handler, 200, {"id": "c", "object": "chat.completion", "created": 0, "model": "stub-model",
                             "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                          "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]})
    return write


def echo_logprobs(index: int | None = None, value: Any = None) -> Behaviour:
    """Prompt log-probabilities of -1.0 (the first null), with `value` at `index` when given."""
    def write(handler, body):
        ids = body["prompt"]
        scored: list[Any] = [None] + [-1.0] * (len(ids) - 1) + [-0.5]
        if index is not None:
            scored[index] = value
        reply(handler, 200, {"id": "l", "object": "text_completion", "created": 0, "model": "stub-model",
                             "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                                          "logprobs": {"token_logprobs": scored}}]})
    return write


def huge(total: int, stated: bool) -> Behaviour:
    """`total` bytes of a JSON string, with a Content-Length saying so (`stated`) or none (the body
    ends when the connection does), written in 64 KiB pieces until the client goes away."""
    def write(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if stated:
            handler.send_header("Content-Length", str(total))
        handler.end_headers()
        piece, sent = b"a" * (64 << 10), 0
        try:
            handler.wfile.write(b'{"choices": [{"text": "')
            while sent < total:
                handler.wfile.write(piece)
                sent += len(piece)
        except OSError:
            pass
        handler.server.sent[handler.path] = sent
        handler.close_connection = True
    return write


def drip(headers: bool) -> Behaviour:
    """One byte every DRIP_S: of an endless header (`headers`), or of a body stated at 100 kB."""
    def write(handler, body):
        handler.close_connection = True
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        handler.wfile.write(head + (b"X-Slow: " if headers else b"Content-Length: 100000\r\n\r\n"))
        handler.wfile.flush()
        began = time.monotonic()
        try:
            while time.monotonic() - began < DRIP_FOR_S:
                handler.wfile.write(b"a")
                handler.wfile.flush()
                time.sleep(DRIP_S)
        except OSError:
            pass
    return write


def raw(status: int, data: bytes, **headers: str) -> Behaviour:
    """`data` as the body, with a Content-Length and `headers` (Content_Encoding: Content-Encoding)."""
    def write(handler, body):
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            handler.send_header(name.replace("_", "-"), value)
        handler.end_headers()
        handler.wfile.write(data)
    return write


def short_body(missing: int = 100) -> Behaviour:
    """An honest completion whose Content-Length claims `missing` bytes more than are sent."""
    def write(handler, body):
        data = json.dumps({"choices": [{"index": 0, "text": ANSWER, "finish_reason": "stop"}]}).encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data) + missing))
        handler.end_headers()
        handler.wfile.write(data)
        handler.close_connection = True
    return write


def redirect(to: str) -> Behaviour:
    def write(handler, body):
        reply(handler, 307, {"error": "moved"}, Location=to)
    return write


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, behaviours: dict[str, Behaviour], models: Behaviour | None = None,
                 version: Behaviour | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviours, self.models, self.version = behaviours, models, version
        self.seen: Counter[str] = Counter()
        self.sent: dict[str, int] = {}
        self.tokenizer = load_tokenizer() if behaviours else None
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def __enter__(self) -> Server:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def behaviour(self, prompt: Any) -> tuple[str, Behaviour | None]:
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        return next(((m, b) for m, b in self.behaviours.items() if m in text), ("honest", None))


class _Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen[f"GET {self.path}"] += 1
        if self.path == "/v1/models" and self.server.models is not None:
            return self.server.models(self, {})
        if self.path == "/version" and self.server.version is not None:
            return self.server.version(self, {})
        if self.path == "/v1/models":
            return reply(self, 200, {"object": "list", "data": [{"id": "stub-model", "owned_by": "tests"}]})
        reply(self, 404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        marker, behaviour = self.server.behaviour(body["prompt"] if "prompt" in body else json.dumps(body["messages"]))
        self.server.seen[marker] += 1
        if behaviour is not None:
            return behaviour(self, body)
        if "messages" in body:
            return chat({"content": ANSWER})(self, body)
        (completion() if isinstance(body["prompt"], str) else echo_logprobs())(self, body)
