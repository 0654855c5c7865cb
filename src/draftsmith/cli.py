"""`draftsmith VERB ...`: one subcommand per pipeline stage.

Each verb lives in its own module, which exposes `add_parser(subparsers)` (registering the verb with a
worked example in its help) and sets `func` on the parsed namespace to a function `(args) -> int`.
Exit codes (docs/design.md, "Pipeline and verbs"): 0 success, 1 ran and found a problem, 2 bad usage or bad input.
An error is printed through `client.redact`: a URL, header or flag it quotes keeps no credential.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from draftsmith.errors import DraftsmithError
from draftsmith.outputs import holding

# verb -> (module, one-line help), in pipeline order. A verb's module (and with it torch) is imported
# only when that verb runs, so `draftsmith check` and `draftsmith diagnose` start in well under a second.
VERBS = {
    "target": ("draftsmith.target", "resolve a target and print its normalized spec"),
    "regenerate": ("draftsmith.regenerate.command", "answer prompts with the target (local or endpoints) into conversations JSONL"),
    "capture": ("draftsmith.capture.command", "capture target hidden states into a feature store"),
    "export-store": ("draftsmith.capture.interop", "write a feature store in a peer trainer's offline layout (speculators)"),
    "train": ("draftsmith.train.command", "train an EAGLE-3 drafter with training-time test"),
    "export": ("draftsmith.export.formats", "write a drafter in the layout vLLM, SGLang or speculators loads"),
    "convert": ("draftsmith.export.convert", "convert a public EAGLE-3 drafter (EAGLE, SpecForge, ModelOpt, speculators)"),
    "eval": ("draftsmith.eval.evaluation", "reference speculative decoding: acceptance and speed-up"),
    "check": ("draftsmith.preflight.check", "preflight: will this target + drafter start in this engine, and accept?"),
    "launch": ("draftsmith.engines.launch", "start an engine, follow its load, name the root cause if it dies"),
    "guard": ("draftsmith.preflight.guard", "measure a running engine's acceptance against the drafter's own"),
    "diagnose": ("draftsmith.engines.diagnose", "name the root cause of a saved vLLM / SGLang log"),
    "bench": ("draftsmith.bench.benchmark", "load an endpoint, read its spec-decode metrics, say go or no-go"),
    "run": ("draftsmith.run.pipeline", "the whole pipeline in one run directory (default: the embedded SmolLM2 demo)"),
    "report": ("draftsmith.run.report", "re-render a run directory's one-page report (markdown, HTML, JSON)"),
}


TYPE_NAMES = {int: "an integer", float: "a number"}


class Parser(argparse.ArgumentParser):
    """argparse, with a value of the wrong type (`--lr x`, `--batch-tokens abc`) a named error like every other bad
    input: the flag, the text, the type and the flag's bounds (the `[>= 1]` its help ends with), an example.
    Sub-parsers are of this class too (argparse makes them of their parent's)."""

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as err:
            from draftsmith.config import EXAMPLE_VALUES

            flag = "/".join(action.option_strings) or action.metavar or action.dest
            kind = TYPE_NAMES.get(action.type, getattr(action.type, "__name__", "a value"))
            bounds = re.search(r"\[([^\]]+)\]$", action.help or "")
            example = action.default if type(action.default) is action.type else EXAMPLE_VALUES.get(action.type, "")
            raise DraftsmithError(f"bad value for {flag}", got=repr(arg_string),
                                  expected=kind + (f" {bounds.group(1)}" if bounds else ""),
                                  fix=f"e.g. {action.option_strings[0] if action.option_strings else ''} "
                                      f"{example}".strip()) from err


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `verb`'s module registers its full sub-parser (all of them when verb is None)."""
    parser = Parser(
        prog="draftsmith",
        description="Train EAGLE-3 drafters and ship them to vLLM and SGLang without surprises.",
        epilog="Run `draftsmith VERB --help` for a worked example of each verb.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (module, help_text) in VERBS.items():
        if verb is None or name == verb:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(verb if verb in VERBS else "")
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and isinstance(getattr(args, "overrides", None), list) and all("=" in a and a[0] != "-" for a in extra):
            args.overrides += extra  # `run CONFIG --out DIR key=value`: overrides after an option are still overrides
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        with holding():  # an output this command held is free again when it ends
            return int(args.func(args) or 0)
    except DraftsmithError as err:
        from draftsmith.client import redact

        print(f"error: {redact(err.render())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
