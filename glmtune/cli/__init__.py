"""The `glmtune` command line: one entry point, one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and
sets `func` to a callable taking the parsed namespace and returning an exit code.
User errors become one line and exit status 2 instead of tracebacks: `ValueError`
(bad input, named by file, line, key or option) and `OSError` (a file the
filesystem refuses: missing, not permitted, disk full). Ctrl-C outside training
(which saves a checkpoint first) is "interrupted", exit status 130. `--debug` (or
GLMTUNE_DEBUG=1) shows the traceback instead, for reporting bugs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Modules that define subcommands, in the order `--help` lists them.
_COMMAND_MODULES = (
    "glmtune.cli.inspect_cmd",
    "glmtune.cli.data_cmd",
    "glmtune.cli.config_cmd",
    "glmtune.cli.plan_cmd",
    "glmtune.cli.train_cmd",
    "glmtune.cli.slurm_cmd",
    "glmtune.cli.export_cmd",
    "glmtune.cli.merge_cmd",
    "glmtune.cli.preflight_cmd",
    "glmtune.cli.eval_cmd",
    "glmtune.cli.release_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glmtune",
        description="Fine-tune GLM-5 family models (GlmMoeDsaForCausalLM), from a laptop to many nodes.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks instead of one-line errors (also GLMTUNE_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # subcommand not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def describe_error(exc: BaseException) -> str:
    """One line for a user error: the message, and for filesystem errors the path too."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return str(exc).strip() or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # "glmtune data validate", not just "glmtune data": name the action that failed.
    command = " ".join(filter(None, (args.command, getattr(args, "data_command", None))))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if _debug(args):
            raise
        _print_on_rank0(f"glmtune {command}: interrupted")
        return 130
    except (ValueError, OSError) as exc:
        if _debug(args):
            raise
        _print_on_rank0(f"glmtune {command}: error: {describe_error(exc)}")
        return 2


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("GLMTUNE_DEBUG", "") not in ("", "0")


def _print_on_rank0(message: str) -> None:
    # Under torchrun every rank reaches the same refusal; one copy of the sentence is enough.
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
