"""`glmtune release`: record an evaluated run as a release, verify it, compare two.

  glmtune release RUN_DIR --eval EVAL_DIR --engine NAME==VERSION [options]   write release.json
  glmtune release verify RELEASE.json [--key KEYFILE] [--allow-outside] [--json]   re-hash: exit 1 on drift
  glmtune release diff A.json B.json [--json]                                 what changed

One parser takes all three: the first word picks the action, `verify` and `diff` are
keywords and anything else is a RUN_DIR (a run directory literally named `verify` or `diff`
is written `./verify`). Options of one action given to another are refused, never ignored.
Everything printed from a manifest or an option goes through `printable` (a forged green
"ok" is one escape sequence away). docs/release.md says what a release records, what verify
proves (integrity; authenticity only with a signing key) and how to act on its rollback
triggers.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

_ACTIONS = {"verify": ("RELEASE.json",), "diff": ("A.json", "B.json")}
# (option, dest) of the options only `glmtune release RUN_DIR` takes.
_BUILD_OPTIONS = (("--eval", "eval_dir"), ("--previous", "previous"), ("--engine", "engine"),
                  ("--engine-version", "engine_version"), ("--approved-by", "approved_by"),
                  ("--approval-note", "approval_note"), ("--rollback", "rollback"),
                  ("--rollback-margin", "rollback_margin"), ("--allow-failed-gates", "allow_failed_gates"),
                  ("--out", "out"), ("--overwrite", "overwrite"), ("--sign-key", "sign_key"))
# (option, dest) of the options only `glmtune release verify` takes.
_VERIFY_OPTIONS = (("--key", "key"), ("--allow-outside", "allow_outside"))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "release", help="record an evaluated run as a release (release.json); verify or diff releases",
        usage="glmtune release RUN_DIR --eval EVAL_DIR --engine NAME==VERSION [options]\n"
              "       glmtune release verify RELEASE.json [--key KEYFILE] [--allow-outside] [--json]\n"
              "       glmtune release diff A.json B.json [--json]",
        description="Write RUN_DIR's release manifest (base revision and hashes, shipped artifacts, tokenizer and "
                    "template, engine, prompts, eval scores and gates, data provenance and approval, config, "
                    "versions, the previous release, rollback triggers); `verify` re-hashes every artifact a "
                    "release records; `diff` shows what changed between two releases. See docs/release.md.")
    parser.add_argument("words", nargs="+", metavar="RUN_DIR | verify RELEASE.json | diff A.json B.json",
                        help="what to do: a run directory to release, or verify/diff and release files")
    parser.add_argument("--eval", dest="eval_dir", metavar="EVAL_DIR",
                        help="the `glmtune eval` output directory that scored this run (required)")
    parser.add_argument("--engine", metavar="NAME[==VERSION]",
                        help="the inference engine that will serve the release and its version, e.g. vllm==0.11.0 "
                             "(required)")
    parser.add_argument("--engine-version", metavar="V", help="the engine's version, when --engine is a bare name")
    parser.add_argument("--previous", metavar="RELEASE.json",
                        help="the release this one replaces (recorded by path, sha256 and id: the rollback target)")
    parser.add_argument("--approved-by", metavar="NAME", help="who approved the release (recorded with the time)")
    parser.add_argument("--approval-note", metavar="TEXT", help="the approval's note (needs --approved-by)")
    parser.add_argument("--rollback", action="append", metavar="TRIGGER",
                        help="a rollback trigger METRIC[@CATEGORY] OP NUMBER (OP: < <= > >=), e.g. "
                             "'tickets/task_success/exact<0.5' or 'p95_latency_s>2.0'; replaces the default derived "
                             "from the gates for that metric; repeatable")
    parser.add_argument("--rollback-margin", type=float, metavar="FRACTION",
                        help="default triggers sit this fraction of the candidate's evaluated value on the bad side "
                             "of it, or at the gate's bar if that is nearer (default: 0.1)")
    parser.add_argument("--allow-failed-gates", action="store_true",
                        help="release although the eval failed a gate (recorded in the manifest)")
    parser.add_argument("--out", metavar="PATH", help="where to write the manifest (default: RUN_DIR/release.json; "
                        "inside a run directory only RUN_DIR/release.json or RUN_DIR/releases/NAME)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out that is a release manifest (never anything else, never a "
                             "file or directory the release reads)")
    parser.add_argument("--sign-key", metavar="KEYFILE",
                        help="sign the manifest with HMAC-SHA256 and this secret key file (at least 32 bytes, mode "
                             "600; create one with: head -c 32 /dev/urandom > release.key); verify --key checks it")
    parser.add_argument("--key", metavar="KEYFILE",
                        help="verify: check the manifest's signature with this key file; a missing or wrong "
                             "signature fails")
    parser.add_argument("--allow-outside", action="store_true",
                        help="verify: read artifacts recorded by absolute path, outside the manifest's directory "
                             "(done anyway when --key checks the signature)")
    parser.add_argument("--json", action="store_true", help="verify, diff: print the result as JSON")
    parser.set_defaults(func=_run)


def _run(ns: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.io.text_limits import printable

    try:
        return _dispatch(ns)
    except ValueError as exc:  # its message may quote a manifest field, a scorecard's names, a file name
        raise ValueError(printable(str(exc))) from exc


def _dispatch(ns: argparse.Namespace) -> int:
    action, *rest = ns.words
    verify_given = [option for option, dest in _VERIFY_OPTIONS if getattr(ns, dest) not in (None, False)]
    if action in _ACTIONS:
        given = [option for option, dest in _BUILD_OPTIONS if getattr(ns, dest) not in (None, False)]
        if given:
            raise ValueError(f"{given[0]} applies to `glmtune release RUN_DIR`, not to `glmtune release {action}`")
        if action == "diff" and verify_given:
            raise ValueError(f"{verify_given[0]} applies to `glmtune release verify`, not to `glmtune release diff`")
        wanted = _ACTIONS[action]
        if len(rest) != len(wanted):
            raise ValueError(f"`glmtune release {action}` takes {' '.join(wanted)}, got {len(rest)} argument(s)")
        if action == "verify":
            return _verify(rest[0], ns.json, ns.key, ns.allow_outside)
        return _diff(rest[0], rest[1], ns.json)
    if verify_given:
        raise ValueError(f"{verify_given[0]} applies to `glmtune release verify`, not to `glmtune release RUN_DIR` "
                         "(which signs with --sign-key)")
    if rest:
        raise ValueError(f"`glmtune release RUN_DIR` takes one run directory, got {' '.join(ns.words)} (the actions "
                         f"are {', '.join(_ACTIONS)})")
    if ns.json:
        raise ValueError("--json applies to `glmtune release verify` and `diff`; the manifest itself is JSON")
    if not ns.eval_dir:
        raise ValueError("--eval EVAL_DIR is required: the `glmtune eval` directory that scored this run")
    return _create(action, ns)


def _create(run_dir: str, ns: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.io.sizes import human_bytes
    from glmtune.io.text_limits import printable
    from glmtune.release import ReleaseRequest, create_release
    from glmtune.release.triggers import DEFAULT_MARGIN

    request = ReleaseRequest(
        run_dir=run_dir, eval_dir=ns.eval_dir, engine=ns.engine, engine_version=ns.engine_version, out=ns.out,
        overwrite=ns.overwrite, previous=ns.previous, approved_by=ns.approved_by, approval_note=ns.approval_note,
        rollback=ns.rollback or [], allow_failed_gates=ns.allow_failed_gates, sign_key=ns.sign_key,
        rollback_margin=DEFAULT_MARGIN if ns.rollback_margin is None else ns.rollback_margin)
    m, path = create_release(request)
    base, ev = m["base"], m["eval"]
    artifacts = {a["name"]: a for a in m["artifacts"]}
    weights = (base["weights_sha256"] or "none kept")[:12]
    origin = base["revision"] or base["revision_source"].split(":")[0]
    gates = ev["gates"]
    lines = [f"release {m['id']} of run {m['run']['run_id']} ({m['run']['method']}, {m['run']['name']}): {path}",
             f"  base      {base['name_or_path']}: {origin}; weights {weights}",
             "  ships     " + ", ".join(f"{n} ({artifacts[n]['num_files']} files, "
                                        f"{human_bytes(artifacts[n]['size'])})" for n in m["run"]["shipped"]),
             f"  engine    {m['engine']['name']} {m['engine']['version']}" + _facts(m["engine"]),
             f"  eval      suite {ev['suite']['name']} v{ev['suite']['version']}, candidate {ev['candidate']!r}: "
             f"{sum(bool(g['passed']) for g in gates)} of {len(gates)} gates passed"
             + (" (released with --allow-failed-gates)" if ev["allowed_failed_gates"] else "")]
    engine = m["engine"]
    lines += [f"  serve     {engine['serve_command']}"] if engine.get("serve_command") else []
    lines += [f"  caveat    {c}" for c in engine.get("caveats") or []]
    triggers = m["rollback"]["triggers"]
    target = f"release {m['rollback']['to']}" if m["rollback"]["to"] else "the previous deployment (no --previous)"
    lines.append(f"  rollback  to {target} when: " + ("; ".join(t["expression"] for t in triggers) or "no triggers"))
    lines += [f"  rollback  no trigger on {u['metric']}@{u['category']} ({u['source']}): {u['reason']}"
              for u in m["rollback"].get("untriggered") or []]
    approval = m["data"]["approval"]
    lines.append(f"  approval  {approval['approved_by'] if approval else 'none recorded (--approved-by)'}")
    signature = m["signature"]
    lines.append(f"  signed    {signature['algorithm']}, key id {signature['key_id']}" if signature else
                 "  signed    no: verify can show the manifest is intact, not who wrote it (--sign-key)")
    outside = [a["name"] for a in m["artifacts"] if os.path.isabs(a["root"])]
    if outside:
        lines.append(f"  outside   {', '.join(outside)}: recorded by absolute path, outside {path.parent}; "
                     "verify reads them with --key (signed) or --allow-outside")
    print("\n".join(printable(line) for line in lines))
    return 0


def _facts(engine: dict) -> str:
    """Which version the deployment facts were checked against, when it is not the pinned one."""
    checked = engine.get("facts_checked")
    if checked is None:
        return f" ({engine['note']})" if engine.get("note") else ""
    return "" if checked == engine["version"] else f" (serve flags checked against {engine['name']} {checked})"


def _verify(path: str, as_json: bool, key: str | None, allow_outside: bool) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.release.verify import report_lines, verify_release

    result = verify_release(path, key, allow_outside)
    print(json.dumps(result, indent=2) if as_json else "\n".join(report_lines(result)))
    return 0 if result["clean"] else 1


def _diff(path_a: str, path_b: str, as_json: bool) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.release.diff import diff_releases, report_lines

    result = diff_releases(path_a, path_b)
    print(json.dumps(result, indent=2) if as_json else "\n".join(report_lines(result)))
    return 0
