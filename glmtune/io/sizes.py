"""Byte sizes written the way users write them: 1000000, "500MB", "5GB", "2GiB"."""

from __future__ import annotations

import argparse

# Longest suffix first: "GB" must not be read as a number ending in "B".
_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a number with an optional KB/MB/GB/TB/KiB/MiB/GiB/TiB/B suffix.

    Raises:
        ValueError: not a size, or a negative one.
    """
    if isinstance(size, int):
        value = size
    else:
        text = size.strip().upper()
        unit = next((u for u in _UNITS if text.endswith(u)), "")
        try:
            value = int(float(text[: len(text) - len(unit)]) * _UNITS.get(unit, 1))
        except (ValueError, OverflowError):  # "banana", "", "inf", "nan"
            value = -1
    if value < 0:
        raise ValueError(f"{size!r} is not a size; use a number of bytes or e.g. 500MB, 5GB")
    return value


def size_arg(text: str) -> int:
    """`parse_size` as an argparse `type=`: argparse prefixes the option's name to the message."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def human_bytes(num_bytes: float) -> str:
    """`1.5 GiB`-style, binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError
