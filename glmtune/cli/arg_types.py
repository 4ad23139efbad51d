"""argparse `type=` converters that subcommands share (argparse puts the option's name before the message)."""

from __future__ import annotations

import argparse


def count_arg(text: str) -> int:
    """A whole number >= 1 (nodes, processes, rows)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
