"""`glmtune publish RELEASE.json --repo OWNER/NAME`: upload a release to a Hugging Face Hub model
repository (the shipped artifact, the model card as README.md, the manifest), in one commit.

The token comes from the environment only (HF_TOKEN, or --token-env NAME), never from an option
and never written anywhere; none is refused before anything is sent. `--dry-run` checks the
release and lists what would be uploaded, without a token or the network.
glmtune/release/publish.py does the work; docs/release.md ("Publishing") says what and why.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "publish", help="upload a release (artifact, model card, manifest) to a Hugging Face Hub repository",
        description="Check a release (its id, and every file it uploads re-hashed), then upload the shipped "
                    "artifact, the model card as README.md and release.json to the Hub model repository REPO in "
                    "one commit, creating the repository if needed. The token is read from $HF_TOKEN (or "
                    "--token-env NAME) and never written. HF_ENDPOINT selects another endpoint. docs/release.md.")
    parser.add_argument("release", metavar="RELEASE.json", help="a release manifest written by `glmtune release`")
    parser.add_argument("--repo", required=True, metavar="OWNER/NAME", help="the Hub model repository")
    parser.add_argument("--token-env", default="HF_TOKEN", metavar="NAME",
                        help="the environment variable holding a write token (default: HF_TOKEN)")
    parser.add_argument("--private", action="store_true", help="create the repository private (if it is new)")
    parser.add_argument("--revision", metavar="BRANCH", help="the branch to commit to (default: main)")
    parser.add_argument("--allow-outside", action="store_true",
                        help="upload artifacts recorded by absolute path, outside the manifest's directory")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the release and list what would be uploaded; no token, nothing sent")
    parser.set_defaults(func=_run)


def _run(ns: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.io.sizes import human_bytes
    from glmtune.io.text_limits import printable
    from glmtune.release.publish import check_repo_id, publish, publish_plan, read_token

    check_repo_id(ns.repo)
    if ns.dry_run:
        manifest, files = publish_plan(ns.release, ns.allow_outside)
        url = None
    else:
        token = read_token(ns.token_env)  # before anything is read or sent
        url, files = publish(ns.release, ns.repo, token, private=ns.private, revision=ns.revision,
                             allow_outside=ns.allow_outside)
    lines = [f"  {f.path_in_repo}  ({human_bytes(f.size)})  <- {f.local}" for f in files]
    total = human_bytes(sum(f.size for f in files))
    head = (f"would upload {len(files)} files ({total}) to {ns.repo} (--dry-run: nothing sent)" if url is None
            else f"published {len(files)} files ({total}) to {ns.repo}: {url}")
    print("\n".join(printable(line) for line in [head, *lines]))
    return 0
