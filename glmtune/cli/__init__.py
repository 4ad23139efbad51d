"""The `glmtune` command line: one entry point, one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and
sets `func` to a callable taking the parsed namespace and returning an exit code.
User errors (`ValueError`, `FileNotFoundError`) become one-line messages and exit
status 2 instead of tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define subcommands, in the order `--help` lists them.
_COMMAND_MODULES = (
    "glmtune.cli.inspect_cmd",
    "glmtune.cli.data_cmd",
    "glmtune.cli.config_cmd",
    "glmtune.cli.train_cmd",
    "glmtune.cli.export_cmd",
    "glmtune.cli.merge_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glmtune",
        description="Fine-tune GLM-5 family models (GlmMoeDsaForCausalLM), from a laptop to many nodes.",
    )
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"glmtune {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
