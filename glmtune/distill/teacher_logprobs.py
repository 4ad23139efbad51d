"""A teacher's per-token log-probabilities as an engine returns them, read into the sidecar's arrays.

Engines name tokens as strings, in two shapes:

  * /v1/completions (`logprobs: K`): `logprobs = {tokens: [str], token_logprobs: [float],
    top_logprobs: [{token string: log-prob}]}` (vLLM adds the sampled token to its position's
    alternatives when it is not among the top K: up to K + 1 entries);
  * /v1/chat/completions (`logprobs: true, top_logprobs: K`): `logprobs = {content: [{token,
    logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.

A token string is mapped to its id (`TokenMap`): vLLM's `return_tokens_as_token_ids` spells it
"token_id:N"; otherwise its bytes (the chat API's `bytes`, else the string's UTF-8) are looked up
in the teacher tokenizer's vocabulary (byte-level BPE pieces decoded through GPT-2's byte table;
added tokens by their text). A token that is no piece, or that several pieces spell, cannot be
mapped: the row is refused (`Malformed`, reason "unmappable token"), never guessed.

Each position then holds the K most likely (id, log-prob) pairs, sorted, padded with (-1, -inf)
when the engine gave fewer. Refused, naming the first position at fault (`Malformed(reason,
detail)`, the reason a short phrase the manifest counts): more than K + 1 alternatives ("wrong
K"), a log-prob that is not a finite number <= 0 ("bad log-prob"; NaN never parses: the JSON
reader refuses it first), an id outside the tokenizer ("id out of vocabulary"), one id twice at a
position, list lengths that disagree ("length mismatch"), and tokens that do not spell the answer
text ("tokens do not spell the answer").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

_TOKEN_ID = re.compile(r"^token_id:(\d{1,10})$")
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class Malformed(Exception):
    """A teacher answer whose log-probabilities cannot be stored; `reason` is counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class TopK:
    """One answer's positions: the sampled ids [n], top-K ids [n, K] and log-probs [n, K]."""

    generated: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray


class TokenMap:
    """Token strings (or bytes) of an engine's answer to the teacher tokenizer's ids (module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = len(tokenizer)
        self._by_bytes: dict[bytes, int] = {}
        ambiguous: set[bytes] = set()
        added = {token.content for token in tokenizer.added_tokens_decoder.values()}
        for piece, token_id in tokenizer.get_vocab().items():
            spelled = piece.encode() if piece in added else _piece_bytes(piece)
            if spelled is None:
                continue
            if spelled in self._by_bytes and self._by_bytes[spelled] != token_id:
                ambiguous.add(spelled)
            self._by_bytes[spelled] = token_id
        for spelled in ambiguous:
            del self._by_bytes[spelled]

    def id_of(self, token: Any, spelled: Any = None) -> int:
        if not isinstance(token, str):
            raise Malformed("malformed log-probs", f"a token {str(token)[:40]!r} that is not a string")
        match = _TOKEN_ID.match(token)
        if match:
            token_id = int(match.group(1))
        else:
            key = bytes(spelled) if _is_bytes(spelled) else token.encode("utf-8", "surrogatepass")
            token_id = self._by_bytes.get(key, -1)
            if token_id < 0:
                raise Malformed("unmappable token", f"{token[:40]!r} is no single token of the teacher tokenizer")
        if token_id >= self.vocab_size:
            raise Malformed("id out of vocabulary", f"token id {token_id} (the tokenizer has {self.vocab_size})")
        return token_id


def _piece_bytes(piece: str) -> bytes | None:
    """A byte-level BPE piece's bytes; None for a piece that is not one (a SentencePiece piece)."""
    try:
        return bytes(_BYTE_OF_CHAR[char] for char in piece)
    except KeyError:
        return None


def _is_bytes(value: Any) -> bool:
    return isinstance(value, list) and all(type(b) is int and 0 <= b < 256 for b in value)


def _logprob(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value > 0:
        raise Malformed("bad log-prob", f"{where}: {str(value)[:40]} is not a finite number <= 0")
    return float(value)


def _position(alternatives: list[tuple[int, float]], k: int, where: str) -> tuple[list[int], list[float]]:
    """The position's K most likely (id, log-prob) pairs, padded with (-1, -inf)."""
    if len(alternatives) > k + 1:  # the sampled token may come on top of the K (vLLM)
        raise Malformed("wrong K", f"{where}: {len(alternatives)} alternatives for top-{k}")
    ids = [token_id for token_id, _ in alternatives]
    if len(set(ids)) != len(ids):
        raise Malformed("malformed log-probs", f"{where}: a token id given twice")
    ranked = sorted(alternatives, key=lambda pair: -pair[1])[:k]
    ranked += [(-1, -math.inf)] * (k - len(ranked))
    return [token_id for token_id, _ in ranked], [lp for _, lp in ranked]


def _arrays(generated: list[int], positions: list[tuple[list[int], list[float]]]) -> TopK:
    k = len(positions[0][0]) if positions else 0
    ids = np.array([p[0] for p in positions], dtype=np.int32).reshape(len(positions), k)
    values = np.array([p[1] for p in positions], dtype=np.float32).reshape(len(positions), k)
    return TopK(np.array(generated, dtype=np.int32), ids, values)


def from_completion(logprobs: Any, k: int, tokens: TokenMap) -> TopK | None:
    """A /v1/completions choice's `logprobs` as arrays; None when the engine gave none."""
    if not logprobs:
        return None
    if not isinstance(logprobs, dict):
        raise Malformed("malformed log-probs", "logprobs is not an object")
    strings, sampled, top = (logprobs.get(key) for key in ("tokens", "token_logprobs", "top_logprobs"))
    if not (isinstance(strings, list) and isinstance(sampled, list) and isinstance(top, list)):
        raise Malformed("malformed log-probs", "logprobs.tokens, token_logprobs and top_logprobs must be lists")
    if not len(strings) == len(sampled) == len(top):
        raise Malformed("length mismatch", f"{len(strings)} tokens, {len(sampled)} token_logprobs, "
                                           f"{len(top)} top_logprobs")
    generated, positions = [], []
    for i, (token, alternatives) in enumerate(zip(strings, top)):
        where = f"position {i}"
        generated.append(tokens.id_of(token))
        _logprob(sampled[i], where)
        if not isinstance(alternatives, dict):
            raise Malformed("malformed log-probs", f"{where}: top_logprobs is not an object")
        pairs = [(tokens.id_of(t), _logprob(v, where)) for t, v in alternatives.items()]
        positions.append(_position(pairs, k, where))
    return _arrays(generated, positions) if positions else _empty(k)


def from_chat(logprobs: Any, k: int, tokens: TokenMap) -> TopK | None:
    """A /v1/chat/completions choice's `logprobs` as arrays; None when the engine gave none."""
    if not logprobs:
        return None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if content is None:
        return None
    if not isinstance(content, list):
        raise Malformed("malformed log-probs", "logprobs.content is not a list")
    generated, positions = [], []
    for i, entry in enumerate(content):
        where = f"position {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("top_logprobs"), list):
            raise Malformed("malformed log-probs", f"{where}: not an object with a top_logprobs list")
        generated.append(tokens.id_of(entry.get("token"), entry.get("bytes")))
        _logprob(entry.get("logprob"), where)
        pairs = []
        for alternative in entry["top_logprobs"]:
            if not isinstance(alternative, dict):
                raise Malformed("malformed log-probs", f"{where}: an alternative that is not an object")
            pairs.append((tokens.id_of(alternative.get("token"), alternative.get("bytes")),
                          _logprob(alternative.get("logprob"), where)))
        positions.append(_position(pairs, k, where))
    return _arrays(generated, positions) if positions else _empty(k)


def _empty(k: int) -> TopK:
    return TopK(np.zeros(0, np.int32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32))


def cut_at_stop(topk: TopK, stop_ids: set[int]) -> TopK:
    """The positions up to the first stop token, included: an engine that returns its end-of-turn
    token's log-prob (vLLM) gives the teacher's distribution where the student learns to end the turn;
    the answer's text does not hold it."""
    stops = [i for i, token in enumerate(topk.generated.tolist()) if token in stop_ids]
    if not stops:
        return topk
    n = stops[0] + 1
    return TopK(topk.generated[:n], topk.ids[:n], topk.logprobs[:n])


def check_spells(topk: TopK, text: str, tokenizer: Any, stop_ids: set[int]) -> None:
    """Malformed unless the sampled tokens (a last stop token aside) decode to the answer's text."""
    tokens = topk.generated.tolist()
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    spelled = tokenizer.decode(tokens, skip_special_tokens=False)
    if spelled != text:
        raise Malformed("tokens do not spell the answer",
                        f"{len(tokens)} tokens decode to {spelled[:60]!r}, the answer is {text[:60]!r}")
