"""Root-cause accuracy of `draftsmith diagnose` over every log fixture in tests/fixtures/logs.

A fixture counts as right when the root cause's line, exception type, process and hint all equal its
`.expected.json` sidecar and the text contains the expected fragment (the same bar as
tests/test_diagnose.py::test_fixture_root_cause); a log expected to have no error must yield none.

    .venv/bin/python scripts/root_cause_accuracy.py

Writes benchmarks/results/root_cause_accuracy.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from draftsmith.engines.diagnose import analyze, read_log

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "logs"
RESULT = ROOT / "benchmarks" / "results" / "root_cause_accuracy.json"


def judge(log: Path) -> dict:
    want = json.loads(log.with_suffix(".expected.json").read_text())
    exp = want["root_cause"]
    t0 = time.perf_counter()
    rc = analyze(read_log(log)).root_cause
    row = {"log": log.name, "engine": want["engine"], "category": want["category"],
           "seconds": round(time.perf_counter() - t0, 4), "expected_line": exp["line"] if exp else None,
           "got_line": rc.line if rc else None, "got_text": rc.text[:200] if rc else None}
    if exp is None:
        row["right"] = rc is None
    else:
        got = rc and {"line": rc.line, "exception_type": rc.exception_type, "process": rc.process, "hint": rc.hint_name}
        row["right"] = bool(rc and got == {k: exp[k] for k in got} and exp["text_contains"] in rc.text)
    return row


def main() -> int:
    rows = [judge(log) for log in sorted(FIXTURES.glob("*.log"))]
    right = sum(r["right"] for r in rows)
    with_error = [r for r in rows if r["expected_line"] is not None]
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "what": "diagnose's root cause vs the hand-written expected root cause of each fixture log",
        "command": ".venv/bin/python scripts/root_cause_accuracy.py",
        "accuracy": f"{right}/{len(rows)}",
        "logs_with_an_error": f"{sum(r['right'] for r in with_error)}/{len(with_error)}",
        "by_engine": {e: f"{sum(r['right'] for r in rows if r['engine'] == e)}/{sum(r['engine'] == e for r in rows)}"
                      for e in sorted({r["engine"] for r in rows})},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, indent=2) + "\n")
    for r in rows:
        print(f"{'ok ' if r['right'] else 'BAD'} {r['log']:45s} line {r['got_line']} (expected {r['expected_line']})")
    print(f"accuracy {right}/{len(rows)}")
    return 0 if right == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
