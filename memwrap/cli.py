"""The ``memwrap`` command. Each subcommand lives in its own module and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

# module path -> the subcommand it registers; imported only when the CLI runs.
SUBCOMMANDS = ("memwrap.memory.cli", "memwrap.demo")


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every available subcommand.

    Example:
        >>> build_parser().prog
        'memwrap'
    """
    parser = argparse.ArgumentParser(prog="memwrap", description="Train models that do not fit in GPU memory.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memwrap`` console script.

    Example:
        >>> main(["plan", "--preset", "gpt2-tiny", "--batch", "1", "--budget", "1GiB"])  # doctest: +SKIP
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
