"""What one speculative cycle costs in llama.cpp's `llama-server` on this CPU, piece by piece, and the speed-up
bound that follows (batch 1, greedy, SmolLM2-135M target with the shipped EAGLE-3 drafter).

A cycle at draft length k is: k drafter steps (llama.cpp's `draft()`: a seed step, then one step per further
token, each with its top-10 sampling), one target forward over the k+1 tokens (verification), and the rest:
llama.cpp runs the drafter's fc and layer again over the whole verified batch (`process()`, also over rejected
rows: common/speculative.cpp, the comment above `common_speculative_impl_draft_eagle3`), logits for k+1 rows
instead of 1, sampling and acceptance of k+1 tokens. Against plain decoding at T_plain per token,

    speedup(k) = tau(k) * T_plain / (T_verify(k+1) + k * T_draft + overhead)

All servers (one plain, one per k) run at once and are measured in turns, each round in another order, so drift
of the shared machine reaches all alike. What is measured, at a context of about --context tokens:

- T_plain: a plain server's generation, `timings.predicted_ms / (predicted_n - 1)`;
- T_verify(n), n = 1..8: a prompt extension by n new tokens after a cached context (`cache_prompt`,
  `timings.prompt_ms` with `prompt_n == n`) on the plain server: the target's forward over n tokens (logits for
  the last row only, so the k extra logit rows of a verification land in the overhead);
- the same extension on each speculative server: minus T_verify(n), what llama.cpp's `process()` adds;
- T_cycle(k): a speculative server's generation (`ignore_eos`), `predicted_ms / target forwards`;
- T_draft: the drafter's own time, from llama.cpp's statistics line (`-lv 4`: `dur(b,g,a)`, the g part summed
  over `draft()` calls), per call / k;
- tau(k) and the speed-up each server gets over the plain one, on --prompts chat-eval prompts (generation
  time per token from `timings`, prefill excluded; tau from the `/metrics` counters as `draftsmith bench`).

Each block of samples records how much CPU other processes took meanwhile and the machine's major page faults
(machine_load.py); a block where other processes passed --max-foreign cores is dropped and counted. The servers
map their weights as llama-server does by default (`-lm none`, reading them into memory instead, measured 7 %
slower per plain token at q8_0 on this CPU, 9.65 against 8.99 ms, interleaved).
Run under the shared lock, one outtype per run (3-5 minutes each):

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_step_costs.py --outtype f32
    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_step_costs.py --outtype q8_0

With `--p-min 0,0.5 --rounds 0 --chat-repeats N` it is an A/B of llama.cpp's draft cut-off: one server per
(k, p-min) beside the plain one, each chat prompt answered by all of them back to back, N times over; the
speed-up of a server is the plain server's generation ms per token over its own, summed over the prompts (and
per prompt, as a median), tau from its counters:

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_step_costs.py --outtype f32 --k 3,4 \
        --p-min 0,0.3,0.5 --rounds 0 --chat-repeats 3 --out benchmarks/results/llamacpp_p_min_ab.json

Writes (merges its outtype, and --server-args, into) benchmarks/results/llamacpp_step_costs.json or --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from draftsmith.engines import llamacpp
from machine_load import Meter, wait_quiet  # benchmarks/ is on sys.path when run as a script

OUT = Path(__file__).parent / "results" / "llamacpp_step_costs.json"
TRACE = ("-lv", "4")  # log verbosity 4 (trace) prints the statistics line after each request (speculative.cpp)
STATS_RE = re.compile(r"statistics\s+(?P<impl>[\w-]+): #calls\(b,g,a\) =\s*(?P<b>\d+)\s+(?P<g>\d+)\s+(?P<a>\d+),"
                      r".*#gen tokens =\s*(?P<gen>\d+), #acc tokens =\s*(?P<acc>\d+)"
                      r".*dur\(b,g,a\) = (?P<tb>[\d.]+), (?P<tg>[\d.]+), (?P<ta>[\d.]+) ms")


# ---------------------------------------------------------------- pure parts (tests/test_llamacpp_step_costs.py)

@dataclass(frozen=True)
class SpecStats:
    """One `statistics` line of llama.cpp's speculative decoding (common_speculative_print_stats), cumulative
    since the server started."""

    draft_calls: int
    draft_ms: float
    """Time inside `draft()`, summed over its calls."""
    gen_tokens: int
    acc_tokens: int

    def minus(self, before: SpecStats) -> SpecStats:
        return SpecStats(self.draft_calls - before.draft_calls, self.draft_ms - before.draft_ms,
                         self.gen_tokens - before.gen_tokens, self.acc_tokens - before.acc_tokens)


def parse_spec_stats(line: str) -> SpecStats | None:
    m = STATS_RE.search(line)
    if m is None:
        return None
    return SpecStats(draft_calls=int(m["g"]), draft_ms=float(m["tg"]), gen_tokens=int(m["gen"]),
                     acc_tokens=int(m["acc"]))


@dataclass(frozen=True)
class CycleCosts:
    """One speculative cycle at draft length k against one plain decoding step, in ms."""

    k: int
    plain_ms: float
    verify_ms: float
    """Target forward over k+1 tokens."""
    draft_step_ms: float
    overhead_ms: float
    """Everything else in a cycle."""

    @property
    def cycle_ms(self) -> float:
        return self.verify_ms + self.k * self.draft_step_ms + self.overhead_ms

    def speedup(self, tau: float) -> float:
        """tau tokens per cycle against one token per plain step."""
        return tau * self.plain_ms / self.cycle_ms

    def tau_needed(self, speedup: float) -> float:
        """The tau at which a cycle yields `speedup` (at most k+1 is reachable)."""
        return speedup * self.cycle_ms / self.plain_ms


def split_cycle(k: int, plain_ms: float, cycle_ms: float, verify_ms: float, draft_call_ms: float) -> CycleCosts:
    """A measured cycle split into its parts: the overhead is what verification and drafting leave of it."""
    return CycleCosts(k=k, plain_ms=plain_ms, verify_ms=verify_ms, draft_step_ms=draft_call_ms / k,
                      overhead_ms=cycle_ms - verify_ms - draft_call_ms)


# ---------------------------------------------------------------- measuring

def next_stats(log: Path, after: SpecStats | None, timeout_s: float = 5.0) -> SpecStats:
    """The newest statistics line once it counts more `draft()` calls than `after` (llama.cpp prints one per
    request, drafting or not, from an asynchronous logger thread)."""
    calls = after.draft_calls if after else -1
    deadline = time.monotonic() + timeout_s
    while True:
        found = [s for s in map(parse_spec_stats, log.read_text(errors="replace").splitlines()) if s]
        if found and found[-1].draft_calls > calls:
            return found[-1]
        if time.monotonic() > deadline:
            raise SystemExit(f"no new speculative statistics line in {log}: is the server at -lv 4?")
        time.sleep(0.02)


def metrics_text(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


@dataclass
class Server:
    name: str
    k: int | None
    p_min: float
    base: str
    log: Path
    stats: SpecStats | None = None
    """The last statistics line read."""
    blocks: int = 0
    dropped: int = 0
    major_faults: int = 0
    """Pages read back from disk machine-wide during this server's blocks."""
    build: str = ""
    """The --builds label of the llama-server binary it runs ("" without --builds); names start with `label/`."""

    @property
    def plain(self) -> str:
        """The name of the plain server of the same build, the one this server's speed-up is measured against."""
        return f"{self.build}/plain" if self.build else "plain"


def context_ids(tok, n: int) -> list[int]:
    """A chat prompt of exactly n tokens: chat-eval questions joined into one user turn, cut to length in the
    turn's text, the assistant header kept."""
    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.regenerate.prompts import load_prompts

    one = prompt_ids(tok, [{"role": "user", "content": "x"}])
    tail = one[one.index(tok.convert_tokens_to_ids("x")) + 1:]  # end of the user turn + assistant header
    lines: list[str] = []
    for p in load_prompts("chat-eval"):
        lines.append(p.messages[-1]["content"])
        ids = prompt_ids(tok, [{"role": "user", "content": "\n".join(lines)}])
        if len(ids) >= n:
            assert ids[-len(tail):] == tail, "the chat template ends a user turn differently than expected"
            return ids[:n - len(tail)] + tail
    raise SystemExit(f"chat-eval holds fewer than {n} tokens")


def measure_block(srv: Server, ctx: list[int], fresh, order: list[int], gen_tokens: int, samples: dict) -> None:
    """One server's turn: prompt extensions by n tokens (the order given), then one generation."""
    ext = {}
    for n in order:
        c = llamacpp.complete(srv.base, ctx + fresh(n), 1, cache_prompt=True)
        t = c.timings
        if t.prompt_n == n and t.cache_n == len(ctx):
            ext[n] = t.prompt_ms
    t = llamacpp.complete(srv.base, ctx + fresh(1), gen_tokens, cache_prompt=True, ignore_eos=True).timings
    row = {"ext": ext, "plain_ms" if srv.k is None else "cycle_ms": t.predicted_ms / t.target_steps}
    if srv.k is not None:
        after = next_stats(srv.log, srv.stats)
        window = after.minus(srv.stats)
        srv.stats = after
        row["draft_call_ms"] = window.draft_ms / window.draft_calls
    samples.setdefault(srv.name, []).append(row)


def chat_phase(servers: list[Server], prompts: list[list[int]], args) -> dict:
    """Each prompt on every server back to back (the order rotating), --chat-repeats times: generation ms per
    token from `timings` (prefill excluded), tau from /metrics, and whether the tokens equal the plain server's.
    A prompt's group is dropped when other processes kept more than --max-foreign cores busy meanwhile."""
    from draftsmith.bench.metrics import acceptance_from_counters, parse_spec_counters

    before = {s.name: parse_spec_counters(metrics_text(s.base)) for s in servers if s.k}
    groups, dropped = [], 0
    for j, ids in enumerate(prompts * args.chat_repeats):
        wait_quiet(args.max_foreign / 2, 60.0)
        with Meter() as m:
            group = {}
            for s in servers[j % len(servers):] + servers[:j % len(servers)]:
                group[s.name] = llamacpp.complete(s.base, ids, args.max_tokens)
                time.sleep(0.05)  # the finished server's OpenMP workers spin briefly before they sleep
        if m.cores > args.max_foreign:
            dropped += 1
        else:
            groups.append(group)
    time.sleep(0.5)

    def ms_per_token(cs: list) -> float:
        return sum(c.timings.predicted_ms for c in cs) / sum(c.timings.predicted_n - 1 for c in cs)

    out: dict = {"groups_kept": f"{len(groups)}/{len(groups) + dropped}"}
    first_plain = ms_per_token([g[servers[0].plain] for g in groups])
    for s in servers:
        mine = ms_per_token([g[s.name] for g in groups])
        out[s.name] = {"ms_per_token": mine, "speedup": ms_per_token([g[s.plain] for g in groups]) / mine}
        if s.build:
            out[s.name]["speedup_vs_first_build_plain"] = first_plain / mine
        if s.k:
            source, after = parse_spec_counters(metrics_text(s.base))
            acc = acceptance_from_counters(after.minus(before[s.name][1]), source)
            paired = [ms_per_token([g[s.plain]]) / ms_per_token([g[s.name]]) for g in groups]
            out[s.name] |= {"k": s.k, "p_min": s.p_min, "tau": acc.tau, "per_position": acc.per_position,
                            "speedup_per_prompt_median": statistics.median(paired),
                            "speedup_per_prompt_quartiles": statistics.quantiles(paired, n=4),
                            "prompts_with_the_plain_tokens": f"{sum(g[s.name].tokens == g[s.plain].tokens for g in groups)}"
                                                             f"/{len(groups)}"}
    return out


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(samples: dict, ks: list[int], chat: dict, build: str = "") -> dict:
    """The cost rows of one build's servers at p_min 0 (fixed k), from the rounds' medians and the chat phase's
    tau (`build`: its --builds label, the prefix of its server names)."""
    pre = f"{build}/" if build else ""
    if build:
        samples = {name[len(pre):]: rows for name, rows in samples.items() if name.startswith(pre)}
    if "plain" not in samples:  # no cost rounds (--rounds 0), or no plain server of this build
        return {"chat": chat}
    ext = {name: {n: median([r["ext"].get(n) for r in rows]) for n in range(1, 9)} for name, rows in samples.items()}
    plain_ms = median([r["plain_ms"] for r in samples["plain"]])
    rows = []
    for k in ks:
        name = f"k{k}"
        if name not in samples:
            continue
        cycle_ms = median([r["cycle_ms"] for r in samples[name]])
        draft_call_ms = median([r["draft_call_ms"] for r in samples[name]])
        costs = split_cycle(k, plain_ms, cycle_ms, ext["plain"][k + 1], draft_call_ms)
        tau = chat[pre + name]["tau"]
        rows.append({"k": k, "tau": tau, "cycle_ms": cycle_ms, "verify_ms": costs.verify_ms,
                     "draft_step_ms": costs.draft_step_ms, "drafts_ms": k * costs.draft_step_ms,
                     "overhead_ms": costs.overhead_ms,
                     "reprocess_ms": ext[name][k + 1] - ext["plain"][k + 1],
                     "bound_speedup": costs.speedup(tau),
                     "ceiling_free_drafter": tau * plain_ms / costs.verify_ms,
                     "measured_speedup": chat[pre + name]["speedup"],
                     "tau_for_1x": costs.tau_needed(1.0), "tau_for_1_5x": costs.tau_needed(1.5), "max_tau": k + 1})
    return {"plain_ms": plain_ms, "verify_ms": ext["plain"], "extension_ms": ext, "per_k": rows, "chat": chat}


def print_table(s: dict, build: str = "") -> None:
    for name, c in s["chat"].items():
        if isinstance(c, dict) and (not build or name.startswith(f"{build}/")):
            if "tau" in c:
                print(f"{name}: {c['speedup']:.2f}x on the chat prompts (per prompt: median "
                      f"{c['speedup_per_prompt_median']:.2f}x), tau {c['tau']:.2f}"
                      + (f"; {c['speedup_vs_first_build_plain']:.2f}x against the first build's plain server"
                         if "speedup_vs_first_build_plain" in c else ""), flush=True)
            else:
                print(f"{name}: {c['ms_per_token']:.2f} ms per token", flush=True)
    if "plain_ms" not in s:
        return
    print(f"plain step {s['plain_ms']:.2f} ms; verify(n) " +
          " ".join(f"{n}:{v:.1f}" for n, v in s["verify_ms"].items() if v is not None))
    for r in s["per_k"]:
        print(f"k={r['k']}: cycle {r['cycle_ms']:.1f} = verify({r['k'] + 1}) {r['verify_ms']:.1f} + {r['k']} x draft "
              f"{r['draft_step_ms']:.2f} + overhead {r['overhead_ms']:.1f} (re-run of the drafter over the batch "
              f"{r['reprocess_ms']:.1f}); tau {r['tau']:.2f} -> bound {r['bound_speedup']:.2f}x "
              f"(measured {r['measured_speedup']:.2f}x); tau for 1.5x {r['tau_for_1_5x']:.2f} (max {r['max_tau']})",
              flush=True)


def measure_rounds(servers: list[Server], ctx: list[int], fresh, args) -> tuple[dict, float]:
    """args.rounds rounds, every server one block per round, the order rotating; blocks under foreign load dropped."""
    samples: dict[str, list] = {}
    waited = 0.0
    for r in range(args.rounds):
        for s in servers[r % len(servers):] + servers[:r % len(servers)]:
            waited += wait_quiet(args.max_foreign / 2, 60.0)
            order = list(range(1, 9))[r % 8:] + list(range(1, 9))[:r % 8]
            block: dict[str, list] = {}
            with Meter() as m:
                measure_block(s, ctx, fresh, order, args.gen_tokens, block)
            s.blocks += 1
            s.major_faults += m.major_faults
            if m.cores > args.max_foreign:
                s.dropped += 1
            else:
                samples.setdefault(s.name, []).extend(block[s.name])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return samples, waited


def server_name(k: int, p_min: float, drafter_type: str | None) -> str:
    """`k3` is k=3 at p_min 0, `k3@0.5` at 0.5, `k3@0.5/f16` with an f16 drafter beside the run's --outtype."""
    return (f"k{k}" if p_min == 0 else f"k{k}@{p_min:g}") + (f"/{drafter_type}" if drafter_type else "")


def start_servers(stack: contextlib.ExitStack, target_gguf: Path, drafters: dict[str | None, Path],
                  settings: list[tuple[int, float]], extra: tuple[str, ...], tmp: Path,
                  builds: dict[str, Path | None] | None = None) -> list[Server]:
    """One plain server and one per (k, p_min, drafter GGUF), all running at once (`server_name`); `drafters` maps
    None to the drafter at the target's type and each other --drafter-outtype to its GGUF. With `builds` (label ->
    llama-server binary), that set once per build, each name prefixed `label/`."""
    out = []
    for build, binary in (builds or {"": None}).items():
        pre = f"{build}/" if build else ""
        specs = [(pre + "plain", None, 0.0, llamacpp.LlamaServe(target_gguf, extra_args=extra, binary=binary))]
        specs += [(pre + server_name(k, p, t), k, p,
                   llamacpp.LlamaServe(target_gguf, gguf, k=k, p_min=p, extra_args=extra, binary=binary))
                  for t, gguf in drafters.items() for k, p in settings]
        log = lambda name: tmp / (name.replace("/", "_") + ".log")  # noqa: E731
        out += [Server(name, k, p, stack.enter_context(llamacpp.serve(spec, log(name))), log(name), build=build)
                for name, k, p, spec in specs]
    return out


def parse_builds(text: str) -> dict[str, Path | None] | None:
    """`--builds label=DIR,...` -> label -> llama-server binary (DIR is an install dir holding build/bin/llama-server,
    or the binary itself; `default` is the one `make llama-server` built). None when empty."""
    if not text:
        return None
    out: dict[str, Path | None] = {}
    for item in text.split(","):
        label, _, where = item.partition("=")
        if not label or not where or "/" in label:
            raise SystemExit(f"--builds: expected label=DIR (a label without '/'), got {item!r}")
        path = Path(where)
        out[label] = None if where == "default" else (path if path.is_file() else path / "build" / "bin" / "llama-server")
        if out[label] is not None and not out[label].is_file():
            raise SystemExit(f"--builds: no llama-server at {out[label]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outtype", default="f32", help="GGUF type of target and drafter (f32 is what `draftsmith "
                    "export --format llamacpp` writes by default; q8_0)")
    ap.add_argument("--drafter", default="smollm2")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--k", default="2,3,4")
    ap.add_argument("--p-min", default="0", help="drafter-probability cut-offs, a comma list: one server per (k, p-min); "
                    "the cost rows are for p-min 0 (fixed k), the chat phase compares them all")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15, help="rounds of cost blocks (0: the chat phase only, an A/B)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="tokens per timed generation (ignore_eos)")
    ap.add_argument("--prompts", type=int, default=8, help="chat-eval prompts for tau and the measured speed-up "
                    "(the set's 2nd to 9th: what `llamacpp_bench.py` sends after its warm-up prompt)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat-repeats", type=int, default=1, help="times each chat prompt is sent to every server")
    ap.add_argument("--max-foreign", type=float, default=0.25, help="drop a block where other processes kept more "
                    "than this many cores busy")
    ap.add_argument("--drafter-outtype", default="", help="further drafter GGUF types served beside the --outtype one "
                    "against the same target, a comma list (f16,q8_0): one more server per (k, p-min) and type")
    ap.add_argument("--server-args", default="", help="extra llama-server flags for every server (e.g. '-td 1')")
    ap.add_argument("--builds", default="", help="compare llama-server builds of one source side by side: "
                    "label=DIR,... (DIR an install dir with build/bin/llama-server, or `default`); every build gets "
                    "its own plain and speculative servers, measured in the same rounds")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    builds = parse_builds(args.builds)
    from transformers import AutoTokenizer

    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target
    from llamacpp_bench import export_dir, gguf_pair  # benchmarks/ is on sys.path when run as a script

    ks = [int(k) for k in args.k.split(",")]
    settings = [(k, float(p)) for k in ks for p in args.p_min.split(",")]
    tok = AutoTokenizer.from_pretrained(resolve_target(args.target))
    ctx = context_ids(tok, args.context)
    chat_prompts = [prompt_ids(tok, p.messages) for p in load_prompts("chat-eval", args.prompts + 1)][1:]
    pool = [t for ids in chat_prompts for t in ids[3:]]  # real tokens for the extensions
    cursor = [0]

    # n new tokens, starting elsewhere in the pool than the last request's did; should the server still reuse
    # more than ctx from its cache, measure_block drops that sample (prompt_n != n)
    def fresh(n: int) -> list[int]:
        cursor[0] += 1
        return [pool[(cursor[0] * 7 + i) % len(pool)] for i in range(n)]

    extra = (*TRACE, *args.server_args.split())
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        target_gguf, drafter_gguf = gguf_pair(args.drafter, args.target, args.outtype, tmp)
        drafters: dict[str | None, Path] = {None: drafter_gguf}
        for t in filter(None, args.drafter_outtype.split(",")):
            drafters[t] = llamacpp.convert(export_dir(tmp), tmp / f"drafter-{t}.gguf", t, resolve_target(args.target))
        servers = start_servers(stack, target_gguf, drafters, settings, extra, tmp, builds)
        for s in servers:  # warm-up: the context in the cache, one generation, the first statistics line
            llamacpp.complete(s.base, ctx, args.gen_tokens, cache_prompt=True, ignore_eos=True)
            s.stats = next_stats(s.log, None) if s.k else None
        samples, waited = measure_rounds(servers, ctx, fresh, args)
        chat = chat_phase(servers, chat_prompts, args)
        first = llamacpp.LlamaServe(target_gguf, drafter_gguf, k=settings[0][0], p_min=settings[0][1], extra_args=extra)
        command = first.command(Path("llama-server"))
    if builds:
        summary = {"chat": chat, "builds": {b: {"binary": str(path or llamacpp.server_binary()),
                                                **summarize(samples, ks, chat, b)} for b, path in builds.items()}}
        for b in builds:
            print(f"--- build {b}")
            print_table(summary["builds"][b], b)
    else:
        summary = summarize(samples, ks, chat)
        print_table(summary)
    key = " ".join([args.outtype, args.server_args] + ([f"drafters {args.drafter_outtype}"] if args.drafter_outtype
                                                        else []) + ([f"builds {args.builds}"] if builds else [])).strip()
    result = {"what": f"llama-server ({args.outtype} target + {args.outtype} EAGLE-3 drafter GGUF of {args.drafter}): "
                      "the pieces of one speculative cycle, batch 1, greedy", "outtype": args.outtype,
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": f"flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_step_costs.py "
                         + " ".join(sys.argv[1:]),
              "first_speculative_server": command, "context_tokens": len(ctx), "rounds": args.rounds,
              "blocks_dropped_for_foreign_load": {s.name: f"{s.dropped}/{s.blocks}" for s in servers},
              "major_faults_during_blocks": {s.name: s.major_faults for s in servers},
              "quiet_gate_waits_s_total": waited,
              "load_average_1m_at_end": os.getloadavg()[0], **summary, "samples": samples}
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old | {key: result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
