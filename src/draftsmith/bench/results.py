"""What a bench measurement gives: one request, one load level on one endpoint, one endpoint over all its levels.

benchmark.py fills these records, verdict.py reads them, and bench's JSON is written from them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from draftsmith.bench.metrics import Acceptance


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    chunk_gaps_s: tuple[float, ...] = ()
    error: str = ""


@dataclass
class LevelResult:
    """One load level on one endpoint."""

    concurrency: int | None
    request_rate: float | None
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    latency_ms: dict[str, float | None]
    """Flat percentiles: `ttft_ms_p50`, `itl_ms_p99`, `tpot_ms_p50`, `e2e_ms_p90`, ..."""
    acceptance: Acceptance | None
    first_error: str = ""
    speedup: float | None = None
    baseline_output_tokens_per_s: float | None = None
    rounds_tokens_per_s: tuple[float, ...] = ()
    """Output tokens/s of each round of the level (BenchSettings.rounds): how much the machine moved."""

    def key(self) -> tuple[str, float]:
        return ("rate", self.request_rate) if self.request_rate is not None else ("concurrency", self.concurrency)

    def label(self) -> str:
        return f"{self.request_rate:g} req/s" if self.request_rate is not None else f"c={self.concurrency}"

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("latency_ms", "acceptance")}
        out.update(self.latency_ms)
        acc = self.acceptance
        out["rounds_tokens_per_s"] = list(self.rounds_tokens_per_s)
        out["tau"] = acc.tau if acc else None
        out["acceptance_rate"] = acc.acceptance_rate if acc else None
        out["acceptance"] = acc.to_dict() if acc else None
        return out


@dataclass
class EndpointResult:
    endpoint: str
    model: str
    levels: list[LevelResult]
    acceptance: Acceptance | None
    """Over all measured levels together (warm-up excluded)."""
