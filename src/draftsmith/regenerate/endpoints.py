"""Regeneration over OpenAI-compatible endpoints: many servers, reasoning traces, faults survived.

`regenerate_endpoints(prompts, endpoints, writer, settings)` sends every unfinished prompt to a pool of
chat-completion servers (vLLM, SGLang, any OpenAI-compatible API) and appends each finished
conversation to a `ConversationWriter` exactly once. How it works:

- One client per endpoint, `concurrency` workers per endpoint, one shared work queue. A prompt that
  fails goes back into the queue after a backoff and any healthy endpoint takes it, so the share of an
  endpoint that dies moves to the others.
- An endpoint is marked down after `DOWN_AFTER_CONNECTION_ERRORS` connection failures in a row; its
  workers stop taking work and a prober polls `GET /models` (which costs no prompt an attempt) until
  it answers again. 429 / 503 with `Retry-After` pause that endpoint for as long as it asks.
- Each prompt gets `max_retries` retries with exponential backoff and jitter; a prompt that still
  fails, or fails with a non-retryable status (400, 401, 404, ...), is listed in the summary with its
  reason. When more than `error_budget` of the run's prompts have failed, the run stops; unfinished
  prompts are left for a rerun, which skips every id already written.
- Multi-turn prompts are answered turn by turn, one answer after every user message; each turn sees the target's own earlier answers (their
  content only: chat templates of reasoning models drop earlier reasoning). A retry resumes at the
  turn that failed.
- Reasoning comes from the message field `reasoning_content` or `reasoning` (servers run with a
  reasoning parser) or from an inline `<think>...</think>` block; `meta` records which.

URLs, the API key ($DRAFTSMITH_API_KEY or $OPENAI_API_KEY, never a flag, never printed), the redaction of
credentials, failure classes, backoff and the served-model lookup live in `draftsmith.client`: an endpoint's
name, its progress lines, the summary (printed and regenerate.json) and each record's `meta` go through
`redact`, the requests keep the URL's credentials.
Run it with `draftsmith regenerate --endpoint URL [--endpoint URL ...]`; docs/regenerate.md has more.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
import re
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console
from rich.live import Live
from rich.table import Table

from draftsmith.client import (
    BadReply,
    Failure,
    NoServedModel,
    RequestFailed,
    backoff_delay,
    classify,
    normalize_base,
    open_client,
    parse_endpoint,
    redact,
    served_model,
    with_path,
    with_retries,
)
from draftsmith.errors import DraftsmithError
from draftsmith.regenerate.conversations import Conversation, ConversationWriter

if TYPE_CHECKING:
    import openai

    from draftsmith.regenerate.prompts import Prompt

# One reset can be a fault of a single request; three in a row mean the server is gone.
DOWN_AFTER_CONNECTION_ERRORS = 3
PROBE_TIMEOUT_S = 5.0
PROBE_FIRST_DELAY_S = 0.5
SYNC_INTERVAL_S = 2.0  # fsync finished records at least this often, even between writer batches
TICK_S = 0.25  # how often paused workers and the supervisor look again
PROGRESS_LINE_INTERVAL_S = 10.0  # a plain progress line this often when stderr is not a terminal
RATE_WINDOW_S = 20.0

INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class EndpointSettings:
    """How `regenerate_endpoints` talks to the servers. The API key is not here: it comes from the environment."""

    model: str | None = None
    """Served model name; None asks each endpoint's `/models` and uses the first one it lists."""
    concurrency: int = 8
    """Requests in flight per endpoint (an endpoint given as `URL#N` uses N instead)."""
    max_tokens: int = 1024
    """Cap on generated tokens per assistant turn."""
    temperature: float | None = None
    """None keeps the target's own sampling defaults (the server's generation config)."""
    top_p: float | None = None
    """None keeps the target's own default."""
    reasoning: Literal["keep", "drop"] = "keep"
    """keep: store reasoning as `reasoning_content` of the assistant message; drop: store the answer only."""
    max_retries: int = 5
    """Retries per prompt after its first failed attempt."""
    backoff_s: float = 1.0
    """First retry delay; doubles per retry, with jitter, up to `backoff_max_s`."""
    backoff_max_s: float = 60.0
    """Cap on one retry delay and on an honoured `Retry-After`."""
    request_timeout_s: float = 600.0
    """Wall time allowed for one chat completion."""
    error_budget: float = 0.05
    """Fraction of this run's prompts that may fail for good before the run stops."""
    max_down_s: float = 1800.0
    """Stop when every endpoint has been down this long (a large model can take ~25 min to reload)."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Extra request fields, e.g. {"chat_template_kwargs": {"enable_thinking": True}} or {"ignore_eos": True}."""
    progress: bool = True
    """Show live progress on stderr (a table on a terminal, a line every 10 s otherwise)."""

    def __post_init__(self) -> None:
        problems = []
        if self.concurrency < 1:
            problems.append(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_retries < 0:
            problems.append(f"--max-retries must be >= 0, got {self.max_retries}")
        if not 0 <= self.error_budget <= 1:
            problems.append(f"--error-budget is a fraction in [0, 1], got {self.error_budget}")
        if self.request_timeout_s <= 0:
            problems.append(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if self.reasoning not in ("keep", "drop"):
            problems.append(f"--reasoning must be keep or drop, got {self.reasoning!r}")
        if problems:
            raise DraftsmithError("bad endpoint settings", got="; ".join(problems),
                                  expected="the ranges named above", fix="fix those flags")


# ---------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class FailedPrompt:
    id: str
    reason: str
    attempts: int


@dataclass(frozen=True)
class EndpointReport:
    url: str
    model: str | None
    state: str
    done: int
    """Chat completions answered."""
    errors: dict[str, int]
    """Failed requests by kind (refused, reset, timeout, http 429, ...)."""
    last_error: str


@dataclass(frozen=True)
class RegenerateSummary:
    """What a regeneration run did. `ok` only when every prompt is in the output."""

    done: int
    """Conversations written by this run."""
    skipped: int
    """Prompts already in the output (finished by an earlier run)."""
    output_tokens: int
    seconds: float
    failed: list[FailedPrompt] = field(default_factory=list)
    retried: int = 0
    """Retry attempts made (a prompt retried twice counts 2)."""
    pending: int = 0
    """Prompts neither written nor failed: the run stopped early (see `aborted`); a rerun does them."""
    aborted: str | None = None
    requests: int = 0
    endpoints: list[EndpointReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.pending and self.aborted is None

    def to_dict(self) -> dict[str, Any]:
        return redact({**asdict(self), "ok": self.ok})

    def render(self) -> str:
        rate = self.output_tokens / max(self.seconds, 1e-9)
        lines = [f"regenerate: {self.done} done, {self.skipped} already done, {len(self.failed)} failed, "
                 f"{self.retried} retries, {self.pending} pending | {self.requests} requests, "
                 f"{self.output_tokens:,} output tokens in {self.seconds:.1f} s ({rate:,.1f} tok/s)"]
        if self.aborted:
            lines.append(f"  stopped early: {self.aborted}; rerun the same command to finish")
        for ep in self.endpoints:
            errors = ", ".join(f"{k} {v}" for k, v in sorted(ep.errors.items())) or "no errors"
            lines.append(f"  {ep.url}: {ep.state}, {ep.done} answered, {errors}")
        for f in self.failed:
            lines.append(f"  failed {f.id} after {f.attempts} attempt(s): {f.reason}")
        return redact("\n".join(lines))


# ---------------------------------------------------------------------------------------------------
# Pure pieces: reasoning, turns, sampling


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None
    source: str
    """Where the reasoning came from: reasoning_content | reasoning | inline | none."""


def parse_reply(message: dict[str, Any]) -> Reply:
    """Split an assistant message into answer and reasoning, naming where the reasoning was found.

    Servers with a reasoning parser put it in a field (`reasoning_content`; newer vLLM: `reasoning`);
    without one it stays inline as `<think>...</think>`. A template that opens `<think>` itself leaves
    only the closing tag in the output; a reply cut by max_tokens may have no closing tag.
    """
    content = message.get("content") or ""
    for name in ("reasoning_content", "reasoning"):
        value = message.get(name)
        if isinstance(value, str) and value.strip():
            return Reply(content, value.strip(), name)
    match = INLINE_THINK.match(content)
    if match:
        return Reply(content[match.end():], match.group(1).strip(), "inline")
    if "</think>" in content and "<think>" not in content:
        thought, _, answer = content.partition("</think>")
        return Reply(answer.lstrip(), thought.strip(), "inline")
    if content.lstrip().startswith("<think>"):
        return Reply("", content.lstrip()[len("<think>"):].strip(), "inline")
    return Reply(content, None, "none")


def walk_turns(messages: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int | None]]:
    """The prompt's system / user messages, each user message with the number of the answer the target
    gives after it (others: None). Assistant turns in the source are dropped: they get regenerated."""
    walk: list[tuple[dict[str, Any], int | None]] = []
    turn = 0
    for msg in messages:
        if msg["role"] == "user":
            walk.append((msg, turn))
            turn += 1
        elif msg["role"] != "assistant":
            walk.append((msg, None))
    return walk


def sampling_args(settings: EndpointSettings) -> dict[str, float]:
    """Only the sampling parameters given; the rest stay at the target's defaults."""
    return {k: v for k, v in (("temperature", settings.temperature), ("top_p", settings.top_p)) if v is not None}


# ---------------------------------------------------------------------------------------------------
# Run state


@dataclass
class _Item:
    prompt: Prompt
    attempts: int = 0
    replies: list[Reply] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Endpoint:
    url: str
    concurrency: int
    client: openai.AsyncOpenAI
    model: str | None = None
    up: bool = True
    paused_until: float = 0.0
    connection_errors: int = 0  # in a row
    in_flight: int = 0
    done: int = 0
    errors: Counter = field(default_factory=Counter)
    last_error: str = ""
    prober: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return redact(self.url)

    def usable(self, now: float) -> bool:
        return self.up and now >= self.paused_until

    def state(self, now: float) -> str:
        if not self.up:
            return "down"
        return f"paused {self.paused_until - now:.0f}s" if now < self.paused_until else "up"

    def report(self) -> EndpointReport:
        return EndpointReport(self.name, self.model, self.state(time.monotonic()), self.done, dict(self.errors),
                              self.last_error)


class _WorkQueue:
    """Prompts waiting for an endpoint, each with the earliest time it may be tried (its backoff)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Item]] = []
        self._seq = 0
        self._changed = asyncio.Event()
        self.closed = False

    def put(self, item: _Item, delay_s: float = 0.0) -> None:
        heapq.heappush(self._heap, (time.monotonic() + delay_s, self._seq, item))
        self._seq += 1
        self._changed.set()

    async def get(self) -> _Item | None:
        """The next ready item, or None once the queue is closed."""
        while not self.closed:
            now = time.monotonic()
            if self._heap and self._heap[0][0] <= now:
                return heapq.heappop(self._heap)[2]
            timeout = self._heap[0][0] - now if self._heap else None
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
        return None

    def close(self) -> None:
        self.closed = True
        self._changed.set()


class _Run:
    def __init__(self, todo: list[Prompt], endpoints: list[_Endpoint], writer: ConversationWriter,
                 settings: EndpointSettings, skipped: int):
        self.settings, self.writer, self.endpoints, self.skipped = settings, writer, endpoints, skipped
        self.queue = _WorkQueue()
        for prompt in todo:
            self.queue.put(_Item(prompt))
        self.total = len(todo)
        self.remaining = len(todo)
        self.budget = int(settings.error_budget * len(todo))
        self.rng = random.Random()
        self.failed: list[FailedPrompt] = []
        self.done = self.retried = self.requests = self.output_tokens = 0
        self.aborted: str | None = None
        self.crash: Exception | None = None
        self.all_down_since: float | None = None
        self.start = time.monotonic()
        self.samples: deque[tuple[float, int, int]] = deque([(self.start, 0, 0)])

    # -- requests ----------------------------------------------------------------------------------

    async def converse(self, ep: _Endpoint, item: _Item) -> None:
        """Answer the prompt's remaining turns on `ep`, appending to `item.replies` turn by turn."""
        s = self.settings
        history: list[dict[str, Any]] = []
        for msg, turn in walk_turns(item.prompt.messages):
            history.append(dict(msg))
            if turn is None:
                continue
            if turn < len(item.replies):  # answered before a retry: feed the same answer again
                history.append({"role": "assistant", "content": item.replies[turn].content})
                continue
            resp = await ep.client.chat.completions.create(
                model=ep.model, messages=history, max_tokens=s.max_tokens, timeout=s.request_timeout_s,
                extra_body=s.extra_body or None, **sampling_args(s))
            self.requests += 1
            ep.done += 1
            ep.connection_errors = 0
            if not resp.choices or resp.choices[0].message is None:
                raise BadReply(f"no choices in the response from {ep.name}")
            reply = parse_reply(resp.choices[0].message.model_dump())
            tokens = resp.usage.completion_tokens if resp.usage else 0
            self.output_tokens += tokens
            item.replies.append(reply)
            item.turns.append({"endpoint": ep.name, "model": ep.model, "finish_reason": resp.choices[0].finish_reason,
                               "reasoning_source": reply.source, "completion_tokens": tokens})
            history.append({"role": "assistant", "content": reply.content})

    def conversation(self, item: _Item) -> Conversation:
        """The finished conversation: the prompt's own turns with the target's answers in place."""
        messages: list[dict[str, Any]] = []
        for msg, turn in walk_turns(item.prompt.messages):
            messages.append(dict(msg))
            if turn is not None:
                reply = item.replies[turn]
                answer: dict[str, Any] = {"role": "assistant", "content": reply.content}
                if reply.reasoning is not None and self.settings.reasoning == "keep":
                    answer["reasoning_content"] = reply.reasoning
                messages.append(answer)
        sources = sorted({r.source for r in item.replies} - {"none"})
        meta = {"backend": "endpoint", "model": item.turns[-1]["model"], "reasoning": self.settings.reasoning,
                "reasoning_source": ",".join(sources) or "none", "sampling": sampling_args(self.settings),
                "attempts": item.attempts + 1, "turns": item.turns}
        return Conversation(item.prompt.id, messages, meta)

    # -- outcomes ----------------------------------------------------------------------------------

    def on_success(self, item: _Item) -> None:
        self.writer.write(self.conversation(item))
        self.done += 1
        self.finish_one()

    def on_failure(self, ep: _Endpoint, item: _Item, failure: Failure) -> None:
        now = time.monotonic()
        ep.errors[failure.kind] += 1
        ep.last_error = failure.reason
        if failure.connection:
            ep.connection_errors += 1
            if ep.connection_errors >= DOWN_AFTER_CONNECTION_ERRORS and ep.up:
                self.mark_down(ep)
        if failure.retry_after_s is not None:
            ep.paused_until = max(ep.paused_until, now + min(failure.retry_after_s, self.settings.backoff_max_s))
        item.attempts += 1
        if failure.retryable and item.attempts <= self.settings.max_retries:
            self.retried += 1
            self.queue.put(item, backoff_delay(item.attempts, self.settings.backoff_s, self.settings.backoff_max_s,
                                               self.rng))
            return
        self.failed.append(FailedPrompt(item.prompt.id, failure.reason, item.attempts))
        self.finish_one()
        if len(self.failed) > self.budget:
            self.abort(f"error budget exhausted: {len(self.failed)} of {self.total} prompts failed "
                       f"(--error-budget {self.settings.error_budget} allows {self.budget}); "
                       f"last: {failure.reason}")

    def finish_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.queue.close()

    def abort(self, reason: str) -> None:
        if self.aborted is None:
            self.aborted = reason
        self.queue.close()

    # -- endpoints ---------------------------------------------------------------------------------

    def mark_down(self, ep: _Endpoint) -> None:
        ep.up = False
        if ep.prober is None or ep.prober.done():
            ep.prober = asyncio.create_task(self.probe_until_up(ep))

    async def probe_until_up(self, ep: _Endpoint) -> None:
        delay = PROBE_FIRST_DELAY_S
        while not self.queue.closed:
            await asyncio.sleep(delay)
            error = await probe(ep, self.settings.model)
            if error is None:
                ep.up, ep.connection_errors = True, 0
                return
            ep.last_error = error
            delay = min(delay * 2, self.settings.backoff_max_s)

    async def worker(self, ep: _Endpoint) -> None:
        try:
            while not self.queue.closed:
                if not ep.usable(time.monotonic()):
                    await asyncio.sleep(TICK_S)
                    continue
                item = await self.queue.get()
                if item is None:
                    return
                if not ep.usable(time.monotonic()):  # went down or paused while this worker waited
                    self.queue.put(item)
                    continue
                ep.in_flight += 1
                try:
                    await self.converse(ep, item)
                except Exception as exc:  # classify raises again what is not a failed request (a bug)
                    self.on_failure(ep, item, classify(exc))
                else:
                    self.on_success(item)
                finally:
                    ep.in_flight -= 1
        except Exception as exc:  # a bug: stop the run loudly rather than hang the other workers
            self.crash = exc
            self.abort(f"internal error: {type(exc).__name__}: {exc}")

    async def supervise(self, show: LiveStatus | None) -> None:
        """Fsync finished records, refresh progress, stop when every endpoint has been down too long."""
        last_sync = time.monotonic()
        while not self.queue.closed:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            if now - last_sync >= SYNC_INTERVAL_S:
                self.writer.sync()
                last_sync = now
            if any(ep.up for ep in self.endpoints):
                self.all_down_since = None
            elif self.all_down_since is None:
                self.all_down_since = now
            elif now - self.all_down_since > self.settings.max_down_s:
                self.abort(f"every endpoint down for more than {self.settings.max_down_s:.0f} s "
                           f"(last error: {self.endpoints[0].last_error})")
            self.samples.append((now, self.requests, self.output_tokens))
            while now - self.samples[0][0] > RATE_WINDOW_S and len(self.samples) > 2:
                self.samples.popleft()
            if show:
                show.update(self)

    def rates(self) -> tuple[float, float]:
        """Requests/s and output tokens/s over the last RATE_WINDOW_S."""
        (t0, r0, k0), (t1, r1, k1) = self.samples[0], self.samples[-1]
        dt = max(t1 - t0, 1e-9)
        return (r1 - r0) / dt, (k1 - k0) / dt

    def summary(self) -> RegenerateSummary:
        return RegenerateSummary(self.done, self.skipped, self.output_tokens, time.monotonic() - self.start,
                                 list(self.failed), self.retried, self.remaining, self.aborted, self.requests,
                                 [ep.report() for ep in self.endpoints])


async def probe(ep: _Endpoint, model: str | None) -> str | None:
    """Ask `/models`; on success set `ep.model` and return None, else return the error."""
    try:
        ep.model = await served_model(ep.client, model, PROBE_TIMEOUT_S)
    except NoServedModel as exc:
        return exc.got
    return None


# ---------------------------------------------------------------------------------------------------
# Live progress


class LiveStatus:
    """Live progress on stderr: a rich table on a terminal, one greppable line every 10 s otherwise."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=2, transient=False) \
            if self.console.is_terminal else None
        self.last_line = 0.0

    def __enter__(self) -> LiveStatus:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.__exit__(None, None, None)

    def update(self, run: _Run) -> None:
        if self.live:
            self.live.update(self.table(run))
        elif time.monotonic() - self.last_line >= PROGRESS_LINE_INTERVAL_S:
            self.last_line = time.monotonic()
            print(self.line(run), file=sys.stderr, flush=True)

    @staticmethod
    def line(run: _Run) -> str:
        rps, tps = run.rates()
        now = time.monotonic()
        health = " | ".join(f"{ep.name} {ep.state(now)} {ep.in_flight}/{ep.concurrency}" for ep in run.endpoints)
        return (f"regenerate {run.done + len(run.failed):05d}/{run.total:05d} | done {run.done} | "
                f"failed {len(run.failed)} | retried {run.retried} | {rps:.2f} req/s | {tps:,.0f} tok/s | {health}")

    @staticmethod
    def table(run: _Run) -> Table:
        rps, tps = run.rates()
        now = time.monotonic()
        table = Table(title=f"regenerate {run.done + len(run.failed)}/{run.total}: done {run.done}, failed "
                            f"{len(run.failed)}, retried {run.retried} | {rps:.2f} req/s | {tps:,.0f} out tok/s",
                      title_justify="left")
        for col in ("endpoint", "state", "in flight", "answered", "errors", "last error"):
            table.add_column(col)
        for ep in run.endpoints:
            errors = ", ".join(f"{k} {v}" for k, v in sorted(ep.errors.items()))
            table.add_row(ep.name, ep.state(now), f"{ep.in_flight}/{ep.concurrency}", str(ep.done), errors,
                          redact(ep.last_error)[:60])
        return table


# ---------------------------------------------------------------------------------------------------
# Entry points


def check_prompts(prompts: list[Prompt]) -> None:
    """Every id once, every prompt with a user turn and only system / user / assistant roles."""
    seen: set[str] = set()
    dupes = [p.id for p in prompts if p.id in seen or seen.add(p.id)]
    bad = [p.id for p in prompts if not any(m.get("role") == "user" for m in p.messages)
           or any(m.get("role") not in ("system", "user", "assistant") for m in p.messages)]
    problems = ([f"duplicate ids {dupes[:5]}"] if dupes else []) + \
               ([f"no user turn or an unsupported role in {bad[:5]}"] if bad else [])
    if problems:
        raise DraftsmithError("prompts cannot be regenerated", got="; ".join(problems),
                              expected="unique ids; system / user turns (assistant turns are regenerated)",
                              fix="fix the prompt file")


async def regenerate_endpoints(prompts: list[Prompt], endpoints: list[str], writer: ConversationWriter,
                               settings: EndpointSettings) -> RegenerateSummary:
    """Answer every prompt not yet in `writer` on the given endpoints; append each conversation once.

    Args:
        prompts: system / user turns per id; assistant turns, if any, are regenerated.
        endpoints: base URLs (`http://host:8000/v1`, `/v1` added when no path), optionally `URL#concurrency`.
        writer: the output; ids it already holds are skipped.
        settings: sampling, concurrency, retry and budget settings.

    Returns:
        What was done, failed (with reasons), retried and left pending.

    Raises:
        DraftsmithError: bad prompts or endpoints, or no endpoint answering `/models` at the start.
    """
    check_prompts(prompts)
    if not endpoints:
        raise DraftsmithError("no endpoint given", expected="at least one --endpoint URL",
                              fix="e.g. --endpoint http://127.0.0.1:8000/v1")
    todo = [p for p in prompts if p.id not in writer.done]
    eps = []
    for spec in endpoints:
        url, conc = parse_endpoint(spec, settings.concurrency)
        eps.append(_Endpoint(url, conc, open_client(url, timeout=settings.request_timeout_s)))
    run = _Run(todo, eps, writer, settings, len(prompts) - len(todo))
    try:
        errors = await asyncio.gather(*(probe(ep, settings.model) for ep in eps))
        if all(errors):
            raise DraftsmithError("no endpoint answers", got="; ".join(f"{ep.name}: {e}" for ep, e in zip(eps, errors)),
                                  expected="at least one OpenAI-compatible server answering GET /models",
                                  fix="start the server(s), check the URLs (they end in /v1) and the model name")
        for ep, error in zip(eps, errors):
            if error:
                ep.last_error = error
                run.mark_down(ep)
        if todo:
            await run_workers(run)
    finally:
        for ep in eps:
            if ep.prober:
                ep.prober.cancel()
            await ep.client.close()
        writer.sync()
    if run.crash:
        raise run.crash
    return run.summary()


async def run_workers(run: _Run) -> None:
    with LiveStatus() if run.settings.progress else contextlib.nullcontext() as show:
        tasks = [asyncio.create_task(run.supervise(show))]
        tasks += [asyncio.create_task(run.worker(ep)) for ep in run.endpoints for _ in range(ep.concurrency)]
        try:
            while not run.queue.closed:
                await asyncio.sleep(TICK_S)
        finally:
            # Finished, stopped or interrupted: requests still in flight are abandoned; their prompts
            # were not written, so a rerun does them.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if show:
            show.update(run)


def regenerate_endpoints_sync(prompts: list[Prompt], endpoints: list[str], writer: ConversationWriter,
                              settings: EndpointSettings) -> RegenerateSummary:
    """`regenerate_endpoints` for callers without an event loop."""
    return asyncio.run(regenerate_endpoints(prompts, endpoints, writer, settings))


# ---------------------------------------------------------------- raw-prefix completions (self-written prompts)

@dataclass
class EndpointCompleter:
    """Continues raw text prefixes through OpenAI-compatible completions endpoints (`/v1/completions`).

    The prefix is sent as text, so what the model continues is the target's chat template rendered here, up to
    the start of a user turn (self-written prompts) or of an answer: no chat API adds its own turn structure.
    Requests go round-robin over the endpoints, `concurrency` in flight per endpoint; each carries a seed
    derived from `seed`, the call and its index, so a rerun samples the same turns where the server honours
    seeds (vLLM, llama.cpp). Retryable failures (refused, reset, timeout, 429 / 5xx) are retried with backoff.
    """

    endpoints: list[str]
    model: str | None = None
    concurrency: int = 8
    stop: tuple[str, ...] = ()
    seed: int = 0
    max_retries: int = 4
    request_timeout_s: float = 600.0
    calls: int = 0

    def __call__(self, prefixes: list[str], max_tokens: int, temperature: float, top_p: float,
                 label: str) -> list:
        self.calls += 1
        return asyncio.run(self._complete_all(prefixes, max_tokens, temperature, top_p, label))

    async def _complete_all(self, prefixes: list[str], max_tokens: int, temperature: float, top_p: float,
                            label: str) -> list:
        from draftsmith.progress import progress_bar
        from draftsmith.regenerate.selfprompt import Continuation

        urls = [with_path(normalize_base(parse_endpoint(u, self.concurrency)[0]), "/v1") for u in self.endpoints]  # either form
        clients = [open_client(u, timeout=self.request_timeout_s) for u in urls]
        model = self.model or await served_model(clients[0])
        gate = asyncio.Semaphore(self.concurrency * len(clients))
        rng = random.Random(self.seed)
        done = [0, 0]

        async def one(i: int, prefix: str, bar) -> Continuation:
            client = clients[i % len(clients)]
            seed = (self.seed * 1_000_003 + self.calls * 100_003 + i) % 2**31
            async with gate:
                try:
                    r = await with_retries(lambda: client.completions.create(
                        model=model, prompt=prefix, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                        stop=list(self.stop) or None, seed=seed), self.max_retries, rng)
                except RequestFailed as exc:
                    raise DraftsmithError(f"a completion request to {redact(str(client.base_url))} failed",
                                          got=str(exc), expected="a completion",
                                          fix="check the server (its log, --model) and rerun") from exc
            choice = r.choices[0]
            tokens = r.usage.completion_tokens if r.usage else 0
            done[0] += 1
            done[1] += tokens
            bar.advance(1, tokens=done[1])
            return Continuation(choice.text, choice.finish_reason == "stop", tokens)

        try:
            with progress_bar(label, total=len(prefixes), unit="turns") as bar:
                return list(await asyncio.gather(*(one(i, p, bar) for i, p in enumerate(prefixes))))
        finally:
            for c in clients:
                await c.close()
