"""Score `draftsmith diagnose` on the real-log corpus, development half and held-back half apart.

tests/fixtures/diagnose_corpus/ holds logs posted in public vLLM / SGLang issue threads, one file per
case, and index.json with each case's source, date, engine, kind and expected root-cause line
(README.md there explains the corpus and the split). A case is right when `diagnose` names the
expected line with the expected kind (exception, error_line, hang, stalled, not_captured).

    .venv/bin/python scripts/diagnose_corpus.py            # both halves, per kind and per engine
    .venv/bin/python scripts/diagnose_corpus.py --show dev # also print each dev case's answer

Writes benchmarks/results/diagnose_corpus.json. Rules are tuned on the dev half only: read the
held-back half's totals, never its rows, when changing rules.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from draftsmith.diagnose import analyze, read_log

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "diagnose_corpus"
RESULT = ROOT / "benchmarks" / "results" / "diagnose_corpus.json"
SPLITS = ("dev", "held_back")


def split_of(source: str) -> str:
    """The half a thread belongs to: even first 32 bits of sha256(source URL) -> dev, odd -> held_back."""
    return "dev" if int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % 2 == 0 else "held_back"


def load_index() -> list[dict]:
    return json.loads((CORPUS / "index.json").read_text())["cases"]


def judge(case: dict) -> dict:
    """One case's row: what diagnose said and whether it names the expected line and kind."""
    diag = analyze(read_log(CORPUS / case["file"]))
    rc, stall, exp = diag.root_cause, diag.stall, case["expected"]
    got = (rc.line, rc.kind, rc.text) if rc else (stall.line, "stalled", stall.text) if stall else (None, None, None)
    return {"id": case["id"], "split": case["split"], "engine": case["engine"], "kind": case["kind"],
            "expected_line": exp["line"], "got_line": got[0], "got_kind": got[1],
            "got_text": got[2][:160] if got[2] else None, "hint": rc.hint_name if rc else None,
            "right": (got[0], got[1]) == (exp["line"], case["kind"])}


def tally(rows: list[dict], key: str) -> dict[str, str]:
    groups: dict[str, list[bool]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r["right"])
    return {k: f"{sum(v)}/{len(v)}" for k, v in sorted(groups.items())}


def score(rows: list[dict]) -> dict:
    """Per half: right/total overall, per kind and per engine."""
    out = {}
    for half in SPLITS:
        part = [r for r in rows if r["split"] == half]
        right = sum(r["right"] for r in part)
        out[half] = {"right": right, "total": len(part), "accuracy": round(right / len(part), 3) if part else None,
                     "by_kind": tally(part, "kind"), "by_engine": tally(part, "engine")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", choices=SPLITS, help="print each case of this half")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [judge(c) for c in load_index()]
    result = score(rows)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "what": "diagnose's root-cause line and kind vs the expected ones, on real logs from public issue threads",
        "command": ".venv/bin/python scripts/diagnose_corpus.py", "seconds": round(time.perf_counter() - t0, 2),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "score": result,
        "rows": [r for r in rows if r["split"] == "dev"]}, indent=2) + "\n")
    for r in rows:
        if r["split"] == args.show:
            print(f"{'ok ' if r['right'] else 'BAD'} {r['id']:48s} {r['kind']:12s} line {r['got_line']} "
                  f"({r['got_kind']}) expected {r['expected_line']}")
    for half in SPLITS:
        s = result[half]
        print(f"{half:9s} {s['right']}/{s['total']}  by kind {s['by_kind']}  by engine {s['by_engine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
