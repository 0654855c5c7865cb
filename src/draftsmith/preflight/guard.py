"""The acceptance guard: is a served drafter accepting as it did on held-back data, and if not, why?

Once an engine is ready, a few short greedy requests (`bench.guard.measure`) give its own per-position acceptance;
`bench.verdict.decide_guard` compares it with the `expected_acceptance` the drafter carries (as trained, degraded,
collapsed), and `check`'s acceptance findings for this exact deployment (read from the engine command) are ranked
as the candidate causes, errors first, each with its fix. The deployment is read from the engine command, so the
guard needs nothing the command does not say.

Exit codes: 0 as trained (or unverified: no expectation recorded and nothing alarming), 6 degraded, 7 collapsed,
2 could not measure. `draftsmith launch --guard` runs it once the engine is ready.

    draftsmith guard --url http://127.0.0.1:8000 -- vllm serve TARGET --speculative-config '{...}'
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftsmith.bench.guard import GUARD_MAX_TOKENS, GUARD_PROMPTS, GUARD_REQUESTS, Expected, measure, read_expected_dir
from draftsmith.bench.verdict import GuardVerdict, decide_guard
from draftsmith.conventions import DFLASH, drafter_family
from draftsmith.errors import DraftsmithError
from draftsmith.files import read_json

# When check names nothing, the known silent killers in the order they are met in the field (docs/engines.md §3,
# vllm#43671, vllm#36545): each is a cause the measurement alone cannot tell apart.
UNNAMED_CAUSES = (
    ("aux layer ids: the engine captures other target layers than the drafter was trained on",
     "compare eagle_aux_hidden_state_layer_ids (top level and eagle_config) with draftsmith.aux_layer_ids_boundary"),
    ("norm flags: the engine computes another norm variant (norm_before_residual, norm_before_fc)",
     "write the trained flags explicitly in config.json; `draftsmith check` names which the engine reads"),
    ("a drafter trained for another target (same hidden size, so it loads)",
     "serve the drafter trained on this target (see the drafter's draftsmith.target)"),
)
# The same for a DFlash drafter: its layer ids and attention are where an engine reads it otherwise
UNNAMED_DFLASH_CAUSES = (
    ("aux layer ids: the engine captures other target layers than the drafter was trained on",
     "compare dflash_config.target_layer_ids (layer outputs; vLLM adds 1) and no stray "
     "eagle_aux_hidden_state_layer_ids with draftsmith.aux_layer_ids_boundary; GGUF: dflash.target_layers"),
    ("attention: the engine runs the block causal (is_causal, dflash_config.causal, a sliding layer_types entry; "
     "GGUF dflash.attention.causal), or another mask token",
     "export again with `draftsmith export` (non-causal, the trained mask_token_id)"),
    UNNAMED_CAUSES[2],
)


@dataclass(frozen=True)
class Deployment:
    engine: str
    target: str
    drafter: Path
    k: int | None
    speculative_config: str | None = None
    engine_python: Path | None = None
    engine_args: str = ""


def flag(cmd: list[str], *names: str) -> str | None:
    for i, arg in enumerate(cmd):
        for name in names:
            if arg == name and i + 1 < len(cmd):
                return cmd[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def deployment_from_command(cmd: list[str]) -> Deployment:
    """Engine, target, drafter and k from a vLLM or llama-server command line."""
    if any("llama-server" in Path(a).name for a in cmd[:2]):
        drafter_gguf = flag(cmd, "-md", "--model-draft")
        if not drafter_gguf:
            raise DraftsmithError("the llama-server command serves no drafter", got=" ".join(cmd[:6]),
                                  expected="-md DRAFTER.gguf --spec-type draft-eagle3", fix="add the drafter")
        k = flag(cmd, "--spec-draft-n-max", "--draft-max", "--draft")
        return Deployment("llamacpp", flag(cmd, "-m", "--model") or "", Path(drafter_gguf).parent,
                          int(k) if k else None)
    raw = flag(cmd, "--speculative-config")
    spec = json.loads(raw) if raw else {}
    if not spec.get("model"):
        raise DraftsmithError("the vLLM command serves no drafter", got=" ".join(cmd[:6]),
                              expected="--speculative-config '{\"method\": \"eagle3\", \"model\": DIR, ...}'",
                              fix="add the drafter")
    after_serve = cmd[cmd.index("serve") + 1] if "serve" in cmd and cmd.index("serve") + 1 < len(cmd) else None
    target = flag(cmd, "--model") or after_serve or ""
    python = Path(cmd[0]) if Path(cmd[0]).name.startswith("python") else None
    k = spec.get("num_speculative_tokens")
    args = " ".join(f"{n} {flag(cmd, n)}" for n in ("--dtype", "--max-model-len") if flag(cmd, n))
    return Deployment("vllm", target, Path(spec["model"]), int(k) if k else None, raw, python, args)


def candidate_causes(dep: Deployment) -> list[dict[str, str]]:
    """check's acceptance findings for this deployment, errors first (check's order), then the silent killers
    check could not rule on; each with its fix."""
    from draftsmith.preflight.check import CheckSettings, run_checks
    from draftsmith.target import resolve_target

    causes: list[dict[str, str]] = []
    try:
        s = CheckSettings(engine=dep.engine, speculative_config=dep.speculative_config, engine_args=dep.engine_args)
        findings, _ = run_checks(resolve_target(dep.target), dep.drafter, s, dep.engine_python)
        causes = [{"rule": f.rule, "severity": f.severity, "cause": f.message, "fix": f.fix} for f in findings
                  if f.kind == "accept" and f.severity in ("error", "warning")]
    except DraftsmithError as err:
        causes.append({"rule": "check.failed", "severity": "warning", "cause": err.what, "fix": err.fix or ""})
    named = " ".join(c["rule"] for c in causes)
    config = dep.drafter / "config.json"
    dflash = config.is_file() and drafter_family(read_json(config, "drafter config")) == DFLASH
    keys = ("capture", "causal", "target") if dflash else ("aux", "norm", "target")  # as check's rules name them
    for (cause, fix), key in zip(UNNAMED_DFLASH_CAUSES if dflash else UNNAMED_CAUSES, keys):
        if key not in named:
            causes.append({"rule": f"unnamed.{key}", "severity": "candidate", "cause": cause, "fix": fix})
    return causes


@dataclass(frozen=True)
class GuardReport:
    verdict: GuardVerdict
    measured: dict[str, Any]
    expected: Expected | None
    causes: list[dict[str, str]]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.verdict.state, "exit_code": self.verdict.exit_code, "reasons": self.verdict.reasons,
                "measured": self.measured, "expected": asdict(self.expected) if self.expected else None,
                "causes": self.causes, "seconds": round(self.seconds, 1)}


def run_guard(url: str, dep: Deployment, prompts: str = GUARD_PROMPTS, requests: int = GUARD_REQUESTS,
              max_tokens: int = GUARD_MAX_TOKENS, expected: Expected | None = None) -> GuardReport:
    """`expected`: the acceptance to hold the engine to; None: the one the drafter carries."""
    m = measure(url, prompts, requests, max_tokens)
    acc = m.acceptance
    expected = expected or read_expected_dir(dep.drafter, dep.k or acc.num_speculative_tokens)
    verdict = decide_guard(expected.per_position if expected else None, acc.per_position, acc.drafts)
    causes = candidate_causes(dep) if verdict.state in ("degraded", "collapsed") else []
    measured = {**acc.to_dict(), "requests": m.requests, "prompts": prompts, "max_tokens": max_tokens,
                "counters_before": m.counters[0], "counters_after": m.counters[1]}
    return GuardReport(verdict, measured, expected, causes, m.seconds)


def render(rep: GuardReport) -> str:
    lines = [f"guard: {rep.verdict.state} ({rep.seconds:.0f} s, {rep.measured['drafts']} drafts over "
             f"{rep.measured['requests']} requests)"] + [f"  {r}" for r in rep.verdict.reasons]
    if rep.expected:
        on = rep.expected.measured_on
        lines.append(f"  expected from: {on.get('method', '?')} on {on.get('data', '?')} "
                     f"({on.get('count', '?')} prompts, k={on.get('k_recorded')}, {on.get('date', '?')})")
    for i, c in enumerate(rep.causes, 1):
        lines.append(f"  cause {i} [{c['severity']}] {c['rule']}: {c['cause']}\n    fix: {c['fix']}")
    return "\n".join(lines)


GUARD_EXAMPLES = (
    "examples:\n"
    "  draftsmith guard --url http://127.0.0.1:8000 -- vllm serve TARGET \\\n"
    "      --speculative-config '{\"method\": \"eagle3\", \"model\": \"DRAFTER\", \"num_speculative_tokens\": 3}'\n"
    "  draftsmith guard --url http://127.0.0.1:8000 -- vllm serve TARGET \\\n"
    "      --speculative-config '{\"method\": \"dflash\", \"model\": \"DRAFTER\", \"num_speculative_tokens\": 7}'\n"
    "  draftsmith guard --url http://127.0.0.1:8080 --json guard.json -- llama-server -m TARGET.gguf \\\n"
    "      -md DRAFTER/drafter-f16.gguf --spec-type draft-eagle3 --spec-draft-n-max 3\n"
    "The engine must already be up (`draftsmith launch --guard` starts it and guards it once ready); the command is\n"
    "the one it was started with, read for the drafter, k and flags. Exit codes: 0 as trained (or unverified), "
    "6 degraded, 7 collapsed, 2 could not measure.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the ready engine's base URL")
    p.add_argument("--prompts", default=GUARD_PROMPTS, help="chat-eval (built in) or a JSONL of prompts")
    p.add_argument("--requests", type=int, default=GUARD_REQUESTS, help="at most this many requests [>= 1]")
    p.add_argument("--max-tokens", type=int, default=GUARD_MAX_TOKENS, help="tokens per request [>= 1]")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("command", nargs="+", help="the engine command, after `--`")


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("guard", help="measure a running engine's acceptance against the drafter's own, name causes",
                       **example_help(GUARD_EXAMPLES))
    add_arguments(p)
    p.set_defaults(func=guard_cli)


def guard_cli(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.max_tokens < 1:
        raise DraftsmithError("bad guard sizes", got=f"--requests {args.requests} --max-tokens {args.max_tokens}",
                              expected="both >= 1", fix="e.g. --requests 8 --max-tokens 48")
    try:
        rep = run_guard(args.url, deployment_from_command(args.command), args.prompts, args.requests, args.max_tokens)
    except DraftsmithError as err:
        print(f"guard: could not measure: {err.render()}", file=sys.stderr)
        return 2
    print(render(rep), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rep.to_dict(), indent=2, default=str) + "\n")
    return rep.verdict.exit_code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftsmith.preflight.guard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return guard_cli(args)
    except DraftsmithError as err:
        print(f"error: {err.render()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
