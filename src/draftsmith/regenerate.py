"""`draftsmith regenerate`: the target answers prompts, so the drafter learns the target's own distribution.

Backends:
- `local` (this module): the target itself in transformers, batched, greedy or sampled. Multi-turn
  prompts are answered turn by turn, each turn seeing the target's own earlier answers.
- `endpoint`: OpenAI-compatible servers (`draftsmith.endpoints`).

Output: conversations JSONL (draftsmith.conversations), append-only and resumable by id: a rerun of the
same command skips finished ids.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.conversations import Conversation, ConversationWriter
from draftsmith.endpoints import EndpointSettings, RegenerateSummary, regenerate_endpoints_sync
from draftsmith.errors import DraftsmithError
from draftsmith.progress import progress_bar
from draftsmith.prompts import Prompt, load_prompts

INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class LocalSettings:
    """How the local backend generates."""

    max_new_tokens: int = 256
    """Cap on generated tokens per assistant turn."""
    batch_size: int = 16
    """Prompts decoded together (left-padded)."""
    temperature: float = 0.0
    """0 = greedy (the default: the drafter is then trained on exactly what greedy decoding emits)."""
    top_p: float = 1.0
    seed: int = 0


def split_reasoning(text: str, mode: str) -> tuple[str, str | None]:
    """Split an inline `<think>` block off an answer; `mode` keep|drop decides whether it is returned."""
    match = INLINE_THINK.match(text)
    if not match:
        return text, None
    return text[match.end():], (match.group(1).strip() if mode == "keep" else None)


@torch.inference_mode()
def generate_batch(model, tokenizer, conversations: list[list[dict]], settings: LocalSettings) -> list[tuple[str, int]]:
    """One assistant turn for each conversation; returns (text, number of generated tokens)."""
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    sample = settings.temperature > 0
    out = model.generate(**enc, max_new_tokens=settings.max_new_tokens, do_sample=sample,
                         temperature=settings.temperature if sample else None, top_p=settings.top_p if sample else None,
                         top_k=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    results = []
    for row in new.tolist():
        n = next((i + 1 for i, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
        results.append((tokenizer.decode(row[:n], skip_special_tokens=True), n))
    return results


def regenerate_local(prompts: list[Prompt], model, tokenizer, writer: ConversationWriter, settings: LocalSettings,
                     reasoning: str = "keep", target_name: str = "") -> RegenerateSummary:
    """Answer every unfinished prompt with the local target and append the conversations."""
    torch.manual_seed(settings.seed)
    todo = [p for p in prompts if p.id not in writer.done]
    start, tokens = time.perf_counter(), 0
    with progress_bar("regenerate", total=len(todo), unit="prompts") as bar:
        for b in range(0, len(todo), settings.batch_size):
            batch = todo[b: b + settings.batch_size]
            convs: list[list[dict]] = [[] for _ in batch]
            pending = [list(p.messages) for p in batch]
            while any(pending):
                # Feed each conversation up to and including its next user turn, then answer it.
                active = []
                for i, queue in enumerate(pending):
                    while queue:
                        msg = queue.pop(0)
                        convs[i].append(dict(msg))
                        if msg["role"] == "user":
                            active.append(i)
                            break
                if not active:
                    break
                answers = generate_batch(model, tokenizer, [convs[i] for i in active], settings)
                for i, (text, n) in zip(active, answers):
                    content, thought = split_reasoning(text, reasoning)
                    msg = {"role": "assistant", "content": content}
                    if thought:
                        msg["reasoning_content"] = thought
                    convs[i].append(msg)
                    tokens += n
            for p, conv in zip(batch, convs):
                writer.write(Conversation(p.id, conv, {"backend": "local", "target": target_name,
                                                       "temperature": settings.temperature,
                                                       "reasoning_source": "inline" if any(
                                                           "reasoning_content" in m for m in conv) else "none"}))
            writer.sync()
            bar.advance(len(batch), tokens=tokens)
    return RegenerateSummary(len(todo), len(prompts) - len(todo), tokens, time.perf_counter() - start)


def add_parser(sub) -> None:
    from draftsmith.cli import example_help

    p = sub.add_parser("regenerate", help="answer prompts with the target, writing conversations JSONL",
                       **example_help(
                           "examples:\n"
                           "  draftsmith regenerate --target smollm2 --prompts train --limit 200 --out runs/demo/conversations.jsonl\n"
                           "  draftsmith regenerate --prompts my_prompts.jsonl --out conv.jsonl --temperature 0.7\n"
                           "  DRAFTSMITH_API_KEY=... draftsmith regenerate --prompts train --out conv.jsonl \\\n"
                           "      --endpoint http://gpu0:8000/v1 --endpoint http://gpu1:8000/v1#64 --concurrency 32\n"
                           "Rerunning the same command resumes: finished ids are skipped. See docs/regenerate.md."))
    p.add_argument("--target", default="smollm2", help="smollm2, a model directory, a .gguf file or a hub id")
    p.add_argument("--prompts", default="train", help="train | eval | humaneval | path to a JSONL prompt file")
    p.add_argument("--out", type=Path, required=True, help="conversations JSONL to append to")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--backend", choices=("local", "endpoint"), default="local",
                   help="local: the target in transformers; endpoint: OpenAI-compatible servers (implied by --endpoint)")
    p.add_argument("--max-new-tokens", type=int, default=LocalSettings.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=LocalSettings.batch_size)
    p.add_argument("--temperature", type=float, default=None,
                   help=f"local default {LocalSettings.temperature} (greedy); endpoint default: the server's own")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"local default {LocalSettings.top_p}; endpoint default: the server's own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cpu", help="local backend: cpu, cuda, cuda:1, or auto (cuda when available)")
    p.add_argument("--reasoning", choices=("keep", "drop"), default="keep",
                   help="keep reasoning traces (as reasoning_content) or drop them from the data")
    e = p.add_argument_group("endpoint backend (API key from $DRAFTSMITH_API_KEY or $OPENAI_API_KEY)")
    e.add_argument("--endpoint", action="append", default=[], metavar="URL[#N]",
                   help="OpenAI-compatible base URL, repeatable (data parallel); #N sets that endpoint's concurrency")
    e.add_argument("--model", default=None, help="served model name (default: the first one /models lists)")
    e.add_argument("--concurrency", type=int, default=EndpointSettings.concurrency, help="requests in flight per endpoint")
    e.add_argument("--max-retries", type=int, default=EndpointSettings.max_retries, help="retries per prompt")
    e.add_argument("--error-budget", type=float, default=EndpointSettings.error_budget,
                   help="fraction of prompts that may fail for good before the run stops")
    e.add_argument("--request-timeout", type=float, default=EndpointSettings.request_timeout_s,
                   help="seconds allowed for one chat completion")
    e.add_argument("--json", action="store_true", help="print the run summary as JSON on stdout")
    p.set_defaults(func=run_regenerate)


def run_regenerate(args) -> int:
    from draftsmith.target import load_target, resolve_target

    prompts = load_prompts(args.prompts, args.limit)
    if not prompts:
        raise DraftsmithError("no prompts to answer", got=f"{args.prompts!r} is empty",
                              expected="at least one prompt", fix="check --prompts / --limit")
    if args.endpoint or args.backend == "endpoint":
        return run_endpoint_backend(args, prompts)
    settings = LocalSettings(args.max_new_tokens, args.batch_size,
                             LocalSettings.temperature if args.temperature is None else args.temperature,
                             LocalSettings.top_p if args.top_p is None else args.top_p, args.seed)
    with ConversationWriter(args.out) as writer:
        if len(writer.done) >= len({p.id for p in prompts}) and all(p.id in writer.done for p in prompts):
            print(f"regenerate: all {len(prompts)} prompts already in {args.out}")
            return 0
        model, tokenizer = load_target(resolve_target(args.target), dtype=args.dtype, device=args.device)
        summary = regenerate_local(prompts, model, tokenizer, writer, settings, args.reasoning, args.target)
    rate = summary.output_tokens / max(summary.seconds, 1e-9)
    print(f"regenerate: {summary.done} answered, {summary.skipped} already done, "
          f"{summary.output_tokens} tokens in {summary.seconds:.1f} s ({rate:.1f} tok/s) -> {args.out}")
    return 0


def run_endpoint_backend(args, prompts: list[Prompt]) -> int:
    """`--endpoint ...`: regenerate on OpenAI-compatible servers; exit 1 when any prompt is left undone."""
    if not args.endpoint:
        raise DraftsmithError("--backend endpoint needs at least one --endpoint", got="no --endpoint",
                              expected="--endpoint URL", fix="e.g. --endpoint http://127.0.0.1:8000/v1")
    settings = EndpointSettings(model=args.model, concurrency=args.concurrency, max_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p, reasoning=args.reasoning,
                                max_retries=args.max_retries, error_budget=args.error_budget,
                                request_timeout_s=args.request_timeout)
    with ConversationWriter(args.out) as writer:
        summary = regenerate_endpoints_sync(prompts, args.endpoint, writer, settings)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else f"{summary.render()}\n-> {args.out}")
    return 0 if summary.ok else 1
