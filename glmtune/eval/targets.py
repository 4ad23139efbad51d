"""A model to compare, `--compare TARGET[,key=value...]` (repeatable; `glmtune eval`'s and `glmtune
decide`'s, which adds its cost key: `glmtune.decide.targets`).

TARGET is an OpenAI-compatible endpoint (http(s)://HOST:PORT/v1: an API, or a model a server runs)
or a local model as `glmtune eval` takes one (an HF directory, a run directory, an adapter). The
keys after it, comma-separated:

  name=LABEL         the arm's label in the report (default: the directory's name, or `HOST:PORT`)
  model=ID           an endpoint's served model (default: the only one its /v1/models lists)
  api=completions|chat   an endpoint's API (default completions: glmtune renders the suite's chat
                     template; chat: the engine's own template, what an API offers)
  key-env=VAR        an endpoint's API key is read from the environment variable VAR (only its name
                     is kept; the key is sent as the bearer token and written nowhere)

A key that does not apply (model, api or key-env of a local model), an unknown key, a repeated or
reserved label, a variable that is not set or empty: one sentence, before anything runs.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.eval.endpoint_source import APIS, is_endpoint

KEYS = ("name", "model", "api", "key-env")
COST_KEY = "cost-per-1k"  # glmtune decide's: the cost of 1,000 requests, shown beside its verdict
REDACTED = "[API key redacted]"  # what eval and decide write in a key's place
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
_ENDPOINT_KEYS = ("model", "api", "key-env")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Target:
    spec: str  # as given
    source: str  # the URL or the path
    label: str
    model: str | None = None
    api: str | None = None
    key_env: str | None = None
    cost_per_1k: float | None = None

    @property
    def is_endpoint(self) -> bool:
        return is_endpoint(self.source)


def check_key_env(option: str, name: str) -> str:
    """`name` when it names a set, non-empty environment variable; ValueError naming `option` otherwise
    (the key itself is never quoted)."""
    if not _ENV_NAME.match(name):
        raise ValueError(f"{option}: {name!r} is not an environment variable name")
    if not os.environ.get(name):
        raise ValueError(f"{option}: the environment variable {name} is not set (or empty); export the API key in it")
    return name


def _default_label(source: str) -> str:
    if is_endpoint(source):
        return source.split("://", 1)[1].split("/", 1)[0]
    return Path(source).resolve().name or "model"


def _cost(option: str, value: str) -> float:
    try:
        cost = float(value)
    except ValueError:
        cost = math.nan
    if not (math.isfinite(cost) and cost >= 0):
        raise ValueError(f"{option}: {COST_KEY}={value}: expected a finite cost >= 0")
    return cost


def parse_target(spec: str, keys: tuple[str, ...] = KEYS) -> Target:
    """One `--compare` value (module docstring); `keys`: the keys this command takes."""
    option = f"--compare {spec}"
    source, *pairs = spec.split(",")
    if not source:
        raise ValueError(f"{option}: no target before the options (an endpoint URL or a model directory)")
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in keys:
            raise ValueError(f"{option}: {pair!r} is not one of {', '.join(k + '=' for k in keys)}")
        if key in values:
            raise ValueError(f"{option}: {key}= given twice")
        values[key] = value
    if not is_endpoint(source) and (given := [k for k in _ENDPOINT_KEYS if k in values]):
        raise ValueError(f"{option}: {given[0]}= applies to an endpoint (http(s)://HOST:PORT/v1); {source} is a "
                         "local model")
    if values.get("api", "completions") not in APIS:
        raise ValueError(f"{option}: api={values['api']}: expected one of {', '.join(APIS)}")
    cost = _cost(option, values[COST_KEY]) if COST_KEY in values else None
    key_env = check_key_env(f"{option}: key-env", values["key-env"]) if "key-env" in values else None
    label = values.get("name") or _default_label(source)
    if not _LABEL.match(label):
        raise ValueError(f"{option}: name {label!r}: a label is letters, digits, '_', '.', ':', '-' (at most 64); "
                         "give one with name=")
    return Target(spec, source, label, values.get("model"), values.get("api"), key_env, cost)


def check_labels(targets: list[Target], reserved: tuple[str, ...]) -> None:
    """Each target's label is its own and none of `reserved` (the arms' labels are the report's columns)."""
    seen: set[str] = set()
    for t in targets:
        if t.label in reserved:
            raise ValueError(f"--compare {t.spec}: the label {t.label!r} is an arm's; give another with name=")
        if t.label in seen:
            raise ValueError(f"--compare {t.spec}: the label {t.label!r} is given twice; tell them apart with name=")
        seen.add(t.label)


def secrets_of(targets: list[Target]) -> list[str]:
    """The API keys the targets are given (the values of their key-env variables), which nothing
    written or printed may hold."""
    return [os.environ[t.key_env] for t in targets if t.key_env and os.environ.get(t.key_env)]


def without_secrets(exc: Exception, secrets: list[str]) -> Exception | None:
    """`exc` again with every secret in its message replaced (a server may echo a key back in an
    error), or None when its message holds none (re-raise it as it is)."""
    text = str(exc)
    if not any(secret in text for secret in secrets):
        return None
    try:
        return type(exc)(redact(text, secrets))
    except Exception:  # an exception type that takes other arguments
        return RuntimeError(redact(text, secrets))


def redact(value: Any, secrets: list[str]) -> Any:
    """`value` with every occurrence of a secret in its strings (keys included) replaced."""
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secrets) for v in value]
    return value
