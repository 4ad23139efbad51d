"""A stub OpenAI-compatible teacher that returns top-K log-probabilities, as vLLM does, for the
`glmtune distill generate` tests.

    stub = TeacherStub(tokenizer, k=4); url = stub.start(); ...; stub.stop()

POST /v1/completions answers each prompt with `answer_for(prompt, seed)`: a JSON object derived
from the prompt's sha256 (so every row's answer is its own and a rerun gets the same), or, with
`bad_json(seed)` true, the text "not json". With `logprobs: K` it returns per token the
token, its log-prob and K alternatives (the token itself first, then K - 1 other ids), spelled
"token_id:N" when the request asks for `return_tokens_as_token_ids`, else as the token's text;
after the answer's tokens comes the end-of-turn token (vLLM includes the EOS it stopped at).
POST /v1/chat/completions answers the last user turn (`answer_for(its content, seed)`) with the
chat API's `logprobs.content` (token, logprob, bytes, top_logprobs).

`mode` breaks the answers on purpose: "no_logprobs" (transformers serve), "wrong_k" (K + 2
alternatives), "out_of_vocab" (an id past the vocabulary), "short" (one position fewer than the
answer's tokens), "unmappable" (a token string that is no token), "nan" (a NaN in the JSON),
"fail" (HTTP 500 for every request after `fail_after`), "refuse_ids" (HTTP 422 for a request
asking for `return_tokens_as_token_ids`, as transformers serve refuses unknown fields). `hold_after`: requests after that many
wait until `release` is set (a test kills the client meanwhile). `requests` counts the requests
per prompt hash.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def answer_for(prompt: str, seed: int, bad_json=None) -> str:
    if bad_json is not None and bad_json(seed):
        return "not json"
    digest = hashlib.sha256(prompt.encode()).hexdigest()
    return json.dumps({"product": "CloudSync", "code": int(digest[:6], 16)})


class TeacherStub:
    def __init__(self, tokenizer, stop_token: str = "<|endoftext|>") -> None:
        self.tokenizer = tokenizer
        self.stop_id = tokenizer.convert_tokens_to_ids(stop_token)
        # Alternatives are ids whose text is ASCII (an engine spells a partial UTF-8 byte as U+FFFD: unmappable)
        self.clean = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).isascii()]
        self.mode: str | None = None
        self.fail_after: int | None = None
        self.hold_after: int | None = None
        self.release = threading.Event()
        self.bad_json = None  # seed -> whether the answer is "not json"
        self.authorization: set[str] = set()
        self.requests: Counter[str] = Counter()
        self.total = 0
        self._lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def _count(self, prompt: str) -> int:
        with self._lock:
            self.total += 1
            self.requests[hashlib.sha256(prompt.encode()).hexdigest()[:16]] += 1
            return self.total

    def logprobs(self, ids: list[int], k: int, as_ids: bool) -> dict:
        vocab = len(self.tokenizer)
        spell = (lambda i: f"token_id:{i}") if as_ids else (lambda i: self.tokenizer.decode([i]))
        tokens, sampled, top = [], [], []
        for position, token in enumerate(ids):
            start = (token * 31 + position) % len(self.clean)  # ids whose text maps back (module docstring)
            others = [o for o in self.clean[start:] + self.clean[:start] if o != token][:k - 1]
            pairs = [(token, -0.25)] + [(o, -2.0 - j) for j, o in enumerate(others)]
            if self.mode == "wrong_k":
                pairs += [((token + 500 + j) % vocab, -9.0 - j) for j in range(2)]
            if self.mode == "out_of_vocab" and position == 1:
                pairs[-1] = (vocab + 5, pairs[-1][1])
            tokens.append(spell(token))
            sampled.append(-0.25)
            top.append({spell(i): lp for i, lp in pairs})
        if self.mode == "unmappable" and tokens:
            tokens[0] = "\u2603zz\u2603" if not as_ids else tokens[0]
            top[0] = {"\u2603zz\u2603": -0.25}
        if self.mode == "short":
            tokens, sampled, top = tokens[:-2], sampled[:-2], top[:-2]
        return {"tokens": tokens, "token_logprobs": sampled, "top_logprobs": top,
                "text_offset": list(range(len(tokens)))}

    def completion(self, body: dict) -> dict:
        prompt, seed = body["prompt"], body.get("seed", 0)
        text = answer_for(prompt, seed, self.bad_json)
        choice = {"index": 0, "text": text, "finish_reason": "stop"}
        k = body.get("logprobs")
        if k and self.mode != "no_logprobs":
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop_id]
            choice["logprobs"] = self.logprobs(ids, k, bool(body.get("return_tokens_as_token_ids")))
        return {"id": "c", "object": "text_completion", "created": 0, "model": "teacher", "choices": [choice]}

    def chat(self, body: dict) -> dict:
        """/v1/chat/completions: the answer to the last user turn, log-probs in the chat API's form."""
        last_user = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        text = answer_for(last_user, body.get("seed", 0), self.bad_json)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        if body.get("logprobs") and self.mode != "no_logprobs":
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            flat = self.logprobs(ids, body["top_logprobs"], bool(body.get("return_tokens_as_token_ids")))
            spelled = lambda token: list(token.encode())  # noqa: E731 - the bytes field vLLM sends
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": lp, "bytes": spelled(token),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": spelled(t)} for t, v in top.items()]}
                for token, lp, top in zip(flat["tokens"], flat["token_logprobs"], flat["top_logprobs"])]}
        return {"id": "c", "object": "chat.completion", "created": 0, "model": "teacher", "choices": [choice]}

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": "teacher", "object": "model", "owned_by": "stub"}]}).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.authorization.add(self.headers.get("Authorization", ""))
                chat = self.path.endswith("/chat/completions")
                number = stub._count(json.dumps(body["messages"]) if chat else body["prompt"])
                if stub.hold_after is not None and number > stub.hold_after:
                    stub.release.wait(timeout=300)
                if stub.mode == "refuse_ids" and "return_tokens_as_token_ids" in body:  # transformers serve
                    return self._send(422, b'{"detail": "Unexpected fields in the request"}')
                if stub.mode == "fail" and number > (stub.fail_after or 0):
                    return self._send(500, b'{"error": "engine down"}')
                data = json.dumps(stub.chat(body) if chat else stub.completion(body)).encode()
                if stub.mode == "nan":
                    data = data.replace(b"-0.25", b"NaN", 1)
                self._send(200, data)

        return Handler
