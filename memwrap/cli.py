"""The ``memwrap`` command. Each subcommand lives in its own module and registers itself here.

Exit status (every subcommand): 0 success, 1 an unexpected failure (or, for ``memwrap demo``, a measured peak
more than 10% from its prediction), 2 bad input (argparse's own errors included), 3 nothing fits the budget.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from memwrap.errors import closest_hint

# module path -> the subcommand it registers; imported only when the CLI runs.
SUBCOMMANDS = ("memwrap.memory.cli", "memwrap.demo.runner")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest option for each unknown one (``--budjet`` ->
    ``--budget``, ``--seq-len`` -> ``--seq``), as Python 3.14's ``suggest_on_error`` does for choices.
    Subparsers are built with the same class, so the suggestion names the subcommand's own options."""

    def parse_known_args(self, args=None, namespace=None):
        self._seen = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _all_options(self) -> list[str]:
        names = list(self._option_string_actions)
        seen = getattr(self, "_seen", [])
        for action in self._actions:  # the top-level parser reports unknown options of the subcommand it ran
            if isinstance(action, argparse._SubParsersAction):
                for command, sub in action.choices.items():
                    if command in seen:
                        names += list(sub._option_string_actions)
        return sorted(set(names))

    def error(self, message: str):
        known = self._all_options()
        hints = []
        for token in getattr(self, "_seen", []):
            if not isinstance(token, str) or not token.startswith("--") or token == "--":
                continue
            name = token.split("=", 1)[0]
            if name not in known and not any(k.startswith(name) for k in known):  # argparse takes unique prefixes
                hint = closest_hint(name, [k for k in known if k.startswith("--")])
                hints.append(f"unknown option {name}.{hint}" if hint else f"unknown option {name}.")
        if hints:
            message = f"{message} ({' '.join(hints)})"
        super().error(message)


def _version() -> str:
    import torch

    import memwrap

    return f"memwrap {memwrap.__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every available subcommand.

    Example:
        >>> build_parser().prog
        'memwrap'
    """
    parser = _Parser(prog="memwrap", description="Train models that do not fit in GPU memory.",
                     epilog="Exit status: 0 success, 2 bad input, 3 nothing fits the budget, 1 any other failure.")
    parser.add_argument("--version", action="version", version=_version())
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
