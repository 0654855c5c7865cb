"""How bench's report reads: rich tables on the terminal, the throughput and acceptance plots, and `fmt`, the
number formatting of those tables and of the run report.

print_report and write_plots read bench's JSON document (benchmark.build_report), so `run` renders the report of
each k of its sweep with them too; print_report shows it through `client.redact`, so an endpoint's credentials
never reach the terminal.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from draftsmith.client import redact


def fmt(x: Any, spec: str = ".2f") -> str:
    """`-` for a missing value, the items of a list or tuple one by one, a float in `spec`, anything else as is."""
    if x is None:
        return "-"
    if isinstance(x, (list, tuple)):
        return " ".join(fmt(v, spec) for v in x)
    return format(x, spec) if isinstance(x, float) else str(x)


def print_report(report: dict[str, Any], console=None) -> None:
    """Rich tables: acceptance, per-level throughput and latency, then the verdict."""
    from rich.console import Console
    from rich.table import Table

    # a pipe or a CI log is not 80 columns wide: give the tables room when not on a terminal
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    report = redact(report)
    acc = report["acceptance"]
    t = Table(title=f"acceptance  {report['endpoint']}  ({acc['source'] if acc else 'no data'})")
    for col in ("tau", "acceptance rate", "per position", "drafts", "window"):
        t.add_column(col, justify="right")
    if acc:
        t.add_row(fmt(acc["tau"], ".3f"), fmt(acc["acceptance_rate"], ".3f"),
                  " ".join(f"{p:.3f}" for p in acc["per_position"]) or "-",
                  str(acc["drafts"]) if acc["drafts"] is not None else "-",
                  "measured" if acc["windowed"] else "server-side, not windowed")
    console.print(t)
    t = Table(title=f"load  {report['model']}  max_tokens {report['settings']['max_tokens']}  "
                    f"temperature {report['settings']['temperature']}  {report['settings']['num_prompts']} "
                    f"requests/level from {report['settings']['prompts']!r}")
    cols = ("level", "tok/s", "base tok/s", "speed-up", "tau", "TTFT p50/p99 ms", "ITL p50 ms",
            "TPOT p50 ms", "e2e p50 ms", "failed")
    for col in cols:
        t.add_column(col, justify="right")
    for lv in report["levels"]:
        label = f"c={lv['concurrency']}" if lv["concurrency"] is not None else f"{lv['request_rate']:g} req/s"
        t.add_row(label, fmt(lv["output_tokens_per_s"], ".1f"), fmt(lv["baseline_output_tokens_per_s"], ".1f"),
                  fmt(lv["speedup"], ".2f"), fmt(lv["tau"], ".2f"),
                  f"{fmt(lv['ttft_ms_p50'], '.0f')}/{fmt(lv['ttft_ms_p99'], '.0f')}", fmt(lv["itl_ms_p50"], ".1f"),
                  fmt(lv["tpot_ms_p50"], ".1f"), fmt(lv["e2e_ms_p50"], ".0f"), str(lv["failed"]))
    console.print(t)
    v = report["verdict"]
    color = {"go": "green", "no-go": "red"}.get(v["decision"], "yellow")
    console.print(f"[bold {color}]verdict: {v['decision']}[/]")
    for r in v["reasons"]:
        console.print(f"  - {r}")
    for step in v["next_steps"]:
        console.print(f"  next: {step}")


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """throughput.png (tokens/s per level, with and without speculation) and acceptance.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    levels = report["levels"]
    by_rate = any(lv["concurrency"] is None for lv in levels)
    xs = [lv["request_rate"] if by_rate else lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(xs, [lv["output_tokens_per_s"] for lv in levels], "o-", label="with speculation")
    base = [(x, lv["baseline_output_tokens_per_s"]) for x, lv in zip(xs, levels) if lv["baseline_output_tokens_per_s"]]
    if base:
        ax.plot(*zip(*base), "s--", label="without (baseline)")
    ax.set(xlabel="request rate (req/s)" if by_rate else "concurrency", ylabel="output tokens/s",
           title=f"{report['model']}")
    if not by_rate and len(set(xs)) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    paths = [out / "throughput.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    per_pos = report["per_position"]
    if per_pos:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        bars = ax.bar(range(len(per_pos)), per_pos)
        ax.bar_label(bars, fmt="%.3f")
        ax.set_xticks(range(len(per_pos)))
        ax.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1),
               title=f"tau {report['tau']:.2f}, acceptance rate {report['acceptance_rate']:.2f}")
        fig.tight_layout()
        paths.append(out / "acceptance.png")
        fig.savefig(paths[1], dpi=120)
        plt.close(fig)
    return paths
