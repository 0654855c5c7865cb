"""`draftsmith run`'s stage runners: each calls its verb with typed settings taken from the run config.

`RUNNERS` maps a stage to its runner; `RunContext` is what the stages share (the run directory, the vLLM
interpreter, the launch stage's speculative server while it runs, the engine lock). bench measures vLLM, then
llama.cpp's `llama-server` (bench.llamacpp_k).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftsmith.client import redact
from draftsmith.errors import DraftsmithError
from draftsmith.export.formats import DEFAULT_K
from draftsmith.run.settings import RunConfig

LOCK_ENV = "DRAFTSMITH_ENGINE_LOCK"  # a file to flock while an engine runs (shared machines)


def engine_interpreter(cfg: RunConfig) -> Path | None:
    """The vLLM interpreter, or None when it is not installed."""
    from draftsmith.engines.process import engine_python

    if cfg.engine_python:
        return Path(cfg.engine_python).expanduser() if Path(cfg.engine_python).expanduser().is_file() else None
    try:
        return engine_python("vllm")
    except DraftsmithError:
        return None


@dataclass
class Served:
    """A vLLM server this run started: its k, its URL, and what stops it (closing twice is harmless)."""

    k: int
    url: str
    stop: contextlib.ExitStack


@dataclass
class RunContext:
    """What one `run` shares between stages."""

    cfg: RunConfig
    out: Path
    python: Path | None
    stack: contextlib.ExitStack
    launched: Served | None = None
    """The speculative server the launch stage started, while it runs (bench measures it first)."""
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

    def engine_ks(self) -> list[int]:
        """The draft lengths vLLM serves the drafter at (bench.k), ascending; launch serves the largest."""
        return sorted(set(self.cfg.bench.k))

    @property
    def family(self) -> str:
        """The drafter family as the engines name it (vLLM's method, llama.cpp's draft-<family>): eagle3 | dflash."""
        return self.cfg.train.family

    def speculative_config(self, k: int) -> str:
        """vLLM's --speculative-config for the vLLM export at k (check, guard)."""
        return json.dumps({"method": self.family, "model": str(self.export_dir("vllm")), "num_speculative_tokens": k})


def do_regenerate(ctx: RunContext) -> None:
    from draftsmith.regenerate.conversations import ConversationWriter
    from draftsmith.regenerate.endpoints import regenerate_endpoints_sync
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.regenerate.command import regenerate_local
    from draftsmith.target import load_target, resolve_target

    r = ctx.cfg.regenerate
    if r.prompts == "self":
        return regenerate_self_stage(ctx)
    prompts = load_prompts(r.prompts, r.limit)
    with ConversationWriter(ctx.out / "conversations.jsonl") as writer:
        if r.endpoints:
            summary = regenerate_endpoints_sync(prompts, list(r.endpoints), writer, r.endpoint())
            if not summary.ok:
                raise DraftsmithError("regenerate left prompts undone", got=summary.render(),
                                      expected="every prompt answered", fix="rerun: finished ids are kept")
        else:
            model, tokenizer = load_target(resolve_target(ctx.cfg.target), dtype=r.dtype, device=r.device)
            summary = regenerate_local(prompts, model, tokenizer, writer, r.local(), r.reasoning,
                                       target_name=ctx.cfg.target)
    (ctx.out / "regenerate.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n")


def regenerate_self_stage(ctx: RunContext) -> None:
    """prompts: self: the local target writes and answers its own prompts (regenerate.regenerate_self)."""
    from draftsmith.regenerate.conversations import ConversationWriter
    from draftsmith.regenerate.command import LocalCompleter, end_of_turn_stops, regenerate_self
    from draftsmith.target import load_target, resolve_target

    r = ctx.cfg.regenerate
    if r.endpoints:
        raise DraftsmithError("regenerate.prompts: self runs on the local target", got=f"endpoints {list(r.endpoints)}",
                              expected="regenerate.endpoints: []", fix="drop the endpoints or use a prompt file")
    model, tokenizer = load_target(resolve_target(ctx.cfg.target), dtype=r.dtype, device=r.device)
    settings = r.local()
    complete = LocalCompleter(model, tokenizer, settings, end_of_turn_stops(tokenizer)[0])
    with ConversationWriter(ctx.out / "conversations.jsonl") as writer:
        summary = regenerate_self(complete, tokenizer, writer, r.self_prompts(), settings, r.reasoning,
                                  target_name=ctx.cfg.target)
    print(summary.render())
    (ctx.out / "regenerate.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    if not (ctx.out / "conversations.jsonl").read_text().strip():
        raise DraftsmithError("every self-written user turn was filtered out", got=summary.first_turns.render(),
                              expected="at least one kept turn",
                              fix="raise regenerate.self_count, or lower regenerate.self_temperature")


def do_capture(ctx: RunContext) -> None:
    from draftsmith.capture.local import capture

    c = ctx.cfg.capture
    if c.engine == "vllm":
        capture_through_engine(ctx)
        return
    capture(ctx.out / "conversations.jsonl", ctx.out / "store", c, target=ctx.cfg.target, family=ctx.family)


def capture_through_engine(ctx: RunContext) -> None:
    """capture.engine vllm: the store through vLLM's extract_hidden_states (a server run starts from
    engine_python, or capture.endpoint), resumable by shard like the in-process capture."""
    from draftsmith.capture.vllm import engine_capture, engine_settings

    c, store = ctx.cfg.capture, ctx.out / "store"
    settings = engine_settings(c, store, ctx.python)
    engine_capture(ctx.out / "conversations.jsonl", store, settings, ctx.cfg.target, max_length=c.max_length,
                   endpoint=c.endpoint, dtype=c.dtype, max_store_bytes=c.max_store_bytes,
                   store_wait_timeout_s=c.store_wait_timeout_s)


def do_train(ctx: RunContext) -> None:
    from draftsmith.train.settings import TrainConfig, recipe_for, starting_drafter
    from draftsmith.train.trainer import Trainer

    t, online = ctx.cfg.train, ctx.cfg.train.mode == "online"
    # auto for DFlash: from scratch (the shipped drafters are EAGLE-3's; run's config refuses an explicit other family)
    init_from = None if t.family == "dflash" and t.init_from == "auto" else \
        starting_drafter(t.init_from, ctx.cfg.target, ctx.cfg.export.formats).drafter
    with Trainer(TrainConfig(
        **t.model_dump(exclude={"mode", "init_from", "recipe"}), init_from=init_from,
        recipe=recipe_for(t.recipe, ctx.cfg.export.formats),
        out=str(ctx.out / "train"), store=None if online else str(ctx.out / "store"),
        conversations=str(ctx.out / "conversations.jsonl") if online else None, target=ctx.cfg.target,
        max_length=ctx.cfg.capture.max_length)) as trainer:  # its loader thread ends here, not at exit
        trainer.run()


def do_export(ctx: RunContext) -> None:
    from draftsmith.export.formats import export
    from draftsmith.target import resolve_target

    target_path = str(resolve_target(ctx.cfg.target))
    # the card's k: export.k, else DEFAULT_K (DFlash: within the block); the engines serve bench's k, and the
    # expected acceptance the export records covers every k the drafter was measured at
    k = ctx.cfg.export.k or (min(DEFAULT_K, ctx.cfg.train.block_size - 1) if ctx.family == "dflash" else DEFAULT_K)
    for fmt in ctx.cfg.export.formats:  # overwrite: the run owns its stage folders (pipeline.claim_run_dir)
        export(ctx.drafter, ctx.export_dir(fmt), fmt, dtype=ctx.cfg.export.dtype, k=k, target_path=target_path,
               overwrite=True)


def do_eval(ctx: RunContext) -> None:
    from draftsmith.eval.evaluation import recommend, run_eval

    e = ctx.cfg.eval
    results = run_eval(ctx.cfg.target, ctx.drafter, e)
    best = recommend(results)
    settings = e.record()
    (ctx.out / "eval.json").write_text(json.dumps({**asdict(best), "recommended_k": best.k, "settings": settings,
                                                   "sweep": [asdict(r) for r in results]}, indent=2) + "\n")


def do_check(ctx: RunContext) -> None:
    from draftsmith.preflight.check import CheckSettings, run_checks, verdict
    from draftsmith.target import resolve_target

    c, launch = ctx.cfg.check, ctx.cfg.launch
    target = resolve_target(ctx.cfg.target)
    report = {}
    for engine in c.engines:
        drafter = ctx.export_dir(engine)
        spec_raw = ctx.speculative_config(ctx.engine_ks()[-1]) if engine == "vllm" else None
        args = c.engine_args + (f" --max-model-len {launch.max_model_len} --dtype {launch.dtype}"
                                if engine == "vllm" else "")
        python = ctx.python if engine == "vllm" else None
        s = CheckSettings(engine=engine, engine_version=c.vllm_version if engine == "vllm" else c.sglang_version,
                          speculative_config=spec_raw, engine_args=args.strip())
        findings, facts = run_checks(target, drafter, s, python)
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
def engine_server(ctx: RunContext, log: Path, k: int | None) -> Iterator[tuple[str, Any]]:
    """vLLM serving the target, with the vLLM export as drafter at k drafted tokens per step (None: without
    speculation), supervised by draftsmith.engines.launch: yields (base URL, LaunchResult) once ready; raises with
    the root cause if it dies."""
    from draftsmith.engines.process import VLLM_CPU_ENV, VllmServe, free_port, spawn, stop_tree
    from draftsmith.engines.launch import report, supervise
    from draftsmith.target import resolve_target

    la = ctx.cfg.launch
    spec = VllmServe(target=resolve_target(ctx.cfg.target), drafter=ctx.export_dir("vllm") if k else None,
                     num_speculative_tokens=k or DEFAULT_K, port=free_port(), dtype=la.dtype,
                     max_model_len=la.max_model_len, extra_args=la.extra_args, method=ctx.family)
    url = f"http://127.0.0.1:{spec.port}"
    print(f"run: starting {f'speculative (k={k})' if k else 'baseline'} vLLM server (log {log})")
    proc = spawn(spec.command(ctx.python), log, env={**os.environ, **VLLM_CPU_ENV})
    try:
        res = supervise(log, url, proc, la.timeout_s, la.stall_timeout_s)
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
    """The speculative server at the largest k of bench.k, kept running for bench."""
    ctx.hold_engine_lock()
    k, server = ctx.engine_ks()[-1], contextlib.ExitStack()
    ctx.stack.callback(server.close)
    try:
        url, res = server.enter_context(engine_server(ctx, ctx.out / "launch.log", k))
    except DraftsmithError as err:
        (ctx.out / "launch.json").write_text(json.dumps({"status": "failed", "error": redact(err.render()),
                                                         "log": str(ctx.out / "launch.log")}, indent=2) + "\n")
        raise
    ctx.launched = Served(k, url, server)
    (ctx.out / "launch.json").write_text(json.dumps(launch_record(res, k), indent=2, default=str) + "\n")


def do_guard(ctx: RunContext) -> None:
    """The acceptance guard on launch's server (started again when an earlier invocation launched it) before bench
    spends its time: a collapse fails the run with the candidate causes; degraded is recorded and bench goes on."""
    from draftsmith.preflight.guard import Deployment, render, run_guard
    from draftsmith.target import resolve_target

    if ctx.launched is None:  # launch finished in an earlier invocation (a guard that failed, then a rerun)
        print("run: guard: launch's server stopped with the invocation that started it; starting it again")
        do_launch(ctx)
    k, drafter = ctx.launched.k, ctx.export_dir("vllm")
    la = ctx.cfg.launch
    dep = Deployment("vllm", str(resolve_target(ctx.cfg.target)), drafter, k, ctx.speculative_config(k), ctx.python,
                     f"--dtype {la.dtype} --max-model-len {la.max_model_len}")
    rep = run_guard(ctx.launched.url, dep, **guard_reference(ctx, k))
    print("run: " + render(rep).replace("\n", "\nrun: "))
    (ctx.out / "guard.json").write_text(json.dumps(rep.to_dict(), indent=2, default=str) + "\n")
    if rep.verdict.state == "collapsed":
        first = rep.causes[0] if rep.causes else None
        raise DraftsmithError("the served drafter's acceptance collapsed", got=rep.verdict.reasons[0],
                              expected="position 0 near what the drafter showed on held-back data",
                              fix=f"{first['cause']}: {first['fix']}" if first else "run draftsmith check")


def guard_reference(ctx: RunContext, k: int) -> dict[str, Any]:
    """What the guard holds launch's server to: this run's eval at k when it measured k (the reference decoder's
    per-position acceptance, greedy, on eval's prompts and length, which the guard then sends: the engines match it
    within 0.005 in tau, tests/test_engine_dflash.py), else the expectation the export carries, on the guard's own
    chat prompts (run_guard's defaults)."""
    from draftsmith.bench.guard import EXPECTED_KEY, GUARD_REQUESTS, expected_from_eval_json, read_expected

    e, path = ctx.cfg.eval, ctx.out / "eval.json"
    doc = json.loads(path.read_text()) if path.is_file() and "eval" not in ctx.cfg.skip else {}
    if e.topk != 1 or not any(r.get("k") == k for r in doc.get("sweep") or []):
        return {}
    rec = expected_from_eval_json(doc, k, f"{e.prompts} (this run's eval)")
    return {"expected": read_expected({"draftsmith": {EXPECTED_KEY: rec}}, k), "prompts": e.prompts,
            "requests": e.limit or GUARD_REQUESTS, "max_tokens": e.max_new_tokens}


@contextlib.contextmanager
def speculative_server(ctx: RunContext, k: int, log_dir: Path) -> Iterator[str]:
    """The URL of a speculative server at k: the launch stage's when it serves k, else a new one; stopped
    when the context closes, so the next k's server never runs beside it."""
    launched = ctx.launched if ctx.launched and ctx.launched.k == k else None
    if launched:
        ctx.launched = None
        with launched.stop:
            yield launched.url
        return
    with engine_server(ctx, log_dir / f"speculative-k{k}.log", k) as (url, _):
        yield url


def sweep_order(ks: list[int], launched_k: int | None) -> list[int]:
    """The order bench measures ks in: the one launch already serves first, then the rest descending."""
    return sorted(ks, key=lambda k: (k != launched_k, -k))


def do_bench(ctx: RunContext) -> None:
    """vLLM's k sweep (when its interpreter is there), then llama.cpp's (bench.llamacpp_k), never both at once.
    A resumed bench keeps vLLM's finished sweep (bench.json is written last) and measures llama.cpp again."""
    out = ctx.out / "bench"
    out.mkdir(parents=True, exist_ok=True)
    ctx.hold_engine_lock()
    if ctx.python is None:
        print("run: bench: no vLLM interpreter (`make engine-venv`), llama.cpp only")
    elif (out / "bench.json").exists():
        print("run: bench: vLLM finished before this bench was interrupted (bench/bench.json), kept")
    else:
        bench_vllm(ctx, out)
    if ctx.cfg.bench.llamacpp_k:
        bench_llamacpp(ctx, out / "llamacpp")


def bench_vllm(ctx: RunContext, out: Path) -> None:
    """vLLM at each k of bench.k against one baseline server: bench.json (the chosen k's report), k<K>.json."""
    from draftsmith.bench.benchmark import BenchSettings
    from draftsmith.bench.sweep import measure_sweep

    b = ctx.cfg.bench
    s = BenchSettings(**b.model_dump(include=set(BenchSettings.model_fields)))
    ks = sweep_order(ctx.engine_ks(), ctx.launched.k if ctx.launched else None)
    with contextlib.ExitStack() as baseline:
        base_url = None if not b.baseline else b.baseline_endpoint or \
            baseline.enter_context(engine_server(ctx, out / "baseline.log", None))[0]
        reports = measure_sweep(ks, lambda k: speculative_server(ctx, k, out), base_url, s)
    write_sweep(reports, "vLLM", out, out / "bench.json")


def write_sweep(reports: dict[int, dict], name: str, per_k: Path, result: Path, **extra: Any) -> None:
    """Each k's report as `per_k/k<K>.json`; the chosen k's (sweep.choose_from_reports), with `extra` and the sweep
    record, as `result`; its plots into `per_k`."""
    from draftsmith.bench.render import print_report, write_plots
    from draftsmith.bench.sweep import choose_from_reports, sweep_record

    for k, report in reports.items():
        (per_k / f"k{k}.json").write_text(json.dumps(report, indent=2) + "\n")
    choice = choose_from_reports(reports)
    chosen = reports[choice.k if choice.k is not None else max(reports)]
    doc = {**chosen, **extra, "sweep": sweep_record(reports, choice)}
    result.write_text(json.dumps(doc, indent=2) + "\n")
    write_plots(doc, per_k)
    print_report(doc)
    print(f"run: {name} k={choice.k}: {choice.reason}")


# ---------------------------------------------------------------- llama.cpp in bench

# The target as an f32 GGUF, where SERVE_P_MIN pays (a q8_0 target stayed slower than its plain server, 0.80x at
# k=3: llamacpp.SERVE_P_MIN's sources); the drafter as f16, half the bytes each draft step reads: on this CPU 1.15x
# against 1.08x for the f32 drafter at k=3, p-min 0.5, the same tau 2.41 (docs/llamacpp.md, "The drafter's type")
LLAMACPP_TARGET_OUTTYPE = "f32"
LLAMACPP_DRAFTER_DTYPE = "float16"
# Every prompt processed in full: the plain server answers the same prompts once per k, and its prompt cache
# (llama-server --cache-ram, on by default) would serve the later passes faster than the first one
LLAMACPP_SERVER_FLAGS = ("--no-cache-prompt",)


@dataclass(frozen=True)
class GgufPair:
    """What llama-server serves: the target GGUF (converted once, cached) and the drafter GGUF (export-llamacpp/)."""

    target: Path
    drafter: Path


def llamacpp_gguf(ctx: RunContext) -> GgufPair:
    """The drafter exported for llama.cpp into export-llamacpp/ (run's export.formats are the vLLM-side layouts),
    kept when a resumed bench already wrote it."""
    from draftsmith.engines import llamacpp
    from draftsmith.export.formats import export
    from draftsmith.target import resolve_target

    out = ctx.export_dir("llamacpp")
    if not (out / llamacpp.MANIFEST).is_file():
        print(f"run: bench: exporting the drafter for llama.cpp into {out}")
        target_dir = resolve_target(ctx.cfg.target)
        export(ctx.drafter, out, "llamacpp", LLAMACPP_DRAFTER_DTYPE, max(ctx.cfg.bench.llamacpp_k), str(target_dir),
               str(llamacpp.target_gguf(target_dir, LLAMACPP_TARGET_OUTTYPE)),
               overwrite=True)  # the run owns its stage folders (pipeline.claim_run_dir)
    manifest = json.loads((out / llamacpp.MANIFEST).read_text())
    return GgufPair(Path(manifest["target_gguf"]), out / manifest["drafter_gguf"])


@contextlib.contextmanager
def llamacpp_server(gguf: GgufPair, k: int | None, log: Path, family: str = "eagle3") -> Iterator[str]:
    """llama-server on the target GGUF, with the drafter (of `family`) at up to k draft tokens (None: without
    speculation)."""
    from draftsmith.engines import llamacpp

    spec = llamacpp.LlamaServe(gguf.target, gguf.drafter if k else None, k=k or DEFAULT_K,
                               extra_args=LLAMACPP_SERVER_FLAGS, method=family)
    print(f"run: starting {f'speculative (k={k}, p-min {spec.p_min:g})' if k else 'baseline'} llama-server (log {log})")
    with llamacpp.serve(spec, log) as url:
        yield url


def bench_llamacpp(ctx: RunContext, out: Path) -> None:
    """llama.cpp at batch 1: llama-server at each k of bench.llamacpp_k (one at a time) against one plain
    llama-server, in bench.rounds alternating rounds; bench/llamacpp.json is the chosen k's report with the sweep,
    bench/llamacpp/ holds each k's report and every server's log."""
    from draftsmith.engines import llamacpp
    from draftsmith.bench.benchmark import BenchSettings
    from draftsmith.bench.sweep import measure_sweep

    b = ctx.cfg.bench
    out.mkdir(parents=True, exist_ok=True)
    gguf = llamacpp_gguf(ctx)
    # llama-server decodes one request at a time here (LlamaServe parallel 1): one level, c=1; the model is
    # whatever it serves, not bench.model (vLLM's name)
    s = BenchSettings(**{**b.model_dump(include=set(BenchSettings.model_fields)), "concurrency": (1,),
                         "request_rate": (), "num_prompts": b.llamacpp_num_prompts,
                         "max_tokens": b.llamacpp_max_tokens, "model": None})
    with llamacpp_server(gguf, None, out / "baseline.log") as base_url:
        reports = measure_sweep(sweep_order(sorted(set(b.llamacpp_k)), None),
                                lambda k: llamacpp_server(gguf, k, out / f"speculative-k{k}.log", ctx.family), base_url, s)
    write_sweep(reports, "llama.cpp", out, out.parent / "llamacpp.json", engine="llama.cpp",
                p_min=llamacpp.SERVE_P_MIN, target_gguf=str(gguf.target), drafter_gguf=str(gguf.drafter),
                server_flags=list(LLAMACPP_SERVER_FLAGS))


RUNNERS = {"regenerate": do_regenerate, "capture": do_capture, "train": do_train, "export": do_export,
           "eval": do_eval, "check": do_check, "launch": do_launch, "guard": do_guard,
           "bench": do_bench}
