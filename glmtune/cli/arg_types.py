"""argparse pieces that subcommands share: `type=` converters (argparse puts the option's name
before their message) and the options of a command that takes a RECIPE and dotted overrides."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

# --dtype of commands that load a checkpoint (auto: the checkpoint config's dtype).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def count_arg(text: str) -> int:
    """A whole number >= 1 (nodes, processes, rows)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class RecipeOptions:
    """The options of a `glmtune COMMAND RECIPE [options] [--section.key value ...]` subcommand,
    accepted before RECIPE (by the subcommand's parser) and after it, among the dotted overrides:
    argparse hands everything after RECIPE to `overrides`, and `parse` takes the options out.

        OPTIONS = RecipeOptions("glmtune slurm", add_flags)
        OPTIONS.register(subparsers, "slurm", help=..., description=..., epilog=..., overrides_help=..., func=run)
        overrides = OPTIONS.parse(namespace)  # in `run`
    """

    def __init__(self, prog: str, add_options: Callable[[argparse.ArgumentParser], None]) -> None:
        self.add_options = add_options
        self.after = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False, exit_on_error=False)
        add_options(self.after)

    def register(self, subparsers: argparse._SubParsersAction, name: str, *, overrides_help: str,
                 func: Callable[[argparse.Namespace], int], **parser_args: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **parser_args)
        parser.add_argument("recipe", help="recipe YAML file or name under recipes/")
        self.add_options(parser)
        parser.add_argument("overrides", nargs=argparse.REMAINDER, help=overrides_help)
        parser.set_defaults(func=func)
        return parser

    def parse(self, namespace: argparse.Namespace) -> list[str]:
        """The options among `namespace.overrides` into `namespace` (one given before RECIPE too is
        replaced); the dotted overrides left. A bad value is a one-line ValueError."""
        try:
            _, rest = self.after.parse_known_args(namespace.overrides, namespace=namespace)
        except argparse.ArgumentError as exc:
            raise ValueError(str(exc)) from None
        return rest
