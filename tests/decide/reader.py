"""A reader that answers only from the text of its prompt, for the tests of the retrieval arm's
planted facts: no tiny model reads passages, so a stand-in for `glmtune.generation.generate` (as
tests/eval/fake_model.py) answers each question with the sentence of the passages in its prompt
that shares the most words with the question, citing that passage ("... [2]"); without
passages it answers "I do not know." The same reader answers over HTTP (`engine`, an
OpenAI-compatible stub: GET /v1/models, POST /v1/completions and /v1/chat/completions), so the
endpoint tests drive the same arms through a server.

It decides nothing itself: whether the question's fact is in its answer depends only on whether
the arm put the passage holding it into the prompt.
"""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler

from glmtune.generation.generator import GenerationResult

_PASSAGE = re.compile(r"^\[(\d+)\] \([^)]*\) (.*)$", re.M)


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 3}


def answer(prompt_text: str, question: str) -> str:
    """The reader's answer to `question` given the passages `prompt_text` shows before its first
    user turn (the system turn, where the retrieval arm puts them)."""
    best, cited, score = None, None, 0
    for number, passage in _PASSAGE.findall(prompt_text.split("<|user|>")[0]):
        for sentence in re.split(r"(?<=[.!?]) ", passage):
            overlap = len(_words(sentence) & _words(question))
            if overlap > score:
                best, cited, score = sentence, number, overlap
    return f"{best} [{cited}]" if best else "I do not know."


class ReaderGenerate:
    """`generate`'s stand-in in process: decodes each prompt and answers it (module docstring)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, model, prompts, max_new_tokens, **options) -> GenerationResult:
        texts = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            question = text.split("<|user|>")[-1].split("<|assistant|>")[0]
            texts.append(answer(text, question))
        ids = [self.tokenizer.encode(t, add_special_tokens=False)[:max_new_tokens] for t in texts]
        return GenerationResult(ids, texts, ["stop_token"] * len(prompts), sum(map(len, prompts)),
                                sum(map(len, ids)), 0.0, 0.0)


def engine(echo_header: str | None = None, fail_posts: bool = False) -> type[BaseHTTPRequestHandler]:
    """The reader behind an OpenAI-compatible API. `echo_header`: the answers end with that request
    header's value (a server that echoes what it was sent: the API key, say); `fail_posts`: every
    completion is an HTTP 500 (a broken server)."""

    class Engine(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, {"object": "list", "data": [{"id": "reader", "object": "model", "owned_by": "stub"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if fail_posts:
                return self._send(500, {"error": {"message": f"broken (saw {self.headers.get('Authorization')})"}})
            echo = f" {self.headers.get(echo_header)}" if echo_header else ""
            if "messages" in body:  # chat: the system turn holds the passages, the last user turn the question
                text = "\n".join(m.get("content") or "" for m in body["messages"] if m["role"] == "system")
                question = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
                message = {"role": "assistant", "content": answer(text, question) + echo}
                return self._send(200, {"id": "c", "object": "chat.completion", "created": 0, "model": "reader",
                                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
            question = body["prompt"].split("<|user|>")[-1].split("<|assistant|>")[0]
            self._send(200, {"id": "g", "object": "text_completion", "created": 0, "model": "reader",
                             "choices": [{"index": 0, "text": answer(body["prompt"], question) + echo,
                                          "finish_reason": "stop"}]})

    return Engine
