"""`draftsmith bench`: load a served model, read its spec-decode metrics, and say go or no-go.

Run:
    draftsmith bench --endpoint http://127.0.0.1:8000 --baseline-endpoint http://127.0.0.1:8001 \
        --prompts eval --num-prompts 32 --concurrency 1,4,16 --max-tokens 128 --out runs/bench

How it measures (the gpt-fast habits of docs/design.md, "Measured output"):
- Streaming chat completions through the OpenAI client, one level at a time, each level on its own
  prompts (no prefix-cache carry-over between levels): a closed loop of at most
  `c` requests in flight (`--concurrency`) or an open loop of Poisson arrivals (`--request-rate`).
- Warm-up requests run first and are not measured; the acceptance window starts after them.
- TTFT = request sent -> first streamed token; ITL = gap between streamed chunks (with speculation one
  chunk can carry several tokens, so compare TPOT = (e2e - TTFT) / (tokens - 1) across servers);
  output tokens come from the server's usage record; tokens/s = output tokens / level wall time.
- Acceptance comes from the server (metrics.py): counters scraped before and after each level and
  differenced, so a level's tau covers exactly that level.
- The baseline is the same model without speculation: another endpoint, measured on the same prompts in
  turns with the one under test (`--rounds`: each level cut into rounds, the order flipping every round,
  never both at once, so drift of a shared machine hits both alike), or an earlier run's JSON;
  speed-up = tokens/s over the baseline's.

This module holds the settings, the load generator and the measurement; the go / no-go is verdict.py's
`decide`, the tables and plots render.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pydantic import Field, model_validator

from draftsmith.client import api_key_from_env, normalize_base, open_client, redact, served_model, with_path
from draftsmith.config import Settings, add_flags, from_flags
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import check_apart, check_output, foreign_entries, mark
from draftsmith.bench.metrics import (
    Acceptance,
    SpecCounters,
    Source,
    acceptance_from_counters,
    parse_sglang_gauge,
    parse_sglang_server_info,
    parse_spec_counters,
)
from draftsmith.bench.render import print_report, write_plots
from draftsmith.bench.results import EndpointResult, LevelResult, RequestResult
from draftsmith.bench.verdict import Verdict, decide

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")
SETTLE_POLL_S = 0.25  # engines publish counters just after the last chunk; re-scrape until still
SETTLE_MAX_S = 3.0
# vLLM's worker busy-polls its shared-memory queue for 1 s after its last step (vllm
# distributed/device_communicators/shm_broadcast.py, SpinCondition busy_loop_s=1): measured, one core for ~1 s
# after a level on the 2-core CPU. Rounds that switch servers wait this long, or the server that ran
# first would slow the next one's round (by half at concurrency 4 in one run).
SWITCH_SETTLE_S = 1.25
# Every request on a new connection, none kept alive: llama-server (cpp-httplib) can close a connection after a
# streamed answer without saying so (no `Connection: close`), and the next request sent on it at once fails with
# httpx's "Server disconnected without sending a response" (APIConnectionError after 2-6 ms: 1-3 of 8 requests per
# server at concurrency 1 in run's bench, both servers). A new connection to a local server costs well under a
# millisecond, the same for the server under test and its baseline.
CONNECTION_LIMITS = {"max_connections": 1000, "max_keepalive_connections": 0}


class BenchSettings(Settings):
    """What one bench run sends: the bench verb's flags and `run`'s bench section; printed first and saved
    with the results."""

    prompts: str = "eval"
    """Prompt set: train, eval, chat-eval, or a JSONL of {"prompt"} / {"messages"} records."""
    num_prompts: int = Field(32, ge=1)
    """Requests per level; each level takes the next prompts of the set, cycling when it runs out."""
    concurrency: tuple[int, ...] = (1, 4, 16)
    """Closed-loop levels: at most c requests in flight."""
    request_rate: tuple[float, ...] = ()
    """Open-loop levels in requests/s (Poisson arrivals); replaces concurrency when given."""
    max_tokens: int = Field(128, ge=1)
    """Cap on generated tokens per request."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of every request (0 = greedy)."""
    warmup: int = Field(2, ge=0)
    """Unmeasured requests sent before the first level."""
    seed: int = Field(0, ge=0)
    """Seed of the open-loop arrival times."""
    model: str | None = None
    """Served model name; null: the first one /v1/models lists."""
    timeout_s: float = Field(600.0, gt=0)
    """Seconds allowed per request."""
    num_speculative_tokens: int | None = Field(None, ge=1)
    """k, drafted tokens per step: only to turn SGLang's tau into an acceptance rate (run: null takes the
    k of each server it measures)."""
    rounds: int = Field(1, ge=1)
    """Each level in this many rounds of its prompts, the endpoint and the baseline taking turns (the order
    flips every round), so a machine that drifts or a neighbour's job slows both alike."""

    @model_validator(mode="after")
    def check_sizes(self) -> BenchSettings:
        if any(c < 1 for c in self.concurrency) or any(r <= 0 for r in self.request_rate):
            raise DraftsmithError("bad load levels", got=f"--concurrency {self.concurrency} "
                                  f"--request-rate {self.request_rate}",
                                  expected="concurrency levels >= 1 and request rates > 0",
                                  fix="for example --concurrency 1,4,16 or --request-rate 0.5,2")
        return self

    def levels(self) -> list[tuple[str, float]]:
        """("rate", r) levels when rates are given, else ("concurrency", c)."""
        if self.request_rate:
            return [("rate", r) for r in self.request_rate]
        return [("concurrency", c) for c in self.concurrency]


# ----------------------------------------------------------------------------------------------
# Prompts and requests


def load_messages(source: str, limit: int) -> list[list[dict[str, str]]]:
    """Chat messages for the requests: the system turns and the first user turn of each prompt."""
    from draftsmith.regenerate.prompts import load_prompts

    prompts = load_prompts(source)
    if not prompts:
        raise DraftsmithError("empty prompt set", got=repr(source), expected="at least one prompt",
                              fix="pass --prompts eval or a JSONL with records")
    out = []
    for p in prompts:
        first_user = next(i for i, m in enumerate(p.messages) if m["role"] == "user")
        out.append(p.messages[: first_user + 1])
    return [out[i % len(out)] for i in range(limit)]


def chunk_text(chunk) -> str:
    """Text a streamed chunk carries: content, or reasoning for servers that split it out."""
    if not chunk.choices:
        return ""
    delta = chunk.choices[0].delta
    extra = delta.model_extra or {}
    return delta.content or extra.get("reasoning_content") or extra.get("reasoning") or ""


async def send_request(client, model: str, messages, s: BenchSettings, extra_body: dict | None = None) -> RequestResult:
    """One streamed chat completion, timed from send to each chunk that carries text; `extra_body` holds
    server-specific request fields (vLLM's `cache_salt`)."""
    start = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=s.max_tokens, temperature=s.temperature,
            stream=True, stream_options={"include_usage": True}, timeout=s.timeout_s, extra_body=extra_body)
        async for chunk in stream:
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            if chunk_text(chunk):
                arrivals.append(time.perf_counter())
    except Exception as exc:  # every transport or API failure is one failed request, reported as such
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    end = time.perf_counter()
    if not arrivals:
        return RequestResult(ok=False, error="the stream carried no text")
    tokens = usage_tokens if usage_tokens is not None else len(arrivals)
    return RequestResult(ok=True, ttft_s=arrivals[0] - start, e2e_s=end - start, output_tokens=tokens,
                         chunk_gaps_s=tuple(np.diff(arrivals).tolist()))


async def closed_loop(client, model, batch, s: BenchSettings, concurrency: int,
                      extra_body: dict | None = None) -> list[RequestResult]:
    """At most `concurrency` requests in flight until `batch` is done."""
    gate = asyncio.Semaphore(concurrency)

    async def bounded(messages):
        async with gate:
            return await send_request(client, model, messages, s, extra_body)

    return list(await asyncio.gather(*(bounded(m) for m in batch)))


async def open_loop(client, model, batch, s: BenchSettings, rate: float,
                    extra_body: dict | None = None) -> list[RequestResult]:
    """Requests sent at Poisson arrivals of `rate` per second (seeded), however many are in flight."""
    rng = random.Random(s.seed)
    tasks = []
    for messages in batch:
        tasks.append(asyncio.create_task(send_request(client, model, messages, s, extra_body)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


# ----------------------------------------------------------------------------------------------
# Metrics scraping


@dataclass(frozen=True)
class Scrape:
    """What the server said about speculation at one instant."""

    counters: tuple[Source, SpecCounters] | None = None
    snapshot: Acceptance | None = None
    """SGLang: a gauge or a since-start-up average, used as is."""


async def scrape(http, base: str, k: int | None) -> Scrape:
    """Read `/metrics` (vLLM, llama.cpp, SGLang gauge), then SGLang `/server_info` as a fallback."""
    text = ""
    try:
        r = await http.get(with_path(base, "/metrics"))
        if r.status_code == 200:
            text = r.text
    except Exception:  # a server without metrics is reported as "no acceptance data", not a crash
        pass
    counters = parse_spec_counters(text) if text else None
    if counters:
        return Scrape(counters=counters)
    gauge = parse_sglang_gauge(text, k) if text else None
    if gauge:
        return Scrape(snapshot=gauge)
    try:
        r = await http.get(with_path(base, "/server_info"))
        return Scrape(snapshot=parse_sglang_server_info(r.json(), k) if r.status_code == 200 else None)
    except Exception:  # not SGLang, or no JSON: no acceptance data
        return Scrape()


async def settled_scrape(http, base: str, k: int | None) -> Scrape:
    """Scrape until two reads agree: counters for the last step are published just after its tokens."""
    last = await scrape(http, base, k)
    deadline = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_POLL_S)
        now = await scrape(http, base, k)
        if now == last:
            return now
        last = now
    return last


def window_acceptance(before: Scrape, after: Scrape) -> Acceptance | None:
    """Acceptance between two scrapes: differenced counters, else the later SGLang snapshot."""
    if before.counters and after.counters:
        source, counters = after.counters
        try:
            return acceptance_from_counters(counters.minus(before.counters[1]), source)
        except ValueError as exc:
            raise DraftsmithError("the server's spec-decode counters went backwards during the run",
                                  got=str(exc), expected="one server process for the whole run",
                                  fix="rerun once the server is stable") from exc
    return after.snapshot


# ----------------------------------------------------------------------------------------------
# Summaries


def percentiles(values: list[float], name: str) -> dict[str, float | None]:
    """`{name}_ms_p50: ...` for PERCENTILES, from seconds; None when there are no samples."""
    arr = np.asarray(values, dtype=float) * 1e3
    return {f"{name}_ms_p{p}": float(np.percentile(arr, p)) if arr.size else None for p in PERCENTILES}


def summarize_level(kind: str, value: float, results: list[RequestResult], duration_s: float,
                    acceptance: Acceptance | None, rounds_tokens_per_s: tuple[float, ...] = ()) -> LevelResult:
    ok = [r for r in results if r.ok]
    samples = {
        "ttft": [r.ttft_s for r in ok],
        "itl": [g for r in ok for g in r.chunk_gaps_s],
        "tpot": [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "e2e": [r.e2e_s for r in ok],
    }
    latency = {k: v for name in LATENCIES for k, v in percentiles(samples[name], name).items()}
    tokens = sum(r.output_tokens for r in ok)
    failed = [r for r in results if not r.ok]
    return LevelResult(
        concurrency=int(value) if kind == "concurrency" else None,
        request_rate=float(value) if kind == "rate" else None,
        requests=len(results), failed=len(failed), duration_s=duration_s, output_tokens=tokens,
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        latency_ms=latency, acceptance=acceptance, first_error=failed[0].error if failed else "",
        rounds_tokens_per_s=rounds_tokens_per_s,
    )


# ----------------------------------------------------------------------------------------------
# One endpoint


@dataclass
class Endpoint:
    """One server open for a measurement: its clients, the model it serves, what each request adds."""

    base: str
    model: str
    client: Any
    http: Any
    k: int | None
    extra_body: dict | None

    async def send(self, batch, s: BenchSettings, kind: str, value: float) -> list[RequestResult]:
        if kind == "rate":
            return await open_loop(self.client, self.model, batch, s, value, self.extra_body)
        return await closed_loop(self.client, self.model, batch, s, int(value), self.extra_body)


@contextlib.asynccontextmanager
async def connect(url: str, s: BenchSettings, extra_body: dict | None = None) -> AsyncIterator[Endpoint]:
    """An OpenAI client and a metrics client for `url`; the model is s.model or the first one it lists."""
    import httpx
    import openai

    base = normalize_base(url)
    limits = httpx.Limits(**CONNECTION_LIMITS)
    async with open_client(with_path(base, "/v1"), http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client, \
            httpx.AsyncClient(timeout=30, limits=limits,
                              headers={"Authorization": f"Bearer {api_key_from_env()}"}) as http:
        yield Endpoint(base, s.model or await served_model(client), client, http, s.num_speculative_tokens,
                       extra_body)


def split_rounds(batch: list, rounds: int) -> list[list]:
    """`batch` cut into at most `rounds` consecutive parts of nearly equal size, none empty."""
    n = max(1, min(rounds, len(batch)))
    size, extra = divmod(len(batch), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [batch[bounds[i]:bounds[i + 1]] for i in range(n)]


def turn_order(n: int, round_index: int) -> list[int]:
    """Endpoints in turn within a round, the order reversed every other round (A B, B A, A B, ...), so
    neither is always measured first after the other has warmed the caches or the machine has moved."""
    order = list(range(n))
    return order if round_index % 2 == 0 else order[::-1]


async def bench_endpoints(urls: list[str], settings: list[BenchSettings], warm, per_level, say=print,
                          extra_body: dict | None = None) -> list[EndpointResult]:
    """Warm each endpoint up on `warm`, then level i on `per_level[i]` for every endpoint, in s.rounds
    rounds that take turns (`turn_order`); one endpoint runs at a time, and a switch to another waits
    SWITCH_SETTLE_S for the last one to go idle. Acceptance is scraped around each
    level (counters move only while their own server works); a level's tokens/s is its tokens over the
    seconds of its own rounds."""
    s = settings[0]
    async with contextlib.AsyncExitStack() as stack:
        eps = [await stack.enter_async_context(connect(u, st, extra_body)) for u, st in zip(urls, settings)]
        for ep, st in zip(eps, settings):
            if warm:
                say(f"{redact(ep.base)}: warm-up, {len(warm)} requests (not measured)")
                await closed_loop(ep.client, ep.model, warm, st, len(warm), extra_body)
        first = [await settled_scrape(ep.http, ep.base, ep.k) for ep in eps]
        before, levels, last = list(first), [[] for _ in eps], len(eps) - 1
        for (kind, value), batch in zip(s.levels(), per_level):
            results, rates, seconds = [[] for _ in eps], [[] for _ in eps], [0.0] * len(eps)
            for r, part in enumerate(split_rounds(batch, s.rounds)):
                for i in turn_order(len(eps), r):
                    if i != last:  # the server that ran last still spins (SWITCH_SETTLE_S)
                        await asyncio.sleep(SWITCH_SETTLE_S)
                    last = i
                    start = time.perf_counter()
                    got = await eps[i].send(part, settings[i], kind, value)
                    took = time.perf_counter() - start
                    results[i] += got
                    seconds[i] += took
                    rates[i].append(sum(x.output_tokens for x in got if x.ok) / took if took > 0 else 0.0)
            for i, ep in enumerate(eps):
                after = await settled_scrape(ep.http, ep.base, ep.k)
                level = summarize_level(kind, value, results[i], seconds[i], window_acceptance(before[i], after),
                                        tuple(rates[i]))
                say(f"{redact(ep.base)}: {level.label()}  {level.output_tokens_per_s:.1f} tok/s"
                    + (f"  tau {level.acceptance.tau:.2f}" if level.acceptance and level.acceptance.tau else ""))
                levels[i].append(level)
                before[i] = after
        return [EndpointResult(redact(ep.base), ep.model, lv, window_acceptance(f, b))
                for ep, lv, f, b in zip(eps, levels, first, before)]


# ----------------------------------------------------------------------------------------------
# Baseline


def baseline_levels_from_json(path: Path) -> dict[tuple[str, float], float]:
    """tokens/s per level key from an earlier `draftsmith bench --json` run."""
    try:
        data = json.loads(Path(path).read_text())
        rows = data["levels"]
        out = {}
        for row in rows:
            key = ("rate", float(row["request_rate"])) if row.get("request_rate") is not None \
                else ("concurrency", int(row["concurrency"]))
            out[key] = float(row["output_tokens_per_s"])
        if not out:
            raise ValueError('"levels" is empty')
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DraftsmithError("cannot read the baseline JSON", got=f"{path}: {type(exc).__name__}: {exc}",
                              expected='the --json output of an earlier `draftsmith bench` run, with "levels" '
                              'holding concurrency (or request_rate) and output_tokens_per_s',
                              fix="rerun bench against the server without speculation with --json > FILE") from exc


def apply_baseline(levels: list[LevelResult], baseline: dict[tuple[str, float], float]) -> None:
    for level in levels:
        ref = baseline.get(level.key())
        level.baseline_output_tokens_per_s = ref
        level.speedup = level.output_tokens_per_s / ref if ref else None


# ----------------------------------------------------------------------------------------------
# The JSON report


def build_report(s: BenchSettings, run: EndpointResult, baseline: dict[str, Any] | None,
                 verdict: Verdict) -> dict[str, Any]:
    """The JSON document: headline acceptance, one row per level, the baseline, the verdict; credentials redacted
    (a failed request's error may quote its URL)."""
    acc = run.acceptance
    return redact({
        "endpoint": run.endpoint,
        "model": run.model,
        "settings": s.model_dump(mode="json"),
        "tau": acc.tau if acc else None,
        "acceptance_rate": acc.acceptance_rate if acc else None,
        "per_position": list(acc.per_position) if acc else [],
        "acceptance": acc.to_dict() if acc else None,
        "levels": [lv.to_dict() for lv in run.levels],
        "baseline": baseline,
        "verdict": asdict(verdict),
    })


# ----------------------------------------------------------------------------------------------
# CLI


EXAMPLE = """examples:
  # speculative server on :8000, the same model without speculation on :8001
  draftsmith bench --endpoint http://127.0.0.1:8000 --baseline-endpoint http://127.0.0.1:8001 \\
      --prompts eval --num-prompts 32 --concurrency 1,4,16 --max-tokens 128 --out runs/bench

  # baseline measured earlier, JSON only
  draftsmith bench --endpoint http://127.0.0.1:8001 --concurrency 1,4 --json > nospec.json
  draftsmith bench --endpoint http://127.0.0.1:8000 --concurrency 1,4 --baseline-json nospec.json --json

exit codes: 0 go (or inconclusive without a baseline), 1 no-go, 2 bad input.
API key: $DRAFTSMITH_API_KEY or $OPENAI_API_KEY (never a flag)."""


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("bench", help="load an endpoint, read its spec-decode metrics, say go or no-go",
                       **example_help(EXAMPLE))
    p.add_argument("--endpoint", required=True, help="base URL of the OpenAI-compatible server under test")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--baseline-endpoint", help="the same model served without speculation")
    group.add_argument("--baseline-json", type=Path, help="--json output of an earlier run without speculation")
    add_flags(p, BenchSettings, flags={"timeout_s": "--timeout"})
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--out", type=Path, help="write bench.json, throughput.png, acceptance.png here")
    p.add_argument("--overwrite", action="store_true", help="write into an --out that holds files draftsmith did not "
                   "write (files of the same names are replaced)")
    p.set_defaults(func=run_bench)


async def measure(s: BenchSettings, say, endpoint: str, baseline_endpoint: str | None = None,
                  baseline_json: Path | None = None, cache_salt: str | None = None) -> dict[str, Any]:
    """The endpoint under test and the baseline endpoint in alternating rounds (never both at once), or
    the endpoint alone against a saved bench.json; then the verdict.

    `cache_salt` (vLLM's request field) keeps a server that is measured again on the same prompts from
    answering them out of its prefix cache: a baseline server shared by several measurements."""
    # distinct prompts per level (while the set lasts), so no level is served from the prefix cache
    # that an earlier level filled; both endpoints get the same prompts at the same level
    n, levels = s.num_prompts, len(s.levels())
    messages = load_messages(s.prompts, s.warmup + n * levels)
    warm = messages[: s.warmup]
    per_level = [messages[s.warmup + i * n: s.warmup + (i + 1) * n] for i in range(levels)]
    urls, settings = [endpoint], [s]
    if baseline_endpoint:  # the baseline may serve the model under another name: let it be discovered
        urls, settings = urls + [baseline_endpoint], settings + [s.model_copy(update={"model": None})]
    extra = {"cache_salt": cache_salt} if cache_salt else None
    run, *ref = await bench_endpoints(urls, settings, warm, per_level, say, extra)
    baseline = None
    if ref:
        apply_baseline(run.levels, {lv.key(): lv.output_tokens_per_s for lv in ref[0].levels})
        baseline = {"source": ref[0].endpoint, "model": ref[0].model, "levels": [lv.to_dict() for lv in ref[0].levels]}
    elif baseline_json:
        ref_levels = baseline_levels_from_json(baseline_json)
        apply_baseline(run.levels, ref_levels)
        baseline = {"source": str(baseline_json),
                    "levels": [{"level": list(k), "output_tokens_per_s": v} for k, v in ref_levels.items()]}
    verdict = decide(run.acceptance, run.levels, baseline is not None)
    return build_report(s, run, baseline, verdict)


def run_bench(args) -> int:
    s = from_flags(BenchSettings, args)
    # its inputs are never written over; a folder of the user's is refused before any request
    check_apart(args.out, "bench", "--out", {"--baseline-json": args.baseline_json, "--prompts": s.prompts})
    if args.out:
        check_output(args.out, "bench", args.overwrite)
    if args.baseline_json:  # read whole before the first request, not after the measurement
        baseline_levels_from_json(args.baseline_json)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    log(f"bench settings: {json.dumps(s.model_dump(mode='json'))}")
    report = asyncio.run(measure(s, log, args.endpoint, args.baseline_endpoint, args.baseline_json))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        for path in write_plots(report, args.out):
            log(f"wrote {path}")
        mark(args.out, "bench", foreign_entries(args.out))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 1 if report["verdict"]["decision"] == "no-go" else 0
