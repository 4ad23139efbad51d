"""A served model named on the command line: `--base` / `--candidate` given as
http(s)://HOST:PORT/v1, its options (`EndpointOptions`: the `glmtune eval` endpoint options, each
checked before anything runs), and what the server says of itself (`resolve_endpoint`: the served
model from GET /v1/models, the `server` header, GET /version, the address that answered), which is
the model's fingerprint (`EndpointSource`) — no weights hash: the weights are the engine's.

Every request here already goes through the guarded HTTP path (endpoint_http) with the model's
timeout, retries and response cap; a listing too long to print is quoted in part (`listing`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from glmtune.eval.endpoint_client import FaultLog, RequestFailed, RetryPolicy, call
from glmtune.eval.endpoint_http import (DEFAULT_MAX_RESPONSE_BYTES, MAX_MAX_RESPONSE_BYTES, MIN_MAX_RESPONSE_BYTES,
                                        guarded_client)
from glmtune.eval.endpoint_responses import PARSED_BYTES_FACTOR, listing, read, served_models
from glmtune.io.text_limits import clipped

APIS = ("completions", "chat")
NOT_AVAILABLE = "not available from this engine"
_URL = re.compile(r"^https?://[^/\s]+/v1/?$")
_API_KEY_ENV = "GLMTUNE_ENDPOINT_API_KEY"  # sent as the bearer token; most local servers ignore it
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")  # a container's memory (cgroup v2), when lower


def machine_memory() -> int | None:
    """This machine's memory in bytes (its cgroup's limit when lower); None when it cannot tell."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        limit = _CGROUP_LIMIT.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def is_endpoint(arg: str | os.PathLike[str]) -> bool:
    """Whether a model argument names a server (http:// or https://) rather than a directory."""
    return isinstance(arg, str) and arg.lower().startswith(("http://", "https://"))


@dataclass
class EndpointOptions:
    """The `glmtune eval` options of endpoint models (None: not given on the command line)."""

    api: str | None = None  # "completions" (default) | "chat"
    concurrency: int | None = None  # requests in flight (default 8)
    timeout_s: float | None = None  # per attempt (default 120)
    retries: int | None = None  # attempts after the first (default 3)
    base_model: str | None = None
    candidate_model: str | None = None
    tokenizer: Path | None = None  # the suite's tokenizer + template when no model is local
    max_response_bytes: int | None = None  # the cap on every response body (default 16 MiB)
    # the environment variable holding the bearer token (`glmtune decide`'s --compare key-env=VAR);
    # None: GLMTUNE_ENDPOINT_API_KEY. Only the variable's name is kept: the key is read when a client is made
    api_key_env: str | None = None

    def check(self, base_arg, candidate_arg, compared: tuple = ()) -> None:
        """ValueError (one line, naming the option) for a value out of range, or an endpoint option given
        with no endpoint model to apply to (an accepted setting must take effect). `compared`: the
        `--compare` targets' sources, which the shared options apply to as well."""
        if self.api is not None and self.api not in APIS:
            raise ValueError(f"--api {self.api}: expected one of {', '.join(APIS)}")
        for option, value, low in (("--concurrency", self.concurrency, 1), ("--retries", self.retries, 0)):
            if value is not None and not low <= value <= 1024:
                raise ValueError(f"{option} {value}: expected an integer from {low} to 1024")
        if self.timeout_s is not None and not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 86400):
            raise ValueError(f"--timeout {self.timeout_s}: expected seconds above 0 (at most 86400)")
        if self.max_response_bytes is not None and not (
                MIN_MAX_RESPONSE_BYTES <= self.max_response_bytes <= MAX_MAX_RESPONSE_BYTES):
            raise ValueError(f"--max-response-bytes {self.max_response_bytes}: expected bytes from "
                             f"{MIN_MAX_RESPONSE_BYTES} to {MAX_MAX_RESPONSE_BYTES}")
        for option, value, arg in (("--base-model", self.base_model, base_arg),
                                   ("--candidate-model", self.candidate_model, candidate_arg)):
            if value is not None and not is_endpoint(arg):
                raise ValueError(f"{option} names a served model, but --{option[2:-6]} {arg} is not an endpoint "
                                 "(http(s)://HOST:PORT/v1)")
        if not any(is_endpoint(arg) for arg in (base_arg, candidate_arg, *compared)):
            given = [o for o, v in (("--api", self.api), ("--concurrency", self.concurrency),
                                    ("--timeout", self.timeout_s), ("--retries", self.retries),
                                    ("--tokenizer", self.tokenizer),
                                    ("--max-response-bytes", self.max_response_bytes)) if v is not None]
            if given:
                raise ValueError(f"{given[0]} applies to an endpoint model (--base, --candidate or a --compare "
                                 "http(s)://HOST:PORT/v1); none is one")
        else:
            self._check_memory()

    def _check_memory(self) -> None:
        """ValueError when the responses in flight could, parsed, take more than the machine's memory
        (each up to PARSED_BYTES_FACTOR x its bytes, endpoint_responses)."""
        memory, cap = machine_memory(), self.response_bytes()
        concurrency = self.concurrency if self.concurrency is not None else 8
        need = PARSED_BYTES_FACTOR * cap * concurrency
        if memory is not None and need > memory:
            raise ValueError(f"--max-response-bytes {cap:,} x --concurrency {concurrency}: the responses in flight "
                             f"could take {need / 2**30:,.1f} GiB while parsed (up to {PARSED_BYTES_FACTOR} x "
                             f"their bytes each), more than this machine's {memory / 2**30:,.1f} GiB; lower either")

    def policy(self) -> RetryPolicy:
        return RetryPolicy(self.timeout_s if self.timeout_s is not None else 120.0,
                           self.retries if self.retries is not None else 3)

    def response_bytes(self) -> int:
        return self.max_response_bytes if self.max_response_bytes is not None else DEFAULT_MAX_RESPONSE_BYTES


@dataclass
class EndpointSource:
    """A served model in the place of `models.ModelSource` (what evaluate.py reads of one)."""

    label: str
    role: str
    source: str  # the endpoint URL, ending in /v1
    model: str  # the served model id
    engine: dict[str, str | None]  # {"owned_by", "server", "version"} as the server gives them, "answered_by"
    api: str
    api_key_env: str | None = None  # EndpointOptions.api_key_env (a name, never the key)
    kind: str = "endpoint"
    merged: bool | None = None
    adapter_dir: None = None

    def reads(self) -> list:
        return []  # nothing on disk is read: no output-safety check applies

    def fingerprint(self) -> dict[str, str | None]:
        return {"endpoint": self.source, "model": self.model, "api": self.api,
                "engine_server": self.engine.get("server"), "engine_owned_by": self.engine.get("owned_by"),
                "engine_version": self.engine.get("version"), "answered_by": self.engine.get("answered_by")}


def client_for(url: str, policy: RetryPolicy, max_bytes: int, api_key_env: str | None = None):
    """(the openai client, its guarded HTTP client, their transport) of the endpoint `url`; the bearer
    token is the value of the environment variable `api_key_env` (default GLMTUNE_ENDPOINT_API_KEY)."""
    try:
        import openai  # torch-free; an optional dependency: only endpoint evaluations need it
    except ImportError:
        raise ValueError("an endpoint model needs the openai package (pip install 'glmtune[endpoint]')") from None
    http, transport = guarded_client(url, policy.timeout_s, max_bytes)
    client = openai.OpenAI(base_url=url, api_key=os.environ.get(api_key_env or _API_KEY_ENV, "EMPTY"),
                           timeout=policy.timeout_s, max_retries=0, http_client=http)
    return client, http, transport


def _engine_version(http, url: str, policy: RetryPolicy) -> str | None:
    """GET <root>/version's "version" (vLLM answers it; others 404): None when not given."""
    def version():
        response = http.get(url[:-len("/v1")] + "/version")
        return read(response.content, "version", "GET /version").get("version") if response.is_success else None

    try:  # one attempt of at most 10 s: the engine's version is a courtesy
        value = call(version, FaultLog(), RetryPolicy(min(policy.timeout_s, 10.0), 0), url)
    except RequestFailed:  # not offered, not JSON, too large: the engine does not say
        return None
    return clipped(value, 100) if isinstance(value, (str, int, float)) else None


def resolve_endpoint(arg: str, role: str, options: EndpointOptions) -> EndpointSource:
    """The served model `--<role>` ARG names (its /v1/models listing and the chosen id); ValueError
    (one line) when the server does not answer or the model is ambiguous or unknown."""
    url = arg.rstrip("/")
    if not _URL.match(url):
        raise ValueError(f"--{role} {arg}: an endpoint is http(s)://HOST:PORT/v1")
    policy = options.policy()
    client, http, _ = client_for(url, policy, options.response_bytes(), options.api_key_env)

    def models():
        response = client.models.with_raw_response.list().http_response
        return response, served_models(read(response.content, "models", "GET /v1/models"))  # a malformed one: a fault

    try:
        response, served = call(models, FaultLog(), policy, url)
        version = _engine_version(http, url, policy)
    except RequestFailed as exc:
        raise ValueError(f"--{role} {url}: GET /v1/models failed ({exc})") from None
    finally:
        client.close()
    wanted = options.base_model if role == "base" else options.candidate_model
    if wanted is None:
        if len(served) != 1:
            raise ValueError(f"--{role} {url} serves {len(served):,} models ({listing(served)}); "
                             f"name one with --{role}-model")
        wanted = next(iter(served))
    elif served and wanted not in served:
        raise ValueError(f"--{role}-model {clipped(wanted, 100)}: {url} serves {listing(served)}")
    server = response.headers.get("server")
    engine = {"owned_by": clipped(served[wanted], 100) if served.get(wanted) is not None else None,
              "server": clipped(server, 100) if server is not None else None, "version": version,
              "answered_by": response.extensions.get("glmtune_peer")}
    return EndpointSource(role, role, url, wanted, engine, options.api or "completions", options.api_key_env)
