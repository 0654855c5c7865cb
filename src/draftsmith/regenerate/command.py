"""`draftsmith regenerate`: the target answers prompts, so the drafter learns the target's own distribution.

Backends:
- `local` (this module): the target itself in transformers, batched, greedy or sampled. Multi-turn
  prompts are answered turn by turn, each turn seeing the target's own earlier answers.
- `endpoint`: OpenAI-compatible servers (`draftsmith.regenerate.endpoints`).

Output: conversations JSONL (draftsmith.regenerate.conversations), append-only and resumable by id: a rerun of the
same command skips finished ids. A rerun with other settings is refused (draftsmith.regenerate.record).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any
from pathlib import Path

import torch
from pydantic import Field, model_validator

from draftsmith.client import redact
from draftsmith.config import Settings, add_flags, check_choices, doc_of, from_flags
from draftsmith.regenerate.conversations import Conversation, ConversationWriter
from draftsmith.regenerate.endpoints import EndpointSettings, RegenerateSummary, parse_reply, regenerate_endpoints_sync
from draftsmith.errors import DraftsmithError
from draftsmith.progress import progress_bar
from draftsmith.regenerate.prompts import SELF, Prompt, load_prompts, stable_id
from draftsmith.regenerate.record import check_append, removed_if_unwritten, shaping
from draftsmith.regenerate.selfprompt import (ALL_KINDS, Completer, Continuation, FilterCounts,
                                             SelfPromptSettings, TurnFilter, end_of_turn_ids, eval_prompt_texts,
                                             parse_kinds, steer, user_turn_prefix)

@dataclass(frozen=True)
class LocalSettings:
    """How the local backend generates."""

    max_new_tokens: int = 256
    """Cap on generated tokens per assistant turn."""
    batch_size: int = 16
    """Prompts decoded together: left-padded batches for `generate`, KV-cache rows for `rows`."""
    temperature: float = 0.0
    """0 = greedy (the default: the drafter is then trained on exactly what greedy decoding emits)."""
    top_p: float = 1.0
    seed: int = 0
    decoder: str = "auto"
    """rows (generation.RowDecoder: static KV cache, rows refilled as they finish, CUDA graphs), generate
    (transformers' generate on left-padded batches), or auto: rows on CUDA, generate on CPU."""
    max_length: int = 2048
    """rows decoder: prompt + answer tokens per row."""


def use_rows(model, settings: LocalSettings) -> bool:
    from draftsmith.regenerate.generation import supports

    if settings.decoder == "generate":
        return False
    if settings.decoder == "rows":
        if not supports(model):
            raise DraftsmithError("--decoder rows does not support this target", got=type(model).__name__,
                                  expected="a Llama-style attention (generation.SUPPORTED_ATTENTION)",
                                  fix="use --decoder generate")
        return True
    return model.device.type == "cuda" and supports(model)


@torch.inference_mode()
def generate_batch(model, tokenizer, conversations: list[list[dict]], settings: LocalSettings) -> list[tuple[str, int]]:
    """One assistant turn for each conversation; returns (text, number of generated tokens)."""
    from draftsmith.regenerate.chat import prompt_ids

    prefixes = [prompt_ids(tokenizer, c) for c in conversations]
    return [(tokenizer.decode(ids, skip_special_tokens=True), n)
            for ids, n in continue_ids(model, tokenizer, prefixes, settings, [tokenizer.eos_token_id])]


@torch.inference_mode()
def continue_ids(model, tokenizer, prefixes: list[list[int]], settings: LocalSettings, stop_ids: list[int],
                 progress=None) -> list[tuple[list[int], int]]:
    """Continue each token-id prefix until a stop id or max_new_tokens: (ids without the stop id, tokens generated).

    `rows` decodes all prefixes in one continuous batch; `generate` in left-padded batches of batch_size.
    """
    if use_rows(model, settings):
        from draftsmith.regenerate.generation import RowDecodeSettings, decode_all

        ds = RowDecodeSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                            top_p=settings.top_p, rows=settings.batch_size, max_length=settings.max_length)
        done, _ = decode_all(model, prefixes, ds, stop_ids, progress)
        return [(c.token_ids, len(c.token_ids) + c.stopped) for c in done]
    results = []
    sample = settings.temperature > 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    for b in range(0, len(prefixes), settings.batch_size):
        chunk = prefixes[b: b + settings.batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=settings.max_new_tokens,
                             do_sample=sample, temperature=settings.temperature if sample else None,
                             top_p=settings.top_p if sample else None, top_k=None, pad_token_id=pad,
                             eos_token_id=stop_ids)
        for row in out[:, width:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
            results.append((row[:n - 1] if row[n - 1] in stop_ids else row[:n], n))
        if progress:
            progress(len(results), sum(n for _, n in results))
    return results


def regenerate_local(prompts: list[Prompt], model, tokenizer, writer: ConversationWriter, settings: LocalSettings,
                     reasoning: str = "keep", target_name: str = "") -> RegenerateSummary:
    """Answer every unfinished prompt with the local target and append the conversations.

    Prompts go in chunks (a batch for `generate`, CHUNK_TURNS for the rows decoder), each written when done;
    within a chunk every conversation's next user turn is answered in one call, each turn seeing the target's
    own earlier answers.
    """
    torch.manual_seed(settings.seed)
    todo = [p for p in prompts if p.id not in writer.done]
    chunk = CHUNK_TURNS if use_rows(model, settings) else settings.batch_size
    start, tokens = time.perf_counter(), 0
    with progress_bar("regenerate", total=len(todo), unit="prompts") as bar:
        for b in range(0, len(todo), chunk):
            batch = todo[b: b + chunk]
            convs: list[list[dict]] = [[] for _ in batch]
            pending = [list(p.messages) for p in batch]
            while True:
                active = []
                for i, queue in enumerate(pending):  # feed each conversation up to and including its next user turn
                    while queue:
                        msg = queue.pop(0)
                        convs[i].append(dict(msg))
                        if msg["role"] == "user":
                            active.append(i)
                            break
                if not active:
                    break
                for i, (text, n) in zip(active, generate_batch(model, tokenizer, [convs[i] for i in active], settings)):
                    convs[i].append(assistant_message(text, reasoning))
                    tokens += n
            for p, conv in zip(batch, convs):
                writer.write(Conversation(p.id, conv, {"backend": "local", "target": target_name,
                                                       "temperature": settings.temperature,
                                                       "reasoning_source": "inline" if any(
                                                           "reasoning_content" in m for m in conv) else "none"}))
            writer.sync()
            bar.advance(len(batch), tokens=tokens)
    return RegenerateSummary(len(todo), len(prompts) - len(todo), tokens, time.perf_counter() - start)


CHUNK_TURNS = 8192  # turns answered per call of the local backend


def assistant_message(text: str, reasoning: str) -> dict:
    """The answer as a message; an inline `<think>` block becomes `reasoning_content` (keep) or is dropped."""
    reply = parse_reply({"content": text})
    msg = {"role": "assistant", "content": reply.content}
    if reply.reasoning and reasoning == "keep":
        msg["reasoning_content"] = reply.reasoning
    return msg


@dataclass(frozen=True)
class SelfSummary:
    """What `regenerate --prompts self` did: the first-turn and follow-up filters, and the answers."""

    first_turns: FilterCounts
    follow_ups: FilterCounts
    conversations: int
    multi_turn: int
    output_tokens: int
    seconds: float
    prompt_tokens_per_s: float
    answer_tokens_per_s: float

    def render(self) -> str:
        return (f"regenerate --prompts self: {self.conversations} conversations ({self.multi_turn} multi-turn), "
                f"{self.output_tokens:,} answer tokens in {self.seconds:.1f} s\n"
                f"  first user turns: {self.first_turns.render()}\n  follow-up turns: {self.follow_ups.render()}\n"
                f"  user-turn sampling {self.prompt_tokens_per_s:,.0f} tok/s, answers {self.answer_tokens_per_s:,.0f} tok/s")


@dataclass
class LocalCompleter:
    """The local target (rows decoder or `generate`, as LocalSettings says), stopping at `stop_ids`."""

    model: Any
    tokenizer: Any
    settings: LocalSettings
    stop_ids: list[int]

    def __call__(self, prefixes: list[str], max_tokens: int, temperature: float, top_p: float,
                 label: str) -> list[Continuation]:
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes]
        s = replace(self.settings, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p)
        out: list[Continuation] = []
        with progress_bar(label, total=len(ids), unit="turns") as bar:
            for b in range(0, len(ids), CHUNK_TURNS):
                for t, n in continue_ids(self.model, self.tokenizer, ids[b: b + CHUNK_TURNS], s, self.stop_ids):
                    out.append(Continuation(self.tokenizer.decode(t, skip_special_tokens=True), n == len(t) + 1, n))
                bar.advance(len(out) - bar.done, tokens=sum(c.tokens for c in out))
        return out


def end_of_turn_stops(tokenizer) -> tuple[list[int], str]:
    """Stop ids (the template's turn closer and eos) and the closer's text, for every wave."""
    _, suffix = user_turn_prefix(tokenizer, [])
    ids = end_of_turn_ids(tokenizer, suffix)
    return ids, tokenizer.decode(ids[:1])


def sample_user_turns(complete: Completer, tokenizer, histories: list[list[dict]], sp: SelfPromptSettings,
                      flt: TurnFilter, openers: list[str] | None = None) -> tuple[list[str | None], int, float]:
    """A sampled user turn after each history (None where the filter dropped it), tokens generated, seconds.

    An opener is put at the start of the user turn and kept in it; a turn that adds nothing to it counts as empty.
    """
    openers = openers or [""] * len(histories)
    prefixes = [user_turn_prefix(tokenizer, h)[0] + o for h, o in zip(histories, openers)]
    t0 = time.perf_counter()
    out = complete(prefixes, sp.max_turn_tokens, sp.temperature, sp.top_p, "user turns") if prefixes else []
    seconds = time.perf_counter() - t0
    texts = [(o + c.text).strip() if c.text.strip() else "" for o, c in zip(openers, out)]
    texts = [None if flt.reason(t, c.stopped) else t for t, c in zip(texts, out)]
    return texts, sum(c.tokens for c in out), seconds


def sample_first_turns(complete: Completer, tokenizer, sp: SelfPromptSettings,
                       flt: TurnFilter) -> tuple[list[tuple[str, str]], int, float]:
    """First user turns steered by task kind (selfprompt.steer): (kind, text) of each kept one, tokens, seconds."""
    steered = steer(sp.kinds, sp.count, sp.seed)
    texts, tokens, seconds = sample_user_turns(complete, tokenizer, [t.history for t in steered], sp, flt,
                                               [t.opener for t in steered])
    return [(t.kind, text) for t, text in zip(steered, texts) if text is not None], tokens, seconds


def answer_all(complete: Completer, tokenizer, convs: list[list[dict]], settings: LocalSettings) -> list[Continuation]:
    """The target's next assistant turn for each conversation, from its chat template's generation prompt."""
    from draftsmith.regenerate.chat import for_template, render

    prefixes = [render(tokenizer, for_template(c), add_generation_prompt=True) for c in convs]
    return complete(prefixes, settings.max_new_tokens, settings.temperature, settings.top_p, "answers") if convs else []


def regenerate_self(complete: Completer, tokenizer, writer: ConversationWriter, sp: SelfPromptSettings,
                    settings: LocalSettings, reasoning: str = "keep", target_name: str = "",
                    eval_texts: list[str] | None = None, backend: str = "local") -> SelfSummary:
    """The target writes its user turns and answers them: four waves (first turns, answers, follow-ups, answers).

    `settings` gives the answers' max_new_tokens, temperature and top_p. A rerun with the same settings writes
    the same conversations (seeded); finished ids are skipped.
    """
    start = time.perf_counter()
    torch.manual_seed(sp.seed)
    flt = TurnFilter(sp, eval_texts if eval_texts is not None else eval_prompt_texts())
    firsts, prompt_tokens, prompt_s = sample_first_turns(complete, tokenizer, sp, flt)
    firsts = [(kind, t) for kind, t in firsts if stable_id("self", f"{sp.seed}:{t}") not in writer.done]
    convs = [[{"role": "user", "content": t}] for _, t in firsts]
    ids = [stable_id("self", f"{sp.seed}:{t}") for _, t in firsts]
    torch.manual_seed(sp.seed + 1)
    t0 = time.perf_counter()
    answers = answer_all(complete, tokenizer, convs, settings)
    answer_tokens, answer_s = sum(c.tokens for c in answers), time.perf_counter() - t0
    for conv, c in zip(convs, answers):
        conv.append(assistant_message(c.text, reasoning))
    # Follow-ups: a seeded share of the conversations whose first answer ended on its own.
    g = torch.Generator().manual_seed(sp.seed + 2)
    eligible = [i for i, c in enumerate(answers) if c.stopped]
    picked = sorted(eligible[j] for j in torch.randperm(len(eligible), generator=g)[:round(sp.multi_turn * len(convs))].tolist())
    follow_flt = TurnFilter(sp, [])
    torch.manual_seed(sp.seed + 3)
    follow, n_follow, follow_s = sample_user_turns(complete, tokenizer, [convs[i] for i in picked], sp, follow_flt)
    second = [i for i, t in zip(picked, follow) if t is not None]
    for i, t in zip(picked, follow):
        if t is not None:
            convs[i].append({"role": "user", "content": t})
    t0 = time.perf_counter()
    for i, c in zip(second, answer_all(complete, tokenizer, [convs[i] for i in second], settings)):
        convs[i].append(assistant_message(c.text, reasoning))
        answer_tokens += c.tokens
    answer_s += time.perf_counter() - t0
    for cid, (kind, _), conv in zip(ids, firsts, convs):
        writer.write(Conversation(cid, conv, {"backend": backend, "target": target_name, "prompts": "self",
                                              "kind": kind, "self_seed": sp.seed,
                                              "temperature": settings.temperature}))
    writer.sync()
    return SelfSummary(flt.counts, follow_flt.counts, len(convs), len(second), answer_tokens,
                       time.perf_counter() - start, (prompt_tokens + n_follow) / max(prompt_s + follow_s, 1e-9),
                       answer_tokens / max(answer_s, 1e-9))


def write_self_prompts(complete: Completer, tokenizer, out: Path, sp: SelfPromptSettings,
                       eval_texts: list[str] | None = None) -> FilterCounts:
    """Sample and filter first user turns only, and write them as a prompt JSONL (`{"id", "prompt", "kind"}` per
    line)."""
    torch.manual_seed(sp.seed)
    flt = TurnFilter(sp, eval_texts if eval_texts is not None else eval_prompt_texts())
    firsts, _, _ = sample_first_turns(complete, tokenizer, sp, flt)
    with open(out, "w") as f:
        for kind, t in firsts:
            f.write(json.dumps({"id": stable_id("self", f"{sp.seed}:{t}"), "prompt": t, "kind": kind}) + "\n")
    return flt.counts


SELF_FIELDS = ("self_count", "self_kinds", "self_temperature", "self_top_p", "self_seed", "multi_turn", "max_turn_tokens")
ENDPOINT_FIELDS = ("model", "concurrency", "max_retries", "error_budget", "request_timeout_s")


class RegenerateSettings(Settings):
    """How `regenerate` answers prompts: the regenerate verb's flags and `run`'s regenerate section."""

    prompts: str = "train"
    """train | eval | humaneval | chat-eval | self (the target writes its own user turns) | a JSONL of
    {"prompt"} / {"messages"} records."""
    limit: int | None = Field(None, ge=1)
    """Use only the first N prompts (null: all)."""
    max_new_tokens: int = Field(LocalSettings.max_new_tokens, ge=1)
    """Cap on generated tokens per assistant turn."""
    batch_size: int = Field(LocalSettings.batch_size, ge=1)
    """Local backend: prompts decoded together (KV-cache rows for decoder rows; e.g. 1024 on a GPU)."""
    decoder: str = LocalSettings.decoder
    """Local backend: rows (static KV cache, rows refilled as they finish, CUDA graphs), generate (transformers),
    auto: rows on CUDA, generate on CPU."""
    max_length: int = Field(LocalSettings.max_length, ge=1)
    """Rows decoder: prompt + answer tokens per row."""
    temperature: float | None = Field(None, ge=0)
    """0 = greedy; null: greedy on the local target, the server's own sampling defaults on endpoints."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus of answer sampling; null: 1.0 on the local target, the server's own on endpoints."""
    seed: int = Field(LocalSettings.seed, ge=0)
    """Local backend: seed of sampled answers."""
    dtype: str = "float32"
    """Local backend: float32 | bfloat16."""
    device: str = "cpu"
    """Local backend: where the target runs (cpu, cuda, cuda:1, or auto: cuda when available)."""
    reasoning: str = "keep"
    """keep: store reasoning as `reasoning_content`; drop: the answer only."""
    self_count: int = Field(SelfPromptSettings.count, ge=1)
    """prompts: self: user turns to sample before filtering (thousands for a real drafter)."""
    self_kinds: str = ALL_KINDS
    """prompts: self: task kinds of the first user turns, all (equal weights) or KIND[:WEIGHT],... with KIND one of
    writing, roleplay, reasoning, math, coding, extraction, stem, humanities, general (general: unsteered)."""
    self_temperature: float = Field(SelfPromptSettings.temperature, ge=0)
    """prompts: self: sampling temperature of user turns (Magpie: 1.0)."""
    self_top_p: float = Field(SelfPromptSettings.top_p, gt=0, le=1)
    """prompts: self: nucleus of user-turn sampling."""
    self_seed: int = Field(SelfPromptSettings.seed, ge=0)
    """prompts: self: seed of user-turn sampling (another seed: another prompt set)."""
    multi_turn: float = Field(SelfPromptSettings.multi_turn, ge=0, le=1)
    """prompts: self: share of conversations that get a sampled follow-up turn and its answer."""
    max_turn_tokens: int = Field(SelfPromptSettings.max_turn_tokens, ge=1)
    """prompts: self: cap on a user turn (a turn that reaches it is dropped as cut off)."""
    endpoints: tuple[str, ...] = ()
    """OpenAI-compatible servers (`URL[#concurrency]`, data parallel) that answer instead of the local target;
    the command line repeats --endpoint URL[#N]."""
    model: str | None = EndpointSettings.model
    """Endpoints: served model name (null: the first one /models lists)."""
    concurrency: int = Field(EndpointSettings.concurrency, ge=1)
    """Endpoints: requests in flight per endpoint."""
    max_retries: int = Field(EndpointSettings.max_retries, ge=0)
    """Endpoints: retries per prompt."""
    error_budget: float = Field(EndpointSettings.error_budget, ge=0, le=1)
    """Endpoints: fraction of prompts that may fail for good before the run stops."""
    request_timeout_s: float = Field(EndpointSettings.request_timeout_s, gt=0)
    """Endpoints: seconds allowed for one chat completion."""

    @model_validator(mode="after")
    def check_choices(self) -> RegenerateSettings:
        check_choices(("--decoder", self.decoder, ("auto", "rows", "generate")),
                      ("--dtype", self.dtype, ("float32", "bfloat16")), ("--reasoning", self.reasoning, ("keep", "drop")))
        parse_kinds(self.self_kinds)
        return self

    def local(self) -> LocalSettings:
        """The local backend's generation settings."""
        return LocalSettings(self.max_new_tokens, self.batch_size,
                             LocalSettings.temperature if self.temperature is None else self.temperature,
                             LocalSettings.top_p if self.top_p is None else self.top_p, self.seed, self.decoder,
                             self.max_length)

    def self_prompts(self) -> SelfPromptSettings:
        """How `prompts: self` samples and filters user turns."""
        return SelfPromptSettings(count=self.self_count, temperature=self.self_temperature, top_p=self.self_top_p,
                                  seed=self.self_seed, multi_turn=self.multi_turn,
                                  max_turn_tokens=self.max_turn_tokens, kinds=parse_kinds(self.self_kinds))

    def endpoint(self) -> EndpointSettings:
        """How the endpoint backend talks to the servers."""
        return EndpointSettings(model=self.model, concurrency=self.concurrency, max_tokens=self.max_new_tokens,
                                temperature=self.temperature, top_p=self.top_p, reasoning=self.reasoning,
                                max_retries=self.max_retries, error_budget=self.error_budget,
                                request_timeout_s=self.request_timeout_s)


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("regenerate", help="answer prompts with the target, writing conversations JSONL",
                       **example_help(
                           "examples:\n"
                           "  draftsmith regenerate --target smollm2 --prompts train --limit 200 --out runs/demo/conversations.jsonl\n"
                           "  draftsmith regenerate --prompts my_prompts.jsonl --out conv.jsonl --temperature 0.7\n"
                           "  draftsmith regenerate --prompts self --self-count 2000 --out conv.jsonl   # the target writes the prompts\n"
                           "  draftsmith regenerate --prompts self --self-count 40000 --device cuda --batch-size 1024 --out conv.jsonl\n"
                           "  DRAFTSMITH_API_KEY=... draftsmith regenerate --prompts train --out conv.jsonl \\\n"
                           "      --endpoint http://gpu0:8000/v1 --endpoint http://gpu1:8000/v1#64 --concurrency 32\n"
                           "Rerunning the same command resumes: finished ids are skipped. See docs/regenerate.md."))
    p.add_argument("--target", default="smollm2", help="smollm2, a model directory, a .gguf file or a hub id")
    p.add_argument("--out", type=Path, required=True,
                   help="conversations JSONL to append to (one this command wrote with the same settings, or new)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out (and its .settings.json record) instead of refusing a file of other settings")
    p.add_argument("--backend", choices=("local", "endpoint"), default="local",
                   help="local: the target in transformers; endpoint: OpenAI-compatible servers (implied by --endpoint)")
    add_flags(p, RegenerateSettings, skip=(*SELF_FIELDS, *ENDPOINT_FIELDS, "endpoints"))
    sp = p.add_argument_group("self-written prompts (--prompts self; Magpie, arXiv 2406.08464)")
    add_flags(sp, RegenerateSettings, only=SELF_FIELDS)
    sp.add_argument("--prompts-only", action="store_true",
                    help="write the filtered first user turns as a prompt JSONL ({id, prompt}) instead of conversations")
    e = p.add_argument_group("endpoint backend (API key from $DRAFTSMITH_API_KEY or $OPENAI_API_KEY)")
    e.add_argument("--endpoint", dest="endpoints", action="append", default=[], metavar="URL[#N]",
                   help=doc_of(RegenerateSettings.model_fields["endpoints"]))
    add_flags(e, RegenerateSettings, only=ENDPOINT_FIELDS, flags={"request_timeout_s": "--request-timeout"})
    e.add_argument("--json", action="store_true", help="print the run summary as JSON on stdout")
    p.set_defaults(func=run_regenerate)


def run_regenerate(args) -> int:
    with removed_if_unwritten(args.out):
        return regenerate_verb(args)


def regenerate_verb(args) -> int:
    from draftsmith.target import load_target, resolve_target

    s = from_flags(RegenerateSettings, args)
    if s.prompts == SELF:
        return run_self(args, s)
    if Path(s.prompts).is_file() and Path(s.prompts).resolve() == Path(args.out).resolve():
        raise DraftsmithError("regenerate: --out is the --prompts file", got=str(args.out),
                              expected="an output apart from the prompts it reads (--overwrite would replace them)",
                              fix=f"pass another --out, e.g. {Path(args.out).with_suffix('')}-answers.jsonl")
    prompts = load_prompts(s.prompts, s.limit)
    if not prompts:
        raise DraftsmithError("no prompts to answer", got=f"{s.prompts!r} is empty",
                              expected="at least one prompt", fix="check --prompts / --limit")
    if s.endpoints or args.backend == "endpoint":
        return run_endpoint_backend(args, s, prompts)
    settings = s.local()
    check_append(args.out, shaping(s, args.target, "local", False), args.overwrite)
    with ConversationWriter(args.out) as writer:
        if len(writer.done) >= len({p.id for p in prompts}) and all(p.id in writer.done for p in prompts):
            print(f"regenerate: all {len(prompts)} prompts already in {args.out}")
            return 0
        model, tokenizer = load_target(resolve_target(args.target), dtype=s.dtype, device=s.device)
        summary = regenerate_local(prompts, model, tokenizer, writer, settings, s.reasoning, args.target)
    rate = summary.output_tokens / max(summary.seconds, 1e-9)
    print(f"regenerate: {summary.done} answered, {summary.skipped} already done, "
          f"{summary.output_tokens} tokens in {summary.seconds:.1f} s ({rate:.1f} tok/s) -> {args.out}")
    return 0


def run_self(args, s: RegenerateSettings) -> int:
    """`--prompts self`: the target writes its user turns and answers them, locally or on `--endpoint` servers
    (their completions API, with this target's chat template rendered here: --target names its tokenizer)."""
    from draftsmith.target import load_target, resolve_target

    sp, settings = s.self_prompts(), s.local()
    check_append(args.out, shaping(s, args.target, "endpoint" if s.endpoints else "local", args.prompts_only),
                 args.overwrite)
    if s.endpoints:
        from transformers import AutoTokenizer

        from draftsmith.regenerate.endpoints import EndpointCompleter

        tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
        _, closer = end_of_turn_stops(tokenizer)
        complete: Completer = EndpointCompleter(list(s.endpoints), s.model, s.concurrency, (closer,), sp.seed,
                                                s.max_retries, s.request_timeout_s)
        backend = "endpoint"
    else:
        model, tokenizer = load_target(resolve_target(args.target), dtype=s.dtype, device=s.device)
        complete, backend = LocalCompleter(model, tokenizer, settings, end_of_turn_stops(tokenizer)[0]), "local"
    if args.prompts_only:
        counts = write_self_prompts(complete, tokenizer, args.out, sp)
        print(redact(json.dumps(counts.to_dict()) if args.json else f"regenerate --prompts self --prompts-only: "
                     f"{counts.render()}\n-> {args.out}"))
        return 0
    with ConversationWriter(args.out) as writer:
        summary = regenerate_self(complete, tokenizer, writer, sp, settings, s.reasoning, args.target, backend=backend)
    print(redact(json.dumps(asdict(summary), indent=2) if args.json else f"{summary.render()}\n-> {args.out}"))
    return 0


def run_endpoint_backend(args, s: RegenerateSettings, prompts: list[Prompt]) -> int:
    """`--endpoint ...`: regenerate on OpenAI-compatible servers; exit 1 when any prompt is left undone."""
    if not s.endpoints:
        raise DraftsmithError("--backend endpoint needs at least one --endpoint", got="no --endpoint",
                              expected="--endpoint URL", fix="e.g. --endpoint http://127.0.0.1:8000/v1")
    check_append(args.out, shaping(s, args.target, "endpoint", False), args.overwrite)
    with ConversationWriter(args.out) as writer:
        summary = regenerate_endpoints_sync(prompts, list(s.endpoints), writer, s.endpoint())
    print(json.dumps(summary.to_dict(), indent=2) if args.json else f"{summary.render()}\n-> {args.out}")
    return 0 if summary.ok else 1
