"""`draftsmith diagnose`: read a vLLM or SGLang log and name the line that explains why the start died.

A pure parser (no I/O apart from `diagnose`'s streamed file read): `loglines.parse_line` maps one raw log
line to an `Event` through a table of named, compiled patterns; `TracebackCollector` groups interleaved
multi-process output by process prefix and collects every Python exception and every traceback the
log cut short; `choose_root_cause` names one line, of one kind:

- exception: the first exception that caused the failure (not the last one printed: the API server's
  "Engine core initialization failed. See root cause above" only confirms a death);
- error_line: an error printed without a traceback, before any exception (a pydantic `Value error,`
  line, a CUDA device-side assertion, a worker's same-line `Exception in worker ...: message`);
- hang: a timeout or hang report (NCCL watchdog, vLLM's shm broadcast), with the last progress line
  and how long the log was silent;
- not_captured: the log ends before the cause (a process reports its death, or a traceback is cut
  before its exception): the last evidence, and what to grep for in the full log.

A log that ends during start-up with no error at all is a `Stall`, not a root cause. Hints come from
the table of recognised causes in `draftsmith.engines.causes`. `draftsmith launch` feeds the same classes
line by line.

Log anatomy per engine and version: docs/engines.md §6.

    draftsmith diagnose server.log
    draftsmith diagnose server.log --json
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from itertools import chain, islice
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from draftsmith.engines.causes import Step, hint_for, step_of, weight_shape_detail
from draftsmith.config import JSON_FLAG, Settings, add_flags, from_flags
from draftsmith.errors import DraftsmithError
from draftsmith.engines.loglines import (
    _SCREEN, OWN_DEATH, PREFIX_SAMPLE_LINES, Event, Line, learn_prefix, match_line, split_line, stamp_seconds)

RootCauseKind = Literal["exception", "error_line", "hang", "stalled", "not_captured"]
CONTEXT_LINES = 6  # traceback lines kept before the root-cause exception
MAX_DETAIL_LINES = 4  # indented lines kept after it


# --- tracebacks and exceptions ---------------------------------------------------------------------

_TB_START = re.compile(r"Traceback \(most recent call last\):\s*$")
# Python's report of an exception it swallowed (in a `__del__`, a finalizer, a callback): the traceback after it
# did not stop anything (3.11: `Exception ignored in: <function X.__del__ ...>`; 3.13: `Exception ignored while ...`).
_IGNORED = re.compile(r"^Exception ignored\b")
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
    frames: tuple[Frame, ...] = ()  # every frame of its traceback, outermost first
    ignored: bool = False  # its traceback followed `Exception ignored in: ...`: Python swallowed it


@dataclass
class _Stream:
    """Traceback state of one process's stream."""

    lines: list[str] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    open: bool = False
    chained: bool = False
    last_frame_at: int = 0  # log line of the last frame seen
    last_frame_text: str = ""
    ignored: bool = False  # the open traceback is one Python reports as ignored
    ignored_next: bool = False  # the stream's last line was `Exception ignored in: ...`


class TracebackCollector:
    """Feed log lines in order; collects exceptions per process and the fatal markers seen.

    Unprefixed lines belong to the stream of the last process that opened a traceback without a
    prefix on its continuation lines (SGLang prints `[.. TP0] Scheduler hit an exception: Traceback`
    and then bare frame lines), else to the unprefixed stream "".

    `prefix` is the wrapper prefix the log's lines share (`loglines.learn_prefix`), stripped from each line.
    """

    def __init__(self, prefix: re.Pattern[str] | None = None) -> None:
        self.prefix = prefix
        self.exceptions: list[PyException] = []
        self.fatal: list[tuple[int, Event]] = []
        self.events: list[tuple[int, Event]] = []
        self.lineno = 0
        self._streams: dict[str, _Stream] = {}
        self._bare_owner = ""  # process whose traceback continues on unprefixed lines
        self._detail_of: dict[str, int] = {}  # process -> index of its exception still taking detail lines
        self.stamps: dict[int, str] = {}  # event line -> its stamp
        self._stamp = ""  # the stamp of the last line read whole that had one
        self._skipped_tail: str | None = None  # the last line skipped unread, when it came after that
        self._busy = False  # a traceback is open or an exception takes detail lines: read every line

    @property
    def busy(self) -> bool:
        """Whether the next line must be read whole (a traceback is open, or an exception takes detail)."""
        return self._busy

    def skip(self, count: int, last: str) -> None:
        """Count `count` lines that the screen rules out, without reading them; `last` is the last one."""
        self.lineno += count
        self._skipped_tail = last

    @property
    def last_stamp(self) -> str:
        """The stamp of the log's last stamped line (of a skipped last line when it has one)."""
        tail = split_line(self._skipped_tail, self.prefix).stamp if self._skipped_tail is not None else ""
        return tail or self._stamp

    def feed(self, raw: str) -> PyException | None:
        """Consume the next line; return the exception it completes, if any."""
        self.lineno += 1
        if not self._busy and not _SCREEN.search(raw):
            self._skipped_tail = raw
            return None
        self._skipped_tail = None
        line = split_line(raw, self.prefix)
        event = match_line(line)
        if line.stamp:
            self._stamp = line.stamp
        if event:
            self.events.append((self.lineno, event))
            if line.stamp:
                self.stamps[self.lineno] = line.stamp
            if event.kind == "fatal":
                self.fatal.append((self.lineno, event))
        process = line.process
        if not process and self._streams.get(self._bare_owner, _Stream()).open:
            process = self._bare_owner
        stream = self._streams.setdefault(process, _Stream())
        found = self._advance(stream, process, line)
        self._busy = bool(self._detail_of) or any(s.open for s in self._streams.values())
        return found

    def _advance(self, stream: _Stream, process: str, line: Line) -> PyException | None:
        text = line.text
        at = self._detail_of.pop(process, None)
        if at is not None and text[:1] in (" ", "\t") and text.strip() and not stream.open:
            exc = self.exceptions[at]
            if len(exc.detail) < MAX_DETAIL_LINES:
                self.exceptions[at] = replace(exc, detail=exc.detail + (text.strip(),))
                self._detail_of[process] = at
            return None
        ignored, stream.ignored_next = stream.ignored_next, False
        if _IGNORED.match(text.strip()):
            stream.ignored_next = True
            return None
        if _TB_START.search(text):
            stream.lines, stream.frames, stream.open, stream.ignored = [], [], True, ignored
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
            stream.last_frame_at, stream.last_frame_text = self.lineno, text.strip()
            return None
        exc = _EXC.match(text) if text[:1] not in (" ", "\t") else None
        if exc and (stream.open or line.level in ("ERROR", "CRITICAL") or not line.level):
            if not stream.open and not exc["msg"]:
                return None  # a bare word such as `Exception` outside a traceback is not an exception
            found = PyException(
                line=self.lineno, process=process, exception_type=exc["type"], message=(exc["msg"] or "").strip(),
                text=text.strip(), frame=_innermost(stream.frames), context=tuple(stream.lines[-CONTEXT_LINES:]),
                chained=stream.chained, frames=tuple(stream.frames), ignored=stream.ignored)
            self.exceptions.append(found)
            self._streams[process] = _Stream()
            self._detail_of[process] = len(self.exceptions) - 1
            return found
        if stream.open and text.strip():
            stream.lines.append(text.rstrip())
        return None


    def cut_tracebacks(self) -> list[tuple[int, str, Frame | None, tuple[str, ...], str, tuple[Frame, ...]]]:
        """Tracebacks the log ends inside (no exception line yet): (last frame's line, process, innermost
        frame, the traceback's last lines, the last frame's text, every frame), in log order."""
        cut = [(s.last_frame_at, proc, _innermost(s.frames), tuple(s.lines[-CONTEXT_LINES:]), s.last_frame_text,
                tuple(s.frames)) for proc, s in self._streams.items() if s.open and s.frames]
        return sorted(cut, key=lambda c: c[0])


# A frame's file from its package on (`vllm/v1/...`), so that a user's own directory names (`fast-draft/`)
# are not read as the engine's code.
_PACKAGE_PATH = re.compile(r"(?:site|dist)-packages/(.+)$|/((?:vllm|vllm_ascend|sglang|torch)/.+)$")


def _step(frames: tuple[Frame, ...], context: tuple[str, ...]) -> Step | None:
    """The step a traceback passes through, read off all its frames and the code lines among its last lines."""
    files = [(m[1] or m[2]) if (m := _PACKAGE_PATH.search(f.file)) else f.file.rsplit("/", 1)[-1] for f in frames]
    code = [line for line in context if not _FRAME.match(line)]
    return step_of("\n".join([f"{file} {f.func}" for file, f in zip(files, frames)] + code))


def _innermost(frames: list[Frame]) -> Frame | None:
    inner = [f for f in frames if not _WRAPPER_FILES.search(f.file)]
    return (inner or frames or [None])[-1]


# --- root cause -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RootCause:
    """The line that explains a failed log, as `diagnose --json` prints it.

    `kind` says what the line is (module docstring); a hang also carries the last progress line before
    it and how long the log was silent; a cause the log did not capture carries what to grep for.
    """

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
    last_progress: tuple[int, str] | None = None  # hang: (line, text) of the last progress before it
    silence_s: float | None = None  # hang: seconds without progress, from the log's stamps or the report
    grep: str | None = None  # not_captured: the command that finds the cause in the full log


_PROGRESS_KINDS = ("phase", "progress", "ready")
# Exceptions that report a wait that ran out: the root cause is a hang, not a crash.
# torch's c10d store says `store->get('0') got error: wait timeout after 600000ms` (DistBackendError).
_TIMEOUT_EXC = re.compile(r"(?:^|\.)TimeoutError\b|\btimed out\b|\bwait timeout after \d+ ?ms", re.I)


def choose_root_cause(collector: TracebackCollector) -> RootCause | None:
    """The line that explains the failure, in this order:

    1. an error line printed before the first causal exception (it is that exception's cause, or all
       there is: a pydantic `Value error,` line, a CUDA device-side assertion);
    2. the first exception that is not only a report of an earlier death, unless it only reports a
       timeout that a hang report before it explains;
    3. the first hang report;
    4. the cause is not in the log: the first process's report of its own death, else the innermost
       frame of a traceback the log ends inside, else the first confirmation of a death elsewhere.

    Errors after a shutdown that a signal started (our own SIGTERM after a clean start) are teardown.
    Exceptions Python reports as swallowed (`Exception ignored in: ...`, e.g. in a `__del__`) stopped nothing.
    """
    stopped = next((n for n, e in collector.events if e.name == "vllm_signal_shutdown"), None)
    before = (lambda n: True) if stopped is None else (lambda n: n < stopped)
    exceptions = [e for e in collector.exceptions if before(e.line) and not e.ignored]
    causal = [e for e in exceptions if not CONSEQUENCES.search(e.text)]
    errors = [(n, e) for n, e in collector.events if e.kind == "error" and before(n)]
    # a hang report followed by progress was a slow step that finished (vLLM warns during compilation)
    moved = max((n for n, e in collector.events if e.kind in _PROGRESS_KINDS), default=0)
    hangs = [(n, e) for n, e in collector.events if e.kind == "hang" and n > moved and before(n)]
    first = causal[0] if causal else None
    if errors and (first is None or errors[0][0] < first.line):
        return _from_event(*errors[0], kind="error_line")
    if first and not (hangs and hangs[0][0] < first.line and _TIMEOUT_EXC.search(first.text)):
        return _from_exception(first)
    if hangs:
        return _from_hang(collector, *hangs[0])
    return _not_captured(collector, exceptions, [(n, e) for n, e in collector.fatal if before(n)])


def _from_exception(exc: PyException) -> RootCause:
    # a bare `TimeoutError` says nothing: then the frames before it name the cause
    said, where = "\n".join((exc.text, *exc.detail)), "\n".join(exc.context)
    hint = (hint_for(said) or hint_for(where)) if exc.message else (hint_for(where) or hint_for(said))
    fix, name = (hint.fix, hint.name) if hint else (None, None)
    if hint and hint.name == "drafter_weight_shape" and (named := weight_shape_detail(exc.text)):
        fix = f"{named}; {fix}"
    if not hint and (step := _step(exc.frames, exc.context)):  # no recognised cause: where it was raised
        fix, name = f"raised during {step.label}: {step.fix}", step.name
    kind: RootCauseKind = "hang" if _TIMEOUT_EXC.search(exc.text) else "exception"
    return RootCause(exc.line, exc.text, exc.exception_type, exc.process, fix, name,
                     exc.frame, exc.context, exc.detail, kind=kind)


def _from_event(lineno: int, event: Event, kind: RootCauseKind, **extra) -> RootCause:
    hint = hint_for(event.text)
    return RootCause(lineno, event.text, None, event.process, extra.pop("fix", None) or (hint.fix if hint else None),
                     hint.name if hint else None, None, (), kind=kind, **extra)


def _from_hang(collector: TracebackCollector, lineno: int, event: Event) -> RootCause:
    """A hang report, with the last progress line before it and how long the log was silent.

    Silence runs from the last progress line (else from when the report says the wait began) to the
    last stamped line of the log; with no stamps, the wait the report itself names.
    """
    progress = [(n, e) for n, e in collector.events if n < lineno and e.kind in ("phase", "progress")]
    last = progress[-1] if progress else None
    waited = (float(event.fields["secs"]) if "secs" in event.fields else
              int(event.fields["ms"]) / 1000 if "ms" in event.fields else None)
    end = stamp_seconds(collector.last_stamp) if collector.last_stamp else None
    ref = stamp_seconds(collector.stamps.get(last[0], "")) if last else None
    if ref is None and (at := stamp_seconds(collector.stamps.get(lineno, ""))) is not None:
        ref = at - (waited or 0.0)
    span = end - ref if end is not None and ref is not None and end >= ref else None
    silence = round(max(x for x in (span, waited) if x is not None), 1) if (span, waited) != (None, None) else None
    return _from_event(lineno, event, "hang", last_progress=(last[0], last[1].text) if last else None,
                       silence_s=silence)


def _not_captured(collector: TracebackCollector, exceptions: list[PyException],
                  fatal: list[tuple[int, Event]]) -> RootCause | None:
    """The last evidence of a cause the log does not contain, with the grep that finds it in the full log."""
    own = [(n, e) for n, e in fatal if e.name in OWN_DEATH]
    cut = collector.cut_tracebacks()
    exc_type, frames = None, ()
    if own:
        (lineno, event), frame, context = own[0], None, ()
        text, process = event.text, event.process
        inside = [c for c in cut if c[1] == process]
        if inside:
            frame, context, frames = inside[-1][2], inside[-1][3], inside[-1][5]
    elif cut:
        lineno, process, frame, context, text, frames = cut[-1]
    elif exceptions or fatal:
        seen = sorted([(e.line, e.text, e.process, e.exception_type) for e in exceptions] +
                      [(n, e.text, e.process, None) for n, e in fatal], key=lambda x: x[0])
        (lineno, text, process, exc_type), frame, context = seen[0], None, ()
    else:
        return None
    grep = 'grep -nE "(Error|Exception)(: |$)" FULL.log' + (f' | grep -F "{process}"' if process else "")
    where = f", last frame {frame.file}:{frame.lineno} in {frame.func}" if frame else ""
    step = _step(frames, context)
    fix = (f"root cause not captured in this log: {process or 'the main process'} was going down at line "
           f"{lineno}{where}{f', during {step.label}' if step else ''}, but the exception itself is not in this "
           f"text (the log was cut, or only one process's output was kept). Find it in the complete "
           f"stdout+stderr: {grep}")
    hint = hint_for(text)
    fix = ". ".join([fix] + [h.fix for h in (hint, step) if h])
    name = hint.name if hint else step.name if step else None
    return RootCause(lineno, text, exc_type, process, fix, name, frame, context, kind="not_captured", grep=grep)


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


STALL_HINT = ("the log ends during start-up without an error. If the engine is still running it is stuck at "
              "this step: dump its stacks (py-spy dump --pid PID) and, on several nodes, check that every node "
              "reached it; if it exited, its error went to another stream: keep the combined stdout+stderr "
              "(`draftsmith launch` writes it)")


@dataclass(frozen=True)
class Stall:
    """A log that ends during start-up with no error: where it stopped."""

    line: int
    text: str
    process: str
    phase: str | None
    silence_s: float | None  # from this line's stamp to the log's last stamp
    hint: str = STALL_HINT


@dataclass(frozen=True)
class Diagnosis:
    """Everything `diagnose` reports about one log."""

    lines: int
    phase: str | None  # last start-up phase reached
    ready: bool
    progress: dict[str, str]  # last load-progress fields (pct, n, total, ...)
    root_cause: RootCause | None
    exceptions: int
    stall: Stall | None = None  # no root cause, not ready: the last progress line


def analyze(lines: Iterable[str]) -> Diagnosis:
    """Run the parser over a whole log (its wrapper prefix, if any, learned from its head)."""
    lines = iter(lines)
    head = list(islice(lines, PREFIX_SAMPLE_LINES))
    collector = TracebackCollector(learn_prefix(head))
    for raw in chain(head, lines):
        collector.feed(raw)
    return _diagnosis(collector)


CHUNK_BYTES = 1 << 22  # the file is read in 4 MiB blocks, cut at their last newline


def analyze_file(path: Path) -> Diagnosis:
    """`analyze` over a log file, streamed in blocks; lines the screen rules out are counted, not split.

    Lines are as `iter_log` yields them (a file ending in a newline has a last, empty line).
    """
    _check_log(path)
    rest = b""
    with path.open("rb") as f:
        block = f.read(CHUNK_BYTES)
        head = block.split(b"\n", PREFIX_SAMPLE_LINES)[:PREFIX_SAMPLE_LINES]
        collector = TracebackCollector(learn_prefix(h.decode("utf-8", errors="replace") for h in head))
        while block:
            block = rest + block
            cut = block.rfind(b"\n")
            if cut < 0:
                rest = block
            else:
                rest = block[cut + 1:]
                _scan(collector, block[:cut].decode("utf-8", errors="replace"))
            block = f.read(CHUNK_BYTES)
    _scan(collector, rest.decode("utf-8", errors="replace"))
    return _diagnosis(collector)


def _scan(collector: TracebackCollector, text: str) -> None:
    """Feed the lines of `text` (split on "\n") that the screen lets through; count the others."""
    pos, end_of_text = 0, len(text)
    while pos <= end_of_text:
        if not collector.busy:
            hit = _SCREEN.search(text, pos)
            start = end_of_text + 1 if hit is None else text.rfind("\n", pos, hit.start()) + 1 or pos
            if start > pos:  # whole lines with no screen word: count them
                last = text.rfind("\n", pos, start - 1) + 1 or pos
                collector.skip(text.count("\n", pos, start - 1) + 1, text[last:start - 1])
                pos = start
                if hit is None:
                    return
        end = text.find("\n", pos)
        end = end_of_text if end < 0 else end
        collector.feed(text[pos:end])
        pos = end + 1


def _diagnosis(collector: TracebackCollector) -> Diagnosis:
    """Phase, readiness, progress, root cause and stall of a log the collector has read."""
    status, ready, progress = LoadStatus(phase=""), False, {}
    for _, ev in collector.events:
        status = advance(status, ev, 0.0)
        ready = ready or ev.kind == "ready"
        progress = ev.fields if ev.kind == "progress" else progress
    rc = choose_root_cause(collector)
    started = ready or any(e.name in _STARTED for _, e in collector.events)
    stall = None if rc or started else find_stall(collector)
    return Diagnosis(collector.lineno, status.phase or None, ready, progress, rc, len(collector.exceptions), stall)


# vLLM says nothing in its log when it is ready (readiness is answered over HTTP): these lines show it served.
_STARTED = frozenset({"uvicorn_startup_complete", "vllm_serving_stats"})


def find_stall(collector: TracebackCollector) -> Stall | None:
    """The last progress or phase line of a log that shows no error and no readiness."""
    moved = [(n, e) for n, e in collector.events if e.kind in ("phase", "progress")]
    if not moved:
        return None
    lineno, event = moved[-1]
    at, end = stamp_seconds(collector.stamps.get(lineno, "")), stamp_seconds(collector.last_stamp or "")
    silence = round(end - at, 1) if at is not None and end is not None and end > at else None
    return Stall(lineno, event.text, event.process, event.phase, silence)


BINARY_PROBE_BYTES = 8192  # a NUL byte in the first 8 KiB: not a text log (git and grep use the same test)


def _check_log(path: Path) -> None:
    """Refuse what is not a readable, non-empty text log, saying what was found instead."""
    expected = "a saved engine log: the text file the engine's combined stdout and stderr were written to"
    if not path.exists():
        raise DraftsmithError("log file not found", got=str(path), expected=expected,
                              fix="pass the file the engine's stdout and stderr were written to")
    if not path.is_file():
        raise DraftsmithError("log path is not a file", got=f"{path} (a directory or device)", expected=expected,
                              fix="pass the log file itself, e.g. runs/NAME/engine.log")
    try:
        with path.open("rb") as f:
            head = f.read(BINARY_PROBE_BYTES)
    except OSError as err:
        raise DraftsmithError("log file cannot be read", got=f"{path}: {err.strerror or err}", expected=expected,
                              fix=f"make it readable (ls -l {path}; chmod u+r or run as its owner)") from err
    if not head:
        raise DraftsmithError("log file is empty", got=f"{path}: 0 bytes", expected=expected,
                              fix="the engine wrote nothing there yet: point it at the log it wrote "
                                  "(`vllm serve ... > engine.log 2>&1`), or wait for its first lines")
    if b"\0" in head:
        raise DraftsmithError("log file is binary, not text", got=f"{path}: NUL bytes in the first "
                              f"{len(head)} bytes", expected=expected,
                              fix="pass the text log; a compressed log must be unpacked first (zcat LOG.gz > LOG)")


def iter_log(path: Path) -> Iterator[str]:
    """A log file's lines, streamed, split on newlines only (carriage returns stay inside lines).

    As `text.split("\n")`: a file that ends in a newline yields a last empty line.
    """
    _check_log(path)
    last = ""
    with path.open("rb") as f:
        for raw in f:
            last = raw.decode("utf-8", errors="replace")
            yield last[:-1] if last.endswith("\n") else last
    if last.endswith("\n"):
        yield ""


def read_log(path: Path) -> list[str]:
    """All of a log's lines (`iter_log` as a list, for callers that index lines)."""
    return list(iter_log(path))


_HEADINGS: dict[str, str] = {
    "exception": "root cause", "error_line": "root cause", "hang": "root cause: a hang",
    "not_captured": "root cause not captured in this log; last evidence",
}


def render(diag: Diagnosis, path: Path) -> str:
    """The human summary."""
    out = [f"{path}: {diag.lines} lines, last phase {diag.phase or 'none'}" + (", ready" if diag.ready else "")]
    rc = diag.root_cause
    if rc is None:
        out.append("no error found")
        if diag.stall:
            st = diag.stall
            silent = f", {st.silence_s:.0f} s before the log's last line" if st.silence_s else ""
            out += [f"start-up stopped at line {st.line} ({st.phase or 'unknown phase'}{silent}):", f"  {st.text}",
                    f"hint: {st.hint}"]
        return "\n".join(out)
    out.append(f"{_HEADINGS[rc.kind]} (line {rc.line}, {rc.process or 'main process'}):")
    out.append(f"  {rc.text}")
    out.extend(f"  {d}" for d in rc.detail)
    if rc.last_progress:
        out.append(f"  last progress before it (line {rc.last_progress[0]}): {rc.last_progress[1]}")
    if rc.silence_s is not None:
        out.append(f"  silent for {rc.silence_s:.0f} s")
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


class DiagnoseSettings(Settings):
    """What `diagnose` reads and how it answers: the diagnose verb's command line."""

    logfile: Path
    """A log with the engine's combined stdout and stderr."""
    as_json: bool = False
    """Print the diagnosis as JSON."""


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("diagnose", help="name the root cause of a saved vLLM / SGLang log",
                       **example_help("example:\n  draftsmith diagnose runs/vllm.log\n"
                                      "  draftsmith diagnose runs/vllm.log --json | jq .root_cause"))
    add_flags(p, DiagnoseSettings, positional=("logfile",), flags=JSON_FLAG)
    p.set_defaults(func=run_diagnose)


def run_diagnose(args) -> int:
    s = from_flags(DiagnoseSettings, args)
    diag = analyze_file(s.logfile)
    print(json.dumps(diagnosis_json(diag), indent=2) if s.as_json else render(diag, s.logfile))
    return 1 if diag.root_cause else 0
