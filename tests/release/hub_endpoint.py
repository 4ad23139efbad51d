"""A local Hugging Face Hub endpoint for the publishing tests: the HTTP calls huggingface_hub's
`HfApi.create_repo` and `create_commit` make (as huggingface_hub 2.x sends them), served from
memory, so `glmtune publish` is tested through the real client with HF_ENDPOINT pointing here.

  POST /api/repos/create                        {"name", "organization", "visibility" (or "private"),
                                                "type"} -> {"url"};
                                                409 when the repository exists (exist_ok handles it)
  POST /api/validate-yaml                       {"content": README.md, "repoType"}: the card's front matter
                                                must be a YAML mapping, `base_model` a repository id (the
                                                Hub refuses a local path there), `model-index` a list of
                                                {name, results}; 400 {"errors": [...]} otherwise
  POST /api/models/OWNER/NAME/preupload/REV     {"files": [{"path", "sample", "size"}]} -> each file's
                                                uploadMode; the Hub answers "lfs" for large or binary
                                                files (uploaded through LFS / Xet), "regular" for the
                                                rest: this endpoint answers "regular" for every file,
                                                so every file travels in the commit itself
  POST /api/models/OWNER/NAME/commit/REV        NDJSON: a header line, then one line per file
                                                {"key": "file", "value": {"path", "content", "encoding":
                                                "base64"}} -> {"commitUrl", "commitOid"}

Every request is recorded (method, path, Authorization header); a request for anything else is
answered 404 and recorded too, so a test sees a call this endpoint does not implement.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_PREUPLOAD = re.compile(r"^/api/models/([^/]+/[^/]+)/preupload/([^/]+)$")
_COMMIT = re.compile(r"^/api/models/([^/]+/[^/]+)/commit/([^/]+)$")


@dataclass
class HubState:
    repos: dict[str, dict] = field(default_factory=dict)  # repo id -> {"private", "files": {path: bytes}}
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, authorization)
    unknown: list[str] = field(default_factory=list)
    commits: list[dict] = field(default_factory=list)  # each commit's header
    validated: list[str] = field(default_factory=list)  # the README.md texts sent to validate-yaml


def _metadata_errors(content: str) -> list[str]:
    match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
    if match is None:
        return []  # a README without metadata is accepted (the Hub warns)
    try:
        metadata = yaml.safe_load(match.group(1))
    except yaml.YAMLError as exc:
        return [f"YAML: {exc}"]
    if not isinstance(metadata, dict):
        return ["metadata is not a mapping"]
    errors = []
    bases = metadata.get("base_model")
    for base in [bases] if isinstance(bases, str) else bases or []:
        if not _REPO_ID.match(str(base)):
            errors.append(f'"base_model" {base!r} is not a valid model id')
    for entry in metadata.get("model-index") or []:
        if not isinstance(entry, dict) or "name" not in entry or not isinstance(entry.get("results"), list):
            errors.append('"model-index" entries need a name and a list of results')
    return errors


def _handler(state: HubState, url: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the test reads `state`
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_GET(self) -> None:
            state.requests.append(("GET", self.path, self.headers.get("Authorization")))
            state.unknown.append(f"GET {self.path}")
            self._reply(404, {"error": "not implemented by the test endpoint"})

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            state.requests.append(("POST", path, self.headers.get("Authorization")))
            body = self._body()
            if path == "/api/repos/create":
                return self._create(json.loads(body))
            if path == "/api/validate-yaml":
                return self._validate(json.loads(body)["content"])
            if match := _PREUPLOAD.match(path):
                return self._preupload(match.group(1), json.loads(body))
            if match := _COMMIT.match(path):
                return self._commit(match.group(1), body)
            state.unknown.append(f"POST {path}")
            self._reply(404, {"error": "not implemented by the test endpoint"})

        def _create(self, request: dict) -> None:
            repo = f"{request.get('organization')}/{request['name']}"
            if repo in state.repos:
                return self._reply(409, {"error": "You already created this model repo", "url": f"{url}/{repo}"})
            # huggingface_hub 2.x sends "visibility"; 0.x/1.x sent "private"
            private = request.get("visibility") == "private" or request.get("private") is True
            state.repos[repo] = {"private": private, "files": {}}
            self._reply(200, {"url": f"{url}/{repo}"})

        def _validate(self, content: str) -> None:
            state.validated.append(content)
            errors = _metadata_errors(content)
            self._reply(400 if errors else 200, {"errors": [{"message": e} for e in errors], "warnings": []})

        def _preupload(self, repo: str, request: dict) -> None:
            if repo not in state.repos:
                return self._reply(404, {"error": f"Repository {repo} not found"})
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                     for f in request["files"]]
            self._reply(200, {"files": files, "commitOid": None})

        def _commit(self, repo: str, body: bytes) -> None:
            if repo not in state.repos:
                return self._reply(404, {"error": f"Repository {repo} not found"})
            files = {}
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "header":
                    state.commits.append(item["value"])
                elif item["key"] == "file":
                    value = item["value"]
                    assert value["encoding"] == "base64", value["encoding"]
                    files[value["path"]] = base64.b64decode(value["content"])
                else:
                    state.unknown.append(f"commit operation {item['key']}")
                    return self._reply(400, {"error": f"not implemented: {item['key']}"})
            state.repos[repo]["files"].update(files)
            oid = hashlib.sha1(body).hexdigest()
            self._reply(200, {"commitUrl": f"{url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})

    return Handler


class LocalHub:
    """The endpoint on 127.0.0.1, a free port, in a thread: `with LocalHub() as hub: hub.url`."""

    def __init__(self) -> None:
        self.state = HubState()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), None)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.server.RequestHandlerClass = _handler(self.state, self.url)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LocalHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
