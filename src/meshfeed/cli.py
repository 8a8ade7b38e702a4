"""The ``meshfeed`` command: demo | plan | analyze | convert.

Result tables go to stdout; progress and messages go to stderr through
``logging.getLogger("meshfeed")`` (configured here only if the application has not).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

#: Subcommand modules; each exposes ``add_subcommand(subparsers)``.
_SUBCOMMANDS = (
    "meshfeed.demo",
    "meshfeed.balance.cli",
    "meshfeed.curriculum.cli",
    "meshfeed.sources.convert",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshfeed",
        description="The data layer for large-model training: plan, analyze, convert, demo.",
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
    configure_logging()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
