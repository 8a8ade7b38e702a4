"""The ``meshfeed`` command: demo | plan | analyze | convert | index | corpora.

Result tables go to stdout; progress and messages go to stderr through
``logging.getLogger("meshfeed")`` (configured here only if the application has not). A user
error (bad arguments, a missing file, a refused input) is one line on stderr and exit code 2,
without a traceback; ``MESHFEED_DEBUG=1`` re-raises it to show one.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from importlib import metadata
from typing import Any, NoReturn

#: Subcommand modules; each exposes ``add_subcommand(subparsers)``.
_SUBCOMMANDS = (
    "meshfeed.demo",
    "meshfeed.balance.cli",
    "meshfeed.curriculum.cli",
    "meshfeed.sources.converters.convert",
    "meshfeed.sources.shards.index",
    "meshfeed.sources.tokens.manifest",
)


def configure_logging(level: int = logging.INFO) -> None:
    """Send the ``meshfeed`` logger's messages to stderr, unless someone already configured it."""
    logger = logging.getLogger("meshfeed")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line: the problem and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """The installed meshfeed version (``unknown`` when run from a source tree only)."""
    try:
        return metadata.version("meshfeed")
    except metadata.PackageNotFoundError:
        return "unknown"


def one_line(error: BaseException) -> str:
    """An exception as one line: its message with line breaks folded."""
    return " ".join(str(error).split()) or type(error).__name__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="meshfeed",
        description="The data layer for large-model training: plan, analyze, convert, index, demo.",
    )
    parser.add_argument("--version", action="version", version=f"meshfeed {version()}")
    parser.add_argument(
        "-q",
        "--quiet",
        dest="quiet_all",  # a subcommand's own -q default would overwrite "quiet"
        action="store_true",
        help="no progress (the same as -q after the command)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(name).add_subcommand(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.quiet_all:
        args.quiet = True
    configure_logging()
    _stop_on_sigterm()
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, ImportError) as e:
        if os.environ.get("MESHFEED_DEBUG"):
            raise
        print(f"meshfeed {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except _Terminated:
        print(f"meshfeed {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"meshfeed {args.command}: interrupted", file=sys.stderr)
        return 130


class _Terminated(KeyboardInterrupt):
    """SIGTERM in the command's process: unwound as an interrupt is, so a command's clean-up
    runs (a conversion deletes its partial output) where the default action left it behind."""


def _stop_on_sigterm() -> None:
    """Turn SIGTERM into :class:`_Terminated` in this process (not in the worker processes it
    forks: they take the default action), where nothing else handles it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    pid = os.getpid()

    def terminated(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a forked worker: die as the default action would
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise _Terminated

    signal.signal(signal.SIGTERM, terminated)


if __name__ == "__main__":
    sys.exit(main())
