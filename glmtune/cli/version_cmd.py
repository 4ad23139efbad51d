"""`glmtune version` and `glmtune --version`: one line for bug reports and logs.

    glmtune 0.1.0 | torch 2.13.0+cpu | transformers 5.25.0 | triton 3.9.0 | CUDA cpu | GPU none

The versions of glmtune, torch, transformers and triton ("none" when not installed), the CUDA
(or ROCm) version torch was built with ("cpu" for a CPU build) and the GPU torch sees ("none",
or its name and count). Package versions come from the installed distributions' metadata
(nothing imported); torch is imported for its build and its GPU, when the line is asked for
only: `glmtune --help` stays torch-free (tests/cli/test_torch_free.py).
"""

from __future__ import annotations

import argparse
from importlib import metadata

from glmtune.io.version import __version__

# Triton ships as `triton` (CUDA wheels) or as a ROCm build of its own name.
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton-rocm", "pytorch-triton")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "version",
        help="print the versions of glmtune, torch, transformers, triton, CUDA and the GPU (one line)",
        description="Print one line with the versions of glmtune, torch, transformers and triton, the CUDA "
        "version torch was built with (cpu: none) and the GPU it sees: paste it into a bug report.",
    )
    parser.set_defaults(func=_version)


class VersionAction(argparse.Action):
    """`glmtune --version`: the line, then exit 0 (argparse's own version action wants the text at
    parser-build time, which would import torch for every command)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def _version(args: argparse.Namespace) -> int:
    print(version_line())
    return 0


def distribution_version(*names: str) -> str:
    """The installed version of the first of `names` that is installed, else "none"."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def version_line() -> str:
    """The one line: glmtune, torch, transformers, triton, CUDA, GPU."""
    # lazily: `glmtune --help` stays torch-free; the line needs torch's build and devices
    import torch

    if torch.version.cuda:
        accelerator = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        accelerator = f"ROCm {torch.version.hip}"
    else:
        accelerator = "CUDA cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = f"{torch.cuda.get_device_name(0)}" + (f" x {count}" if count > 1 else "") if count else "none"
    return " | ".join((
        f"glmtune {__version__}",
        f"torch {torch.__version__}",
        f"transformers {distribution_version('transformers')}",
        f"triton {distribution_version(*_TRITON_DISTRIBUTIONS)}",
        accelerator,
        f"GPU {gpu}",
    ))
