"""Optional signatures of release manifests: HMAC-SHA256 with a secret key the user keeps.

    (umask 077 && head -c 32 /dev/urandom > release.key)    # or chmod 600 it after writing
    glmtune release RUN_DIR ... --sign-key release.key      # release.json gets a `signature`
    glmtune release verify release.json --key release.key   # checks it; a mismatch is exit 1

A release id is an unkeyed content hash: it shows that nothing changed by accident or by
someone who did not also recompute it, but anyone who edits a manifest can recompute it. A
signature needs the key, so a manifest whose signature checks was written (or last signed)
by someone holding the key. It is one key shared by whoever signs and whoever verifies
(HMAC, not a public-key signature): keep it out of the run directory and out of the release.

    "signature": {"algorithm": "hmac-sha256", "key_id": "3f2a9c0d41b7e655", "value": "<64 hex>"}

`value` is HMAC-SHA256(key, canonical JSON of the manifest without `signature`): keys
sorted, separators "," and ":", non-ASCII escaped (`json.dumps(..., sort_keys=True,
separators=(",", ":"))`), so the indentation the file is written with does not matter.
`key_id` names the key without revealing it: the first 16 hex digits of the sha256 of
"glmtune.release key id" + NUL + the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from typing import Any

from glmtune.io import json_out

ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096  # a key, not a file that was passed by mistake (a shard, a PEM bundle)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CREATE = "create one with: (umask 077 && head -c 32 /dev/urandom > release.key)"


def read_key(path: str | os.PathLike[str], option: str) -> bytes:
    """The key in `path` (raw bytes); ValueError naming `option` and the file otherwise.

    Refused: not a regular file, readable or writable by group or others (like ssh's private
    keys: a shared secret that others can read signs for them too), fewer than 32 bytes
    (an HMAC key should carry the hash's 256 bits), more than 4096 bytes.
    """
    label = f"{option} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError as exc:
        raise ValueError(f"{label}: cannot open the key file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)  # of what was opened, not of what the path names a moment later
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{label}: not a regular file; {_CREATE}")
        if info.st_mode & 0o077:
            raise ValueError(f"{label}: group or others may read or write it (mode {stat.S_IMODE(info.st_mode):04o}); "
                             f"chmod 600 {path}")
        key = b""
        while len(key) <= MAX_KEY_BYTES and (chunk := os.read(fd, MAX_KEY_BYTES + 1 - len(key))):
            key += chunk
    finally:
        os.close(fd)
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{label}: {len(key)} bytes; a signing key needs at least {MIN_KEY_BYTES}: {_CREATE}")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"{label}: more than {MAX_KEY_BYTES} bytes, not a signing key: {_CREATE}")
    return key


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"glmtune.release key id\0" + key).hexdigest()[:16]


def signed_bytes(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    # as the file holds it: a non-finite number is written as its spelling (json_out)
    return json.dumps(json_out.finite(body), sort_keys=True, separators=(",", ":")).encode("ascii")


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, str]:
    """The `signature` section for `manifest` (everything in it but `signature`)."""
    value = hmac.new(key, signed_bytes(manifest), hashlib.sha256).hexdigest()
    return {"algorithm": ALGORITHM, "key_id": key_id(key), "value": value}


def check_signature(manifest: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """{"status", "key_id", "problem"}: status "unsigned", "not checked" (signed, no key given),
    "valid", or "failed" with `problem` saying why."""
    signature = manifest.get("signature")
    if signature is None:
        problem = ("not signed, but --key was given: the signature may have been removed, or the release was "
                   "written without --sign-key") if key is not None else None
        return {"status": "failed" if problem else "unsigned", "key_id": None, "problem": problem}
    if not (isinstance(signature, dict) and signature.get("algorithm") == ALGORITHM
            and isinstance(signature.get("key_id"), str) and isinstance(signature.get("value"), str)
            and _HEX64.match(signature["value"])):
        return {"status": "failed", "key_id": None,
                "problem": f"signature is malformed or not {ALGORITHM} (a {ALGORITHM} signature has algorithm, "
                           "key_id and a 64-hex value)"}
    signed_by = signature["key_id"]
    if key is None:
        return {"status": "not checked", "key_id": signed_by, "problem": None}
    if signed_by != key_id(key):
        return {"status": "failed", "key_id": signed_by,
                "problem": f"signed with key id {signed_by}, but --key is key id {key_id(key)}"}
    if not hmac.compare_digest(sign(manifest, key)["value"], signature["value"]):
        return {"status": "failed", "key_id": signed_by,
                "problem": f"signature does not match (key id {signed_by}): the manifest changed after it was signed"}
    return {"status": "valid", "key_id": signed_by, "problem": None}
