"""The acceptance guard's measurement: what the drafter accepted on held-back data, and what the engine accepts now.

The expectation travels with the drafter as `expected_acceptance` in the `draftsmith` block of its config.json, a
block neither vLLM (transformers' PretrainedConfig keeps unknown keys as attributes nobody reads) nor llama.cpp's
converter (conversion/llama.py reads named hparams only) looks at:

    "expected_acceptance": {
      "k": 3,                                   # the k it was exported at
      "by_k": {"3": {"per_position": [.84, .68, .55], "tau": 3.07}, "4": {...}},
      "measured_on": {"data": "chat-eval", "count": 40, "max_new_tokens": 96, "method": "...", "date": "..."}
    }

per_position[i] has the engines' definition (bench.metrics): the share of drafts whose token i was accepted.

The engine side: a few short greedy chat requests, the spec-decode counters of `/metrics` (vLLM, llama.cpp) before
and after, differenced (`bench.metrics`). The verdict on the two is `bench.verdict.decide_guard`.

Run through `draftsmith launch --guard` or `draftsmith guard --url URL -- ENGINE COMMAND`.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.bench.metrics import Acceptance, acceptance_from_counters, parse_spec_counters
from draftsmith.errors import DraftsmithError

EXPECTED_KEY = "expected_acceptance"
GUARD_PROMPTS = "chat-eval"  # the built-in chat set; the embedded drafter's expectation was measured on it
GUARD_REQUESTS = 8
GUARD_MAX_TOKENS = 48
GUARD_BUDGET_S = 40.0
# Requests stop at GUARD_REQUESTS or before one would run past GUARD_BUDGET_S (after at least one), so the guard
# ends within a minute of readiness on a slow or busy CPU; 8 x 48 tokens give ~120 drafts at tau ~3, a standard error of
# ~0.035 on position 0 (binomial, p ~0.8); a collapse (position 0 halved) shows after a single request.


@dataclass(frozen=True)
class Expected:
    """The drafter's own per-position acceptance at k, and what it was measured on."""

    k: int
    per_position: tuple[float, ...]
    tau: float
    measured_on: dict[str, Any]


def expected_record(by_k: dict[int, list[float]], k: int, measured_on: dict[str, Any]) -> dict[str, Any]:
    """The `expected_acceptance` block for a drafter exported at `k`, from per-position acceptance by k."""
    return {"k": k, "by_k": {str(kk): {"per_position": [round(p, 4) for p in pp], "tau": round(1 + sum(pp), 4)}
                             for kk, pp in sorted(by_k.items())}, "measured_on": measured_on}


def expected_from_eval(ev: dict[str, Any], k: int, measured_on: dict[str, Any]) -> dict[str, Any] | None:
    """An estimate from the trainer's held-back eval block (engine-walk tau at each k): position i accepts
    tau(i+1) - tau(i) of drafts, tau(0) = 1. The walk's chain placement shifts with k, so this is close, not exact."""
    tau = {int(kk): float(v) for kk, v in (ev.get("tau") or {}).items()}
    if not tau or 1 not in tau:
        return None
    steps = [tau[i] - tau.get(i - 1, 1.0) for i in range(1, max(tau) + 1) if i in tau and (i == 1 or i - 1 in tau)]
    per_pos = [max(0.0, min(1.0, s)) for s in steps]
    by_k = {kk: per_pos[:kk] for kk in range(1, len(per_pos) + 1)}
    return expected_record(by_k, k, {**measured_on, "method": "trainer eval: engine-walk tau(i+1) - tau(i) on the "
                                                               "held-back split (estimate)"})


def with_expected_acceptance(meta: dict, k: int, src: Path) -> dict:
    """`meta` (a drafter's `draftsmith` block) with its expected per-position acceptance at the exported k, which
    the guard compares the engine with: the checkpoint's own record when it has one, else estimated from the
    trainer's held-back eval (DFlash's: the blocks' leading correct positions, so each position is exact, not an
    estimate of a walk); none for a drafter without either (a converted public one)."""
    rec = meta.get(EXPECTED_KEY)
    if rec is None and meta.get("eval"):
        stamp = time.strftime("%Y-%m-%d", time.gmtime((src / "config.json").stat().st_mtime))
        rec = expected_from_eval(meta["eval"], k, {"data": f"held-back split of {meta.get('store') or 'the store'}",
                                                   "count": None, "date": stamp})
    return {**meta, EXPECTED_KEY: {**rec, "k": k}} if rec else meta


def expected_from_eval_json(doc: dict[str, Any] | list, k: int, data: str) -> dict[str, Any]:
    """The `expected_acceptance` block from `draftsmith eval --json` output (its per-k sweep), measured on `data`.

    Raises:
        DraftsmithError: a file that is not eval's JSON, or one without per-position acceptance.
    """
    sweep = doc.get("sweep") if isinstance(doc, dict) else doc
    rows = [r for r in sweep or [] if isinstance(r, dict) and r.get("per_position") and r.get("topk", 1) == 1]
    if not rows:
        raise DraftsmithError("the reference is not an eval JSON with per-position acceptance",
                              got=f"{type(doc).__name__} without sweep[].per_position",
                              expected="the file `draftsmith eval --json FILE` writes (chain drafting, --topk 1)",
                              fix="run draftsmith eval --drafter DIR --k 3,4 --prompts YOUR_HELD_BACK.jsonl --json FILE")
    settings = (doc.get("settings") if isinstance(doc, dict) else None) or {}
    steps = sum(r.get("verify_steps", 0) for r in rows)
    return expected_record({int(r["k"]): list(r["per_position"]) for r in rows}, k, {
        "data": data, "count": settings.get("limit"), "max_new_tokens": settings.get("max_new_tokens"),
        "verify_steps": steps, "dtype": settings.get("dtype"), "engine_reading": settings.get("engine"),
        "method": "draftsmith eval: reference speculative decoding, greedy", "date": time.strftime("%Y-%m-%d")})


def read_expected(config: dict[str, Any], k: int | None) -> Expected | None:
    """The expectation at the served k from a drafter's config.json (None when it carries none).

    A k the record lacks takes the nearest recorded k's leading positions (position 0 barely depends on k)."""
    rec = (config.get("draftsmith") or {}).get(EXPECTED_KEY)
    if not rec or not rec.get("by_k"):
        return None
    by_k = {int(kk): v for kk, v in rec["by_k"].items()}
    want = k or int(rec.get("k") or max(by_k))
    near = want if want in by_k else min(by_k, key=lambda kk: (abs(kk - want), -kk))
    pp = tuple(by_k[near]["per_position"][:want])
    return Expected(k=len(pp), per_position=pp, tau=1 + sum(pp), measured_on={**rec.get("measured_on", {}),
                                                                               "k_recorded": near})


def read_expected_dir(drafter: Path, k: int | None) -> Expected | None:
    path = Path(drafter) / "config.json"
    return read_expected(json.loads(path.read_text()), k) if path.is_file() else None


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The engine's /metrics page.

    Raises:
        DraftsmithError: the engine does not answer at `url`."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return r.read().decode("utf-8", errors="replace")
    except OSError as err:
        raise DraftsmithError("the engine does not answer", got=f"{url}/metrics: {err}",
                              expected="a ready engine at --url",
                              fix="start it first (`draftsmith launch --guard -- COMMAND` waits for readiness) and "
                                  "pass its base URL") from err


def chat(url: str, model: str | None, messages: list[dict], max_tokens: int, timeout_s: float = 120.0) -> None:
    """One greedy chat completion; its tokens count in the server's spec-decode counters."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **({"model": model} if model else {})}
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def served_model(url: str) -> str | None:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as r:
        data = json.loads(r.read()).get("data") or []
    return data[0]["id"] if data else None


@dataclass(frozen=True)
class Measured:
    acceptance: Acceptance
    requests: int
    seconds: float
    counters: tuple[str, str]
    """The spec-decode lines of the /metrics pages before and after: the evidence, as the engine printed it."""


def spec_lines(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if "spec_decode" in line)


def measure(url: str, prompts: str = GUARD_PROMPTS, requests: int = GUARD_REQUESTS,
            max_tokens: int = GUARD_MAX_TOKENS, budget_s: float = GUARD_BUDGET_S) -> Measured:
    """The engine's own per-position acceptance over up to `requests` short greedy chats, sent one after another
    until `budget_s` has passed (counters differenced).

    Raises:
        DraftsmithError: the server exposes no spec-decode counters, or drafted nothing in the window.
    """
    from draftsmith.regenerate.prompts import load_prompts

    t0 = time.monotonic()
    first = scrape(url)
    before = parse_spec_counters(first)
    if before is None:
        raise DraftsmithError("the engine exposes no spec-decode counters", got=f"{url}/metrics without them",
                              expected="vllm:spec_decode_* or llamacpp:spec_decode_* counters",
                              fix="serve with a drafter (vLLM --speculative-config; llama-server -md ... --metrics)")
    model = served_model(url)
    sent = 0
    for p in load_prompts(prompts, requests):
        spent = time.monotonic() - t0
        if sent and spent + spent / sent > budget_s:  # the next request, as long as the mean so far, would overrun
            break
        chat(url, model, p.messages, max_tokens)
        sent += 1
    last = scrape(url)
    source, after = parse_spec_counters(last)
    delta = after.minus(before[1])
    if delta.drafts <= 0:
        raise DraftsmithError("the engine drafted nothing during the guard's requests", got=f"{delta}",
                              expected="drafts > 0", fix="check the server runs with speculation on")
    return Measured(acceptance_from_counters(delta, source), sent, time.monotonic() - t0,
                    (spec_lines(first), spec_lines(last)))
