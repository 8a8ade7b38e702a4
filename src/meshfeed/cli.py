"""The ``meshfeed`` command: demo | plan | analyze | convert."""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand modules; each exposes ``add_subcommand(subparsers)``.
_SUBCOMMANDS = (
    "meshfeed.demo",
    "meshfeed.balance.cli",
    "meshfeed.curriculum.cli",
    "meshfeed.sources.convert",
)


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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
