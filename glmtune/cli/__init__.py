"""The `glmtune` command line: one entry point, one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and
sets `func` to a callable taking the parsed namespace and returning an exit code.
User errors become one line and exit status 2 instead of tracebacks: `ValueError`
(bad input, named by file, line, key or option) and `OSError` (a file the
filesystem refuses: missing, not permitted, disk full). Ctrl-C outside training
(which saves a checkpoint first) is "interrupted", exit status 130, from the first
second on: a Ctrl-C while the subcommands are imported (torch among them) is held
until the imports are done (`interrupts_deferred`). `--debug` (or GLMTUNE_DEBUG=1)
shows the traceback instead, for reporting bugs.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import os
import signal
import sys
import threading

from glmtune.cli.version_cmd import VersionAction
from glmtune.io.interrupts import interrupt_received, interrupts_deferred, interrupts_recorded
from glmtune.io.outputs import running
from glmtune.io.text_limits import printable

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
    "glmtune.cli.decide_cmd",
    "glmtune.cli.distill_cmd",
    "glmtune.cli.release_cmd",
    "glmtune.cli.publish_cmd",
    "glmtune.cli.version_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glmtune",
        description="Fine-tune GLM-5 family models (GlmMoeDsaForCausalLM), from a laptop to many nodes.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks instead of one-line errors (also GLMTUNE_DEBUG=1)")
    parser.add_argument("--version", action=VersionAction,
                        help="print the versions of glmtune, torch, transformers, triton, CUDA and the GPU, and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def describe_error(exc: BaseException) -> str:
    """One line for a user error: the message, and for filesystem errors the path too.

    Messages quote what the user (or a file) wrote: control characters are shown escaped,
    so an ESC sequence in a value cannot redraw the terminal.
    """
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return printable(f"{exc.strerror}{where}")
    return printable(str(exc).strip() or type(exc).__name__, multiline=True)


def main(argv: list[str] | None = None) -> int:
    # Building the parser imports every subcommand, torch among them (seconds): a Ctrl-C
    # then is as much "interrupted" as one during the command itself.
    try:
        with interrupts_deferred():
            parser = build_parser()
            args = parser.parse_args(argv)
    except KeyboardInterrupt:
        if _debug(None, argv):
            raise
        return _interrupted(_command_in(sys.argv[1:] if argv is None else argv))
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: a command that relaunches itself
    # "glmtune data validate", not just "glmtune data": name the action that failed.
    command = " ".join(filter(None, (args.command, getattr(args, "data_command", None),
                                     getattr(args, "distill_command", None))))
    try:
        # what the command writes is its own (glmtune/io/outputs.py, --overwrite); a Ctrl-C is recorded
        with running(command), interrupts_recorded():
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if _debug(args):
            raise
        return _interrupted(command)
    except Exception as exc:
        if _debug(args):
            raise
        if interrupt_received():  # native code wrapped the KeyboardInterrupt (torch: a RuntimeError)
            return _interrupted(command)
        if not isinstance(exc, (ValueError, OSError)):
            raise
        _print_on_rank0(f"glmtune {command}: error: {describe_error(exc)}")
        return 2


def run() -> None:
    """The `glmtune` command (and `python -m glmtune`): `main()`, then exit with its status.

    An interrupted command exits 130 through `os._exit` once its output is flushed: a
    KeyboardInterrupt that passed through native code (torch's C++, tokenizers' Rust)
    can leave CPython's own "killed by SIGINT" flag set, which turns a clean `sys.exit(130)`
    into a death by SIGINT (-2) after "interrupted" was printed. Every `finally` of the
    command has run by then; only interpreter shutdown is skipped.

    A crash in native code (a segfault, an abort in a collective library) prints every thread's
    Python stack first (faulthandler): a torchrun rank that dies says where it was.
    """
    faulthandler.enable(all_threads=True)
    try:
        code = main()
    except KeyboardInterrupt:  # a Ctrl-C before main() entered its own handling
        code = _interrupted(_command_in(sys.argv[1:]))
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    # The command is done: a Ctrl-C while the interpreter shuts down (torch's teardown takes a
    # moment) would end the process by SIGINT after it finished; there is nothing left to stop.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # What the command left in reference cycles (a sharded model's modules and hooks hold its process
    # groups) is freed now, while the interpreter is whole: a gloo group whose last reference goes
    # during interpreter shutdown can abort a rank that had finished ("terminate called without an
    # active exception", seen once in CI on a 4-rank job; pytorch/pytorch PR 179291 describes the class).
    gc.collect()
    sys.exit(code)


def _interrupted(command: str) -> int:
    _print_on_rank0(f"glmtune {command}: interrupted" if command else "glmtune: interrupted")
    return 130


def _command_in(argv: list[str]) -> str:
    """The subcommand named in `argv` before it was parsed (`train`), or "" when there is none."""
    names = {module.rsplit(".", 1)[1].removesuffix("_cmd") for module in _COMMAND_MODULES}
    words = [token for token in argv if not token.startswith("-")]
    return words[0] if words and words[0] in names else ""


def _debug(args: argparse.Namespace | None, argv: list[str] | None = None) -> bool:
    """`--debug` (parsed; before parsing finished, among the raw `argv`) or GLMTUNE_DEBUG."""
    if args is not None:
        flag = bool(getattr(args, "debug", False))
    else:
        flag = "--debug" in (sys.argv[1:] if argv is None else argv)
    return flag or os.environ.get("GLMTUNE_DEBUG", "") not in ("", "0")


def _print_on_rank0(message: str) -> None:
    # Under torchrun every rank reaches the same refusal; one copy of the sentence is enough.
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
