"""Speculative-decoding acceptance from what each engine exposes, normalised to one definition.

Pure parsers, no I/O: `bench` fetches the text and hands it here.

One definition for every engine and version (the one vLLM's own docs and llama.cpp use):

    tau              = 1 + accepted / drafts        mean tokens per target forward, bonus token included
    acceptance_rate  = accepted / draft_tokens      share of proposed tokens the target kept
    per_position[i]  = accepted_at_pos[i] / drafts  share of drafts whose token i was kept

Sources, best first (docs/engines.md §5):
- vLLM `/metrics` counters `vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total` and
  `..._num_accepted_tokens_per_pos_total{position}`; llama.cpp's `--metrics` exposes the same counters
  under `llamacpp:`. Counters are cumulative since start-up, so a window is the difference of two scrapes.
- SGLang gauge `sglang:spec_accept_length` (tau of the most recent logging interval, not of a window).
- SGLang `/server_info` `internal_states[i].avg_spec_accept_length` (tau since start-up).
- SGLang's scheduler line `Decode batch, ..., accept len: X, ...` (tau of one logging interval).
SGLang gives tau only; acceptance_rate follows as (tau - 1) / k when the number of drafted tokens per
step k is known, and SGLang's own `accept rate` is ignored because its definition changed in 0.5.14.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

Source = Literal["vllm", "llamacpp", "sglang-gauge", "sglang-server-info", "sglang-log"]
COUNTER_PREFIXES = ("vllm:", "llamacpp:")
# Scheduler decode line, every SGLang release checked (0.4.6 - 0.5.23): "Decode batch." before about
# 0.5.4, "Decode batch," after; fields between vary (#token / #full token, mamba usage, npu graph).
SGLANG_DECODE_RE = re.compile(
    r"Decode batch[.,]\s+#running-req: (?P<running>\d+),.*?accept len: (?P<accept_len>[0-9.]+)"
    r"(?:, accept rate: (?P<accept_rate>[0-9.]+))?.*?gen throughput \(token/s\): (?P<gen_tps>[0-9.]+)"
)


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative spec-decode counters of one vLLM or llama.cpp server, summed over engines."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: tuple[float, ...]

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The counts accumulated between the `before` scrape and this one."""
        if self.drafts < before.drafts or self.accepted < before.accepted:
            raise ValueError("spec-decode counters went down between scrapes: the server restarted")
        pos = tuple(a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0.0)
                    for i, a in enumerate(self.accepted_per_pos))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, pos)


@dataclass(frozen=True)
class Acceptance:
    """Acceptance over one measurement, in the definitions of the module docstring."""

    source: Source
    tau: float | None
    acceptance_rate: float | None
    per_position: tuple[float, ...]
    drafts: int | None = None
    draft_tokens: int | None = None
    accepted: int | None = None
    windowed: bool = True
    """True when the numbers cover only the measured window (differenced counters)."""

    @property
    def num_speculative_tokens(self) -> int | None:
        """k, the tokens drafted per step, when the counters reveal it."""
        if self.per_position:
            return len(self.per_position)
        if self.drafts and self.draft_tokens:
            return round(self.draft_tokens / self.drafts)
        return None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "per_position": list(self.per_position)}


def parse_spec_counters(text: str) -> tuple[Source, SpecCounters] | None:
    """vLLM or llama.cpp spec-decode counters from a Prometheus text page; None when absent.

    Series with several label sets (one per engine or model) are summed.
    """
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the `_created` timestamps that prometheus_client adds to counters
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.name.endswith("spec_decode_num_accepted_tokens_per_pos_total"):
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    for prefix in COUNTER_PREFIXES:
        drafts = totals.get(f"{prefix}spec_decode_num_drafts_total")
        if drafts is None:
            continue
        counters = SpecCounters(
            drafts=drafts,
            draft_tokens=totals.get(f"{prefix}spec_decode_num_draft_tokens_total", 0.0),
            accepted=totals.get(f"{prefix}spec_decode_num_accepted_tokens_total", 0.0),
            accepted_per_pos=tuple(per_pos[i] for i in sorted(per_pos)),
        )
        return prefix.rstrip(":"), counters
    return None


def acceptance_from_counters(counters: SpecCounters, source: Source, windowed: bool = True) -> Acceptance:
    """tau, acceptance rate and per-position acceptance from (differenced) counters."""
    d, n, a = counters.drafts, counters.draft_tokens, counters.accepted
    return Acceptance(
        source=source,
        tau=1.0 + a / d if d else None,
        acceptance_rate=a / n if n else None,
        per_position=tuple(p / d for p in counters.accepted_per_pos) if d else (),
        drafts=int(d), draft_tokens=int(n), accepted=int(a), windowed=windowed,
    )


def acceptance_from_tau(tau: float | None, source: Source, k: int | None, windowed: bool) -> Acceptance:
    """SGLang reports tau only; acceptance_rate = (tau - 1) / k needs k, the drafted tokens per step."""
    rate = (tau - 1.0) / k if tau is not None and k else None
    return Acceptance(source=source, tau=tau, acceptance_rate=rate, per_position=(), windowed=windowed)


def parse_sglang_gauge(text: str, k: int | None = None) -> Acceptance | None:
    """`sglang:spec_accept_length` (mean over ranks) from a Prometheus page; None when absent.

    SGLang sets the gauge each logging interval (`multiprocess_mode="mostrecent"`), so it describes the
    last interval before the scrape, not the whole window.
    """
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == "sglang:spec_accept_length"]
    if not values:
        return None
    return acceptance_from_tau(sum(values) / len(values), "sglang-gauge", k, windowed=False)


def sglang_k(server_info: dict[str, Any]) -> int | None:
    """Drafted tokens verified per step from SGLang's server args (num_draft_tokens counts the root)."""
    n = server_info.get("speculative_num_draft_tokens")
    return int(n) - 1 if isinstance(n, (int, float)) and n > 1 else None


def parse_sglang_server_info(info: dict[str, Any], k: int | None = None) -> Acceptance | None:
    """tau since start-up from SGLang `/server_info` (`internal_states[i].avg_spec_accept_length`)."""
    states = info.get("internal_states") or []
    values = [float(s["avg_spec_accept_length"]) for s in states
              if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    if not values:
        return None
    return acceptance_from_tau(sum(values) / len(values), "sglang-server-info", k or sglang_k(info),
                               windowed=False)


@dataclass(frozen=True)
class SglangDecodeLine:
    running_requests: int
    accept_len: float
    accept_rate: float | None
    gen_throughput: float


def parse_sglang_decode_line(line: str) -> SglangDecodeLine | None:
    """One SGLang `Decode batch` log line with speculation on; None for any other line."""
    m = SGLANG_DECODE_RE.search(line)
    if not m:
        return None
    rate = m.group("accept_rate")
    return SglangDecodeLine(int(m.group("running")), float(m.group("accept_len")),
                            float(rate) if rate is not None else None, float(m.group("gen_tps")))


def acceptance_from_sglang_log(lines: list[str], k: int | None = None) -> Acceptance | None:
    """tau over the decode lines of a log slice, each interval weighted by its generation throughput.

    Throughput is tokens per second of one interval, and SGLang logs every `--decode-log-interval`
    forwards, so weighting by it approximates weighting by the tokens each interval produced.
    """
    parsed = [p for p in map(parse_sglang_decode_line, lines) if p is not None]
    weight = sum(p.gen_throughput for p in parsed)
    if not parsed:
        return None
    if weight > 0:
        tau = sum(p.accept_len * p.gen_throughput for p in parsed) / weight
    else:
        tau = sum(p.accept_len for p in parsed) / len(parsed)
    return acceptance_from_tau(tau, "sglang-log", k, windowed=True)
