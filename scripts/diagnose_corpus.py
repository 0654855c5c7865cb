"""Score `draftsmith diagnose` on the real-log corpus, each set's development and held-back halves apart.

tests/fixtures/diagnose_corpus/ holds logs posted in public vLLM / SGLang issue threads, one file per case,
with each case's source, date, engine, kind and expected root-cause line: set 1 in index.json (README.md
there), set 2 in set2/index.json (set2/README.md: gathered after set 1's rules were written). A case is
right when `diagnose` names the expected line with the expected kind (exception, error_line, hang, stalled,
not_captured).

    .venv/bin/python scripts/diagnose_corpus.py            # every half, per kind, engine and phase
    .venv/bin/python scripts/diagnose_corpus.py --half dev # development halves only, writes nothing
    .venv/bin/python scripts/diagnose_corpus.py --show dev # also print each development case's answer

Writes benchmarks/results/diagnose_corpus.json (development rows only). Rules are tuned on the development
halves only: read the held-back halves' totals, never their rows, when changing rules; while changing
rules, run `--half dev`, so that held-back halves are scored once a pass is done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from draftsmith.engines.diagnose import analyze, read_log

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "diagnose_corpus"
SETS = {"set1": CORPUS, "set2": CORPUS / "set2"}
RESULT = ROOT / "benchmarks" / "results" / "diagnose_corpus.json"
SPLITS = ("dev", "held_back")
HALVES = tuple(f"{name}/{split}" for name in SETS for split in SPLITS)


def split_of(source: str) -> str:
    """The half a thread belongs to: even first 32 bits of sha256(source URL) -> dev, odd -> held_back."""
    return "dev" if int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % 2 == 0 else "held_back"


def load_index(name: str | None = None) -> list[dict]:
    """Every case of one set (or of every set), each with its `set` and `half` (`set2/dev` ...) added."""
    names = [name] if name else list(SETS)
    return [{**case, "set": n, "half": f"{n}/{case['split']}"}
            for n in names for case in json.loads((SETS[n] / "index.json").read_text())["cases"]]


def judge(case: dict) -> dict:
    """One case's row: what diagnose said and whether it names the expected line and kind."""
    diag = analyze(read_log(SETS[case.get("set", "set1")] / case["file"]))
    rc, stall, exp = diag.root_cause, diag.stall, case["expected"]
    got = (rc.line, rc.kind, rc.text) if rc else (stall.line, "stalled", stall.text) if stall else (None, None, None)
    return {"id": case["id"], "half": case.get("half", f"set1/{case['split']}"), "split": case["split"],
            "engine": case["engine"], "kind": case["kind"], "phase": case.get("phase"),
            "expected_line": exp["line"], "got_line": got[0], "got_kind": got[1],
            "got_text": got[2][:160] if got[2] else None, "hint": rc.hint_name if rc else None,
            "right": (got[0], got[1]) == (exp["line"], case["kind"])}


def tally(rows: list[dict], key: str) -> dict[str, str]:
    groups: dict[str, list[bool]] = defaultdict(list)
    for r in rows:
        if r[key] is not None:
            groups[r[key]].append(r["right"])
    return {k: f"{sum(v)}/{len(v)}" for k, v in sorted(groups.items())}


def score(rows: list[dict]) -> dict:
    """Per half (`set1/dev` ...): right/total overall, per kind, per engine and (set 2) per phase."""
    out = {}
    for half in sorted({r["half"] for r in rows}, key=HALVES.index):
        part = [r for r in rows if r["half"] == half]
        right = sum(r["right"] for r in part)
        out[half] = {"right": right, "total": len(part), "accuracy": round(right / len(part), 3),
                     "by_kind": tally(part, "kind"), "by_engine": tally(part, "engine"), "by_phase": tally(part, "phase")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", choices=["dev"], help="print each development case's answer")
    ap.add_argument("--half", choices=["dev"], help="score the development halves only and write nothing")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases = [c for c in load_index() if args.half is None or c["split"] == args.half]
    rows = [judge(c) for c in cases]
    result = score(rows)
    dev_rows = [r for r in rows if r["split"] == "dev"]
    if args.half is None:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps({
            "what": "diagnose's root-cause line and kind vs the expected ones, on real logs from public issue threads",
            "command": ".venv/bin/python scripts/diagnose_corpus.py", "seconds": round(time.perf_counter() - t0, 2),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "score": result, "rows": dev_rows}, indent=2) + "\n")
    for r in dev_rows if args.show else []:
        print(f"{'ok ' if r['right'] else 'BAD'} {r['half']:13s} {r['id']:48s} {r['kind']:12s} line {r['got_line']} "
              f"({r['got_kind']}) expected {r['expected_line']}")
    for half, s in result.items():
        print(f"{half:14s} {s['right']}/{s['total']}  by kind {s['by_kind']}  by engine {s['by_engine']}"
              + (f"  by phase {s['by_phase']}" if s["by_phase"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
