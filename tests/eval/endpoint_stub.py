"""A stub OpenAI-compatible engine holding a model in-process, for the endpoint tests that need
prompt log-probabilities (as vLLM gives them: /v1/completions with token ids, echo and logprobs).

    server = ThreadingHTTPServer(("127.0.0.1", 0), engine(model, with_logprobs=True))

GET lists one model ("tiny"). POST /v1/completions with a text prompt (generation) answers a
fixed "Fine."; with token ids (echo, logprobs=0, max_tokens=1) it answers the model's prompt
log-probabilities, logprob j scoring token j given the ones before it (None for the first), or,
with `with_logprobs=False`, no log-probabilities at all (an engine that does not give them).
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import torch


def engine(model, with_logprobs: bool = True) -> type[BaseHTTPRequestHandler]:
    """The request handler class of a stub engine serving `model` (see module docstring)."""

    class Engine(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _json(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._json({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "stub"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if isinstance(body["prompt"], str):  # generation: a fixed answer
                return self._json({"id": "g", "object": "text_completion", "created": 0, "model": "tiny",
                                   "choices": [{"index": 0, "text": "Fine.", "finish_reason": "stop"}]})
            assert body["echo"] and body["logprobs"] == 0 and body["max_tokens"] == 1
            ids = body["prompt"]
            choice = {"index": 0, "text": "x", "finish_reason": "length"}
            if with_logprobs:  # as vLLM: logprob j scores token j given the ones before it
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
                scored = [None] + [float(logp[j - 1, ids[j]]) for j in range(1, len(ids))]
                choice["logprobs"] = {"tokens": [str(i) for i in ids] + ["x"], "token_logprobs": scored + [-1.0]}
            self._json({"id": "l", "object": "text_completion", "created": 0, "model": "tiny", "choices": [choice]})

    return Engine
