"""`draftsmith VERB ...`: one subcommand per pipeline stage.

Each verb lives in its own module, which exposes `add_parser(subparsers)` (registering the verb with a
worked example in its help) and sets `func` on the parsed namespace to a function `(args) -> int`.
Exit codes (DESIGN.md): 0 success, 1 ran and found a problem, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from draftsmith.errors import DraftsmithError

# Verb modules, in pipeline order. Each is imported only to register its parser.
VERB_MODULES = (
    "draftsmith.target",
    "draftsmith.regenerate",
    "draftsmith.capture",
    "draftsmith.train",
    "draftsmith.export",
    "draftsmith.eval",
    "draftsmith.run",
    "draftsmith.check",
    "draftsmith.launch",
    "draftsmith.logs",
    "draftsmith.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train EAGLE-3 drafters and ship them to vLLM and SGLang without surprises.",
        epilog="Run `draftsmith VERB --help` for a worked example of each verb.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERB_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except DraftsmithError as err:
        print(f"error: {err.render()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def example_help(text: str) -> dict:
    """Keyword arguments for `add_parser` that keep the example's line breaks in --help."""
    return {"epilog": text, "formatter_class": argparse.RawDescriptionHelpFormatter}


if __name__ == "__main__":
    sys.exit(main())
