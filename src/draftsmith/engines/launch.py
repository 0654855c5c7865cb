"""`draftsmith launch`: start a serving engine, follow its load, and name the root cause the moment it dies.

The engine runs in its own process group and writes its combined stdout/stderr to a log file; the
supervisor tails that file through the pure parser in `draftsmith.engines.diagnose`, shows a live status line
(phase, shard percent, ETA, elapsed), and decides one of four outcomes:

- ready: `/health` and `/v1/models` both answer 200 (a log line is never trusted for readiness:
  vLLM never prints `Uvicorn running on`, docs/engines.md §6.2);
- crashed: the process exited, or a fatal marker was logged after an exception (the worker's
  traceback arrives seconds before the API server exits);
- stalled: no new output for `--stall-timeout` seconds before ready;
- timed out: not ready after `--timeout` seconds.

On anything but ready (and on Ctrl-C) the whole process tree is stopped (`engine.stop_tree`: the
process group and every descendant PID). Start, readiness and stop live in `draftsmith.engines.process`.

    draftsmith launch -- python -m vllm.entrypoints.openai.api_server --model ./target --port 8000
    draftsmith launch --then "python bench.py" -- vllm serve ./target --speculative-config '{...}'
    draftsmith launch --attach /var/log/vllm.log --url http://10.0.0.5:8000
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from pydantic import Field

from draftsmith.client import redact
from draftsmith.config import Settings, add_flags, from_flags
from draftsmith.engines.process import probe_ready, release, spawn, stop_tree
from draftsmith.errors import DraftsmithError
from draftsmith.engines.diagnose import (
    LoadStatus,
    RootCause,
    TracebackCollector,
    advance,
    analyze,
    choose_root_cause,
    read_log,
    render,
)

Status = Literal["ready", "crashed", "stalled", "timed_out"]
EXIT_CODES: dict[Status, int] = {"ready": 0, "crashed": 3, "stalled": 4, "timed_out": 5}
POLL_S = 0.1  # log tail interval; bounds crash-detection latency together with the HTTP probe
PROBE_EVERY_S = 1.0
# Markers after which the failure is final even without a parsed exception (docs/engines.md §6.4, §6.5).
TERMINAL_MARKERS = frozenset({"vllm_engine_init_failed", "vllm_engine_died", "sglang_sigquit",
                              "sglang_rank_dead", "startup_timeout", "vllm_engine_dead"})


def status_line(status: LoadStatus, elapsed: float) -> str:
    parts = [status.phase.replace("_", " ")]
    if status.pct is not None:
        parts.append(f"{status.pct}% ({status.shards} shards)")
    if status.eta_s is not None:
        parts.append(f"ETA {status.eta_s:.0f} s")
    return " | ".join(parts + [f"{elapsed:.0f} s"])


@dataclass(frozen=True)
class LaunchResult:
    status: Status
    elapsed_s: float
    phase: str
    log: str
    root_cause: RootCause | None = None
    returncode: int | None = None  # the engine's, when it exited
    last_line: str = ""
    detected_at: float = field(default=0.0, repr=False)  # time.monotonic() when the outcome was decided

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]


class LogTail:
    """Whole new lines of a growing file."""

    def __init__(self, path: Path):
        self.path, self._pos, self._partial = path, 0, b""

    def read(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._pos)
            data = f.read()
        self._pos += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [ln.decode("utf-8", errors="replace") for ln in lines]

    def rest(self) -> list[str]:
        """Whatever is left, including an unterminated last line."""
        lines = self.read() + ([self._partial.decode("utf-8", errors="replace")] if self._partial else [])
        self._partial = b""
        return lines


def url_from_command(cmd: list[str]) -> str:
    """The local base URL the command will serve on, from its --host/--port (engine defaults otherwise)."""

    def flag(name: str) -> str | None:
        for i, arg in enumerate(cmd):
            if arg == name and i + 1 < len(cmd):
                return cmd[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None

    port = flag("--port") or ("30000" if any("sglang" in a for a in cmd) else "8000")
    host = flag("--host") or "127.0.0.1"
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"


def supervise(log: Path, url: str | None, proc: subprocess.Popen | None, timeout_s: float, stall_s: float,
              on_status=None) -> LaunchResult:
    """Follow `log` (and `proc`, when we started it) until ready, crashed, stalled or timed out."""
    start = last_output = time.monotonic()
    tail, collector, status = LogTail(log), TracebackCollector(), LoadStatus()
    next_probe, last_line = start, ""

    def result(kind: Status) -> LaunchResult:
        return LaunchResult(kind, time.monotonic() - start, status.phase, str(log), choose_root_cause(collector),
                            proc.poll() if proc else None, last_line, time.monotonic())

    while True:
        now = time.monotonic()
        exited = proc is not None and proc.poll() is not None
        seen = len(collector.events)
        for raw in tail.rest() if exited else tail.read():
            collector.feed(raw)
            if raw.strip():
                last_line, last_output = raw.strip()[-300:], now
        for _, event in collector.events[seen:]:
            status = advance(status, event, now)
        if on_status:
            on_status(status, now - start)
        fatal = {e.name for _, e in collector.fatal}
        died = exited or bool(fatal & TERMINAL_MARKERS) or bool(fatal and collector.exceptions)
        if died:
            return result("crashed")
        if url and now >= next_probe:
            next_probe = now + PROBE_EVERY_S
            if probe_ready(url):
                status = replace(status, phase="ready")
                return result("ready")
        if url is None and any(e.kind == "ready" or e.name == "uvicorn_startup_complete" for _, e in collector.events):
            status = replace(status, phase="ready")  # attached without a URL: the log is all we have
            return result("ready")
        if now - last_output > stall_s:
            return result("stalled")
        if now - start > timeout_s:
            return result("timed_out")
        time.sleep(POLL_S)


def report(res: LaunchResult) -> str:
    """The human summary printed when the supervisor decides."""
    head = f"{res.status.replace('_', ' ')} after {res.elapsed_s:.1f} s in phase {res.phase.replace('_', ' ')}"
    lines = [head, f"log: {res.log}"]
    if res.status != "ready" and res.returncode is not None:
        lines.append(f"engine exit code: {res.returncode}")
    if res.status == "stalled":
        lines.append(f"no output for a while; last line: {res.last_line}" if res.last_line
                     else "no output at all since the engine started")
    rc = res.root_cause
    if res.status != "ready" and rc:
        lines.append(f"root cause (line {rc.line}, {rc.process or 'main process'}): {rc.text}")
        if rc.frame:
            lines.append(f"  at {rc.frame.file}:{rc.frame.lineno} in {rc.frame.func}")
        if rc.hint:
            lines.append(f"hint: {rc.hint}")
    return "\n".join(lines)


class LaunchSettings(Settings):
    """How long `launch` waits: the launch verb's flags and `run`'s launch section."""

    timeout_s: float = Field(1800.0, gt=0)
    """Give up when the server is not ready after this many seconds."""
    stall_timeout_s: float = Field(300.0, gt=0)
    """Stalled after this many seconds without a new log line."""


LAUNCH_FLAGS = {"timeout_s": "--timeout", "stall_timeout_s": "--stall-timeout"}


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser(
        "launch", help="start an engine, follow its load, name the root cause if it dies",
        **example_help(
            "example:\n  draftsmith launch --log runs/vllm.log -- python -m vllm.entrypoints.openai.api_server "
            "--model ./target --port 8000\n  draftsmith launch --then 'draftsmith bench --endpoint http://127.0.0.1:8000'"
            " -- vllm serve ./target\n  draftsmith launch --attach /var/log/vllm.log --url http://10.0.0.5:8000\n"
            "  draftsmith launch -- vllm serve TARGET --speculative-config '{\"method\": \"eagle3\", \"model\": \"smollm2\", "
            "\"num_speculative_tokens\": 2}'   # a shipped drafter by its short name\n\n"
            "  draftsmith launch --guard -- vllm serve TARGET --speculative-config '{...}'   # acceptance as trained?\n\n"
            "exit codes: 0 ready, 3 crashed, 4 stalled, 5 timed out, 2 bad usage; --guard: 6 degraded, 7 collapsed; "
            "with --then, its exit code"))
    p.add_argument("--log", type=Path, help="where the engine's output goes (default runs/launch-TIME.log)")
    p.add_argument("--url", help="base URL to probe for readiness (default: from the command's --host/--port)")
    add_flags(p, LaunchSettings, flags=LAUNCH_FLAGS)
    p.add_argument("--guard", action="store_true",
                   help="once ready, measure the engine's acceptance against the drafter's own (a few short requests); "
                        "degraded or collapsed: stop the engine and exit 6 or 7 with the candidate causes")
    p.add_argument("--guard-prompts", default="chat-eval", help="the guard's prompts: chat-eval or a JSONL file")
    p.add_argument("--guard-json", type=Path, help="also write the guard's report (verdict, acceptance, causes) here")
    p.add_argument("--then", help="run this command once ready, then stop the engine and exit with its code")
    p.add_argument("--detach", action="store_true", help="exit 0 once ready and leave the engine running")
    p.add_argument("--attach", type=Path, metavar="LOGFILE", help="follow an engine started elsewhere")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.add_argument("command", nargs="*", help="the engine command, after `--`")
    p.set_defaults(func=run_launch)


def _console_hook():
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        seen: list[str] = []

        def plain(status: LoadStatus, elapsed: float) -> None:
            if not seen or seen[-1] != status.phase:
                seen.append(status.phase)
                console.print(f"[{elapsed:5.0f} s] {status.phase.replace('_', ' ')}", highlight=False)
        return plain, contextlib.nullcontext()
    from rich.live import Live

    live = Live("", console=console, transient=True, refresh_per_second=4)
    return (lambda s, e: live.update(status_line(s, e))), live


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def with_shipped_drafters(cmd: list[str]) -> list[str]:
    """The command with a shipped drafter's short name (`"model": "smollm2"` in vLLM's --speculative-config,
    or SGLang's --speculative-draft-model-path smollm2) replaced by its directory; anything else unchanged."""
    from draftsmith.model.checkpoint import shipped_drafter

    def shipped(name: object) -> str | None:
        path = shipped_drafter(name)
        return str(path) if path else None

    out = list(cmd)
    for i, arg in enumerate(out[:-1]):
        value = out[i + 1]
        if arg == "--speculative-config":
            try:
                spec = json.loads(value)
            except json.JSONDecodeError:
                continue
            if isinstance(spec, dict) and shipped(spec.get("model")):
                out[i + 1] = json.dumps({**spec, "model": shipped(spec["model"])})
        elif arg == "--speculative-draft-model-path" and shipped(value):
            out[i + 1] = shipped(value)
    return out


def guard(url: str | None, cmd: list[str], prompts: str, json_out: Path | None = None) -> int:
    """The acceptance guard on the ready engine, in its own process (it reads check's findings, a stage above
    this one): its exit code, 0 when the engine accepts as the drafter did on held-back data."""
    if not url or not cmd:
        raise DraftsmithError("--guard needs the engine command and its URL", got="--attach without --url",
                              expected="draftsmith launch --guard -- ENGINE COMMAND", fix="start the engine with launch")
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "draftsmith.preflight.guard", "--url", url, "--prompts", prompts,
                           *(["--json", str(json_out)] if json_out else []), "--", *cmd]).returncode
    print(f"guard: exit {code}, {time.monotonic() - t0:.0f} s after readiness", file=sys.stderr, flush=True)
    return code


def run_launch(args) -> int:
    s = from_flags(LaunchSettings, args)
    cmd = with_shipped_drafters(list(args.command))
    if args.attach and cmd:
        raise DraftsmithError("--attach follows a running engine and takes no command", got=shlex.join(cmd),
                              expected="either --attach LOGFILE or `-- ENGINE COMMAND...`", fix="drop one of them")
    if not args.attach and not cmd:
        raise DraftsmithError("no engine command given", got="nothing after `--`",
                              expected="draftsmith launch [options] -- ENGINE COMMAND...",
                              fix="e.g. draftsmith launch -- python -m vllm.entrypoints.openai.api_server --model DIR")
    # The PID keeps two launches started in the same second from truncating one log.
    log = args.attach or args.log or Path("runs") / f"launch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    if args.attach and not log.exists():
        raise DraftsmithError("log to attach to not found", got=str(log), expected="the engine's log file",
                              fix="pass the file the engine writes its stdout and stderr to")
    url = args.url or (None if args.attach else url_from_command(cmd))
    hook, live = _console_hook()  # before the engine starts: a Ctrl-C during this import would orphan it
    proc = res = None
    previous: dict[int, object] = {}
    try:
        if not args.attach:
            # `kill` acts like Ctrl-C; and Ctrl-C / `kill -INT` always stops launch, even when it inherited
            # SIGINT as ignored (a background job of a shell without job control, e.g. `nohup ... &`).
            for sig, handler in ((signal.SIGTERM, _interrupt), (signal.SIGINT, signal.default_int_handler)):
                with contextlib.suppress(ValueError):  # not the main thread
                    previous[sig] = signal.signal(sig, handler)
            print(f"launch: {redact(shlex.join(cmd))} (log {log})", file=sys.stderr, flush=True)
            proc = spawn(cmd, log)
        with live:
            res = supervise(log, url, proc, s.timeout_s, s.stall_timeout_s, hook)
        print(redact(json.dumps(asdict(res), indent=2, default=str) if args.json else report(res)), flush=True)
        if res.status == "ready" and args.guard:
            code = guard(url, cmd, args.guard_prompts, args.guard_json)
            if code:
                return code
        if res.status == "ready" and args.then:
            return subprocess.run(shlex.split(args.then)).returncode
        if res.status == "ready" and proc and not args.detach:
            print(f"serving at {redact(url)} (engine pid {proc.pid}); Ctrl-C stops it", file=sys.stderr)
            proc.wait()  # the engine died while serving
            print(redact(render(analyze(read_log(log)), log)))
            return EXIT_CODES["crashed"]
        return res.exit_code
    finally:
        if proc and args.detach and res is not None and res.status == "ready":
            release(proc)  # detached on purpose: its orphan guard must not stop it when launch exits
        elif proc:
            stop_tree(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
