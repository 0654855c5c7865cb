"""The k sweep in a serving engine: the drafter served at each draft length k, each server measured against
one baseline server by `bench.measure`, and the k with the best measured speed-up chosen.

Why measure k in the engine: what a drafted token costs differs between engines (the reference decoder's
PyTorch steps on this CPU against vLLM's compiled ones), so the k the reference decoder prefers is not the
engine's (docs/eval.md: reference decoder best at k=4, vLLM 1.34x at k=4 against 1.60x at k=2).

The rule (`choose_k`): the best speed-up at the lowest load level measured (concurrency 1 in the demo:
one user, where decoding is latency-bound and speculation is for), among the k that are not slower than
the baseline at any level measured (verdict.SPEEDUP_FLOOR; when every k is slower somewhere, among all).
Speed-ups within K_TIE of that best count as a tie, broken by the speed-up at the highest load level
(drafting costs compute that a loaded server lacks), then by the smaller k. A k with failed requests or
without acceptance data is out.

Used by `run`'s bench stage (`bench.k`) and benchmarks/vllm_k_sweep.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

from draftsmith.bench.benchmark import BenchSettings, measure
from draftsmith.bench.verdict import SPEEDUP_FLOOR

# Two speed-ups closer than this (relative) are a tie. A judgement, not a measured bound: on this shared 2-core
# CPU the per-round speed-ups of one level spread wider than this (bench.json's sweep rows list them), so a
# smaller difference does not rank two k; the load level above then decides.
K_TIE = 0.03


@dataclass(frozen=True)
class KPoint:
    """One k's measurement, as the choice reads it: speed-ups per load level, lowest load first."""

    k: int
    speedups: tuple[float | None, ...]
    failed: int
    tau: float | None


@dataclass(frozen=True)
class KChoice:
    k: int | None
    """None when no k qualifies (every one failed requests, lacked acceptance data or a baseline)."""
    reason: str


def choose_k(points: list[KPoint], labels: tuple[str, ...]) -> KChoice:
    """The k to serve: the module docstring's rule. `labels` names the load levels (`c=1`, `c=4`)."""
    usable = [p for p in points if not p.failed and p.tau is not None and p.speedups
              and all(x is not None for x in p.speedups)]
    if not usable:
        why = "; ".join(f"k={p.k}: " + ("failed requests" if p.failed else "no acceptance data" if p.tau is None
                                         else "no baseline speed-up") for p in points)
        return KChoice(None, f"no k measured cleanly ({why})")
    safe = [p for p in usable if min(p.speedups) >= SPEEDUP_FLOOR]
    pool = safe or usable
    best = max(p.speedups[0] for p in pool)
    tied = [p for p in pool if p.speedups[0] >= best * (1 - K_TIE)]
    pick = max(tied, key=lambda p: (p.speedups[-1], -p.k))  # one level: speedups[-1] is speedups[0]
    listing = ", ".join(f"k={p.k} {p.speedups[0]:.2f}x" for p in sorted(usable, key=lambda p: p.k))
    slower = [p for p in usable if p not in pool]
    left_out = "; left out, slower than without speculation at some level: " + ", ".join(
        f"k={p.k} ({min(zip(p.speedups, labels))[1]} {min(p.speedups):.2f}x)" for p in slower) if slower else ""
    if len(tied) == 1 or len(labels) == 1:
        return KChoice(pick.k, f"the best speed-up at {labels[0]} ({listing}){left_out}")
    others = ", ".join(f"k={p.k} {p.speedups[-1]:.2f}x" for p in tied if p is not pick)
    return KChoice(pick.k, f"within {K_TIE:.0%} of the best speed-up at {labels[0]} ({listing}), and the best of "
                           f"those at {labels[-1]}: {pick.speedups[-1]:.2f}x against {others}{left_out}")


def level_label(level: dict) -> str:
    """`c=4` or `0.5 req/s` for a level of bench's JSON."""
    return f"c={level['concurrency']}" if level.get("concurrency") is not None else f"{level['request_rate']:g} req/s"


def round_speedups(level: dict, baseline_level: dict | None) -> list[float]:
    """Speed-up of each round of a level (tokens/s with over without, round by round): its spread is how
    far the machine moved while the level ran."""
    base = (baseline_level or {}).get("rounds_tokens_per_s") or []
    return [w / b for w, b in zip(level.get("rounds_tokens_per_s") or [], base) if b]


def sweep_rows(reports: dict[int, dict]) -> list[dict[str, Any]]:
    """One row per k from its bench report: tau, acceptance per position, and per level tokens/s with and
    without the drafter, the speed-up and the speed-up of each round."""
    rows = []
    for k in sorted(reports):
        r = reports[k]
        base = {level_label(lv): lv for lv in ((r.get("baseline") or {}).get("levels") or []) if "concurrency" in lv}
        rows.append({"k": k, "tau": r["tau"], "per_position": r["per_position"],
                     "decision": r["verdict"]["decision"], "failed": sum(lv["failed"] for lv in r["levels"]),
                     "levels": [{"level": level_label(lv), "output_tokens_per_s": lv["output_tokens_per_s"],
                                 "baseline_output_tokens_per_s": lv["baseline_output_tokens_per_s"],
                                 "speedup": lv["speedup"], "tau": lv["tau"],
                                 "rounds_speedup": round_speedups(lv, base.get(level_label(lv)))}
                                for lv in r["levels"]]})
    return rows


def choose_from_reports(reports: dict[int, dict]) -> KChoice:
    rows = sweep_rows(reports)
    points = [KPoint(r["k"], tuple(lv["speedup"] for lv in r["levels"]), r["failed"], r["tau"]) for r in rows]
    return choose_k(points, tuple(lv["level"] for lv in rows[0]["levels"]))


def measure_sweep(ks: list[int], serve: Callable[[int], AbstractContextManager[str]], baseline_url: str | None,
                  s: BenchSettings, say=print, name: str = "") -> dict[int, dict]:
    """bench's report for each k in `ks`, in that order, each against `baseline_url`.

    `serve(k)` gives the URL of a server at k while the context is open, so at most one speculative server
    runs beside the baseline. With several k the baseline sees the same prompts once per k: each pass then
    sends its own vLLM cache_salt, so the baseline never answers from an earlier pass's prefix cache. `name`
    marks one of several sweeps sharing the baseline (one per drafter): its passes are salted by it too."""
    reports = {}
    for k in ks:
        say(f"sweep: {name} k={k}" if name else f"sweep: k={k}")
        salt = f"draftsmith-{name}-k{k}" if name else f"draftsmith-k{k}" if len(ks) > 1 else None
        with serve(k) as url:
            reports[k] = asyncio.run(measure(s.model_copy(update={"num_speculative_tokens": k}), say, url,
                                             baseline_url, cache_salt=salt))
    return reports


def sweep_record(reports: dict[int, dict], choice: KChoice) -> dict[str, Any]:
    """What bench.json keeps about the sweep: the chosen k with the reason, and every k's row."""
    return {"choice": asdict(choice), "k_tie": K_TIE, "rows": sweep_rows(reports)}
