"""Wrap a plain engine log the way the programs that collect it do: every physical line gets the collector's
prefix, one line for one line (so a case's expected line number holds), the file's final empty line stays empty.

- supervisor: a process supervisor's `INFO PyProcess W-4711-stdout: ` (stderr lines say `-stderr`)
- compose: docker compose's `vllm-server  | ` (the service name padded to a column)
- kubectl: `kubectl logs --timestamps`'s RFC3339 stamp with nanoseconds, `2026-12-07T12:00:01.000000123Z `
- journald: the systemd journal's `Dec 07 12:00:01 gpu-node-3 vllm[4711]: `

`wrapped_rows(cases, wrapper)` scores corpus cases on their wrapped logs as scripts/diagnose_corpus.py's
`judge` does on the plain ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from draftsmith.engines.diagnose import analyze, read_log


def _second(i: int) -> tuple[int, int]:
    """(minute, second) of line i: the clock moves one second every 7 lines, from 12:00:00."""
    t = i // 7
    return t // 60 % 60, t % 60


def _is_stderr(line: str) -> bool:
    """Which stream a supervisor would have read the line from: python's logging and tracebacks go to stderr."""
    return any(w in line for w in ("ERROR", "WARNING", "Traceback", "Error", "  File ")) or \
        int(hashlib.sha256(line.encode()).hexdigest()[:2], 16) % 3 == 0


def supervisor(i: int, line: str) -> str:
    return f"INFO PyProcess W-4711-{'stderr' if _is_stderr(line) else 'stdout'}: {line}"


def compose(i: int, line: str) -> str:
    return f"vllm-server  | {line}"


def kubectl(i: int, line: str) -> str:
    minute, second = _second(i)
    return f"2026-12-07T12:{minute:02d}:{second:02d}.{(i * 7919) % 10**9:09d}Z {line}"


def journald(i: int, line: str) -> str:
    minute, second = _second(i)
    return f"Dec 07 12:{minute:02d}:{second:02d} gpu-node-3 vllm[4711]: {line}"


WRAPPERS: dict[str, Callable[[int, str], str]] = {
    "supervisor": supervisor, "compose": compose, "kubectl": kubectl, "journald": journald}


def wrap(lines: list[str], wrapper: str) -> list[str]:
    """The log's lines (as `read_log` gives them) with the wrapper's prefix on each; a final empty line (the
    file's last newline) is left as it is."""
    add = WRAPPERS[wrapper]
    last = len(lines) - 1
    return [line if i == last and line == "" else add(i, line) for i, line in enumerate(lines)]


def answer(lines: list[str]) -> tuple:
    """What diagnose names for a log: (line, kind, text, hint) of the root cause, else of the stall."""
    diag = analyze(lines)
    rc, stall = diag.root_cause, diag.stall
    if rc:
        return rc.line, rc.kind, rc.text, rc.hint_name
    return (stall.line, "stalled", stall.text, None) if stall else (None, None, None, None)


def wrapped_rows(cases: list[dict], sets: dict[str, Path], wrapper: str | None) -> list[dict]:
    """Each case right or not on its log wrapped by `wrapper` (None: the plain log), by line and kind."""
    rows = []
    for case in cases:
        lines = read_log(sets[case["set"]] / case["file"])
        got = answer(wrap(lines, wrapper) if wrapper else lines)
        rows.append({"id": case["id"], "half": case["half"],
                     "right": (got[0], got[1]) == (case["expected"]["line"], case["kind"])})
    return rows
