"""Self-written prompts: the target writes its own user turns (Magpie, Xu et al. 2024, arXiv 2406.08464).

An instruction-tuned model given only its chat template up to the start of a user turn (the template's
default system prompt, then the user header) continues with a plausible user request. Sampled at
temperature 1.0 / top-p 0.95 this yields varied questions on the target's own distribution, so a user with
no prompt data still gets a drafter trained on what the target answers. A follow-up turn is sampled the
same way after the first answer (the history rendered, then a new user header).

Left alone, a small instruct model writes mostly advice and how-to questions. Each first turn is therefore
steered to a kind of task (TASK_KINDS: writing, roleplay, reasoning, math, coding, extraction, STEM,
humanities, general): Magpie's system-prompt steering (a system turn saying what the user will ask replaces
the template's default one, for the user turn's sampling only) plus a seed phrase the user turn starts with
and keeps. The answer is generated under the template's default system prompt, as real traffic is.

This module holds the pieces that are independent of how tokens are generated: the user-turn prefix of any
chat template, the task kinds and their mix, the end-of-turn stop ids, and the filters (empty or cut-off turns, degenerate repetition,
near-duplicates by MinHash over word shingles, overlap with the eval prompt sets), each counted.
`draftsmith regenerate --prompts self` (regenerate.py) runs the generation waves.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from draftsmith.regenerate.chat import has_chat_template
from draftsmith.errors import DraftsmithError

SENTINEL = "DRAFTSMITHUSERTURNSENTINEL"
WORD = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True)
class TaskKind:
    """How first user turns of one kind of task are steered."""

    name: str
    system: str | None
    """The system turn the user turn is sampled under (None: the template's default, unsteered)."""
    openers: tuple[str, ...]
    """Seed phrases a user turn starts with (kept in the turn); one is drawn per turn. Empty: none."""


# Wording after Magpie's task-specific system prompts (Xu et al. 2024, arXiv 2406.08464, "system prompt steering"):
# say what the user will ask. On SmolLM2-135M-Instruct the system turn alone drifts back to advice questions (2 of
# 4 math turns on kind in a first probe, as with an opener alone); with both, nearly all kept turns are on kind
# (read by hand over the chat-kinds set's samples). Unsteered (general), nearly every turn asks for advice or a plan.
TASK_KINDS: dict[str, TaskKind] = {k.name: k for k in (
    TaskKind("writing", "You are an AI assistant that helps people with creative and professional writing. The user "
             "will ask you to write stories, poems, essays, emails, speeches or other texts, or to edit and improve "
             "a text.", ("Write", "Compose", "Draft", "Can you write", "Rewrite")),
    TaskKind("roleplay", "You are an AI assistant that takes part in role-play. The user will ask you to play a "
             "character, a historical figure or a professional, or to act out a scene or a conversation.",
             ("Pretend you are", "Act as", "Let's role-play:", "Imagine you are", "You are")),
    TaskKind("reasoning", "You are an AI assistant skilled in logical reasoning. The user will give you puzzles, "
             "riddles, logic problems and questions that need careful step-by-step thinking.",
             ("Solve this puzzle:", "If", "Here is a riddle:", "Which", "Three friends")),
    TaskKind("math", "You are an AI assistant that solves math problems. The user will ask arithmetic, algebra, "
             "geometry, probability and word problems with numbers, and wants a worked solution.",
             ("Solve", "Calculate", "What is", "Find", "A train")),
    TaskKind("coding", "You are an AI programming assistant. The user will ask you to write, explain, fix or review "
             "code in Python, JavaScript, SQL, C++ or other languages.",
             ("Write a Python function", "How do I", "Fix this code:", "Write a JavaScript", "Write a SQL query")),
    TaskKind("extraction", "You are an AI assistant that extracts and organizes information. The user will paste a "
             "text (an article, an email, a review, a table) and ask you to pull out names, dates, facts or fields, "
             "summarize it, or turn it into a list or a table.",
             ("Extract", "From the following text,", "Summarize the following", "List all", "Read this email")),
    TaskKind("stem", "You are an AI assistant with expertise in science and engineering. The user will ask questions "
             "about physics, chemistry, biology, medicine, computer science, engineering and technology.",
             ("Explain how", "Why does", "What is the difference between", "How does")),
    TaskKind("humanities", "You are an AI assistant with expertise in the humanities and social sciences. The user "
             "will ask questions about history, philosophy, literature, art, religion, economics, law and politics.",
             ("Discuss", "What were the causes of", "How did", "Compare")),
    TaskKind("general", None, ()),
)}
ALL_KINDS = "all"


def parse_kinds(spec: str) -> tuple[tuple[str, float], ...]:
    """The task-kind mix of `--self-kinds`: `all` (every kind, equal weights) or `KIND[:WEIGHT],...`.

    Raises:
        DraftsmithError: an unknown kind, a repeated one, or a weight that is not a positive number.
    """
    if spec.strip() == ALL_KINDS:
        return tuple((name, 1.0) for name in TASK_KINDS)
    mix: dict[str, float] = {}
    problems = []
    for item in (i.strip() for i in spec.split(",")):
        name, _, weight = item.partition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if name not in TASK_KINDS:
            problems.append(f"unknown kind {name!r}")
        elif name in mix:
            problems.append(f"{name!r} given twice")
        elif not w > 0 or w == float("inf"):
            problems.append(f"weight {weight!r} of {name!r}")
        else:
            mix[name] = w
    if problems or not mix:
        raise DraftsmithError("--self-kinds: not a mix of task kinds", got=f"{spec!r}: {'; '.join(problems) or 'empty'}",
                              expected=f"{ALL_KINDS!r} or KIND[:WEIGHT],... with KIND one of {', '.join(TASK_KINDS)} "
                                       "and WEIGHT a positive number",
                              fix="e.g. --self-kinds all, or --self-kinds writing,math:2,coding:2,general")
    return tuple(mix.items())


@dataclass(frozen=True)
class SteeredTurn:
    """Where one first user turn is sampled: its kind, the system turn it is sampled under, its opener."""

    kind: str
    history: list[dict[str, Any]]
    opener: str


def steer(kinds: tuple[tuple[str, float], ...], count: int, seed: int) -> list[SteeredTurn]:
    """`count` first turns' kinds drawn from the mix and an opener for each, seeded (another seed: another draw)."""
    rng = random.Random(seed)
    names = rng.choices([n for n, _ in kinds], weights=[w for _, w in kinds], k=count)
    turns = []
    for name in names:
        kind = TASK_KINDS[name]
        history = [{"role": "system", "content": kind.system}] if kind.system else []
        turns.append(SteeredTurn(name, history, rng.choice(kind.openers) if kind.openers else ""))
    return turns


@dataclass(frozen=True)
class SelfPromptSettings:
    """How user turns are sampled and filtered."""

    count: int = 1000
    """User turns sampled for first turns (before filtering)."""
    temperature: float = 1.0
    """Sampling temperature of user turns (Magpie: 1.0)."""
    top_p: float = 0.95
    """Nucleus of user-turn sampling (Magpie: 0.95... 1.0)."""
    seed: int = 0
    """Seed of user-turn sampling; another seed gives another prompt set."""
    max_turn_tokens: int = 128
    """Cap on a user turn's tokens; a turn that reaches it is cut off and dropped."""
    multi_turn: float = 0.25
    """Share of conversations that get a sampled follow-up user turn and its answer."""
    min_chars: int = 12
    """Shorter user turns count as empty."""
    dedup_threshold: float = 0.7
    """Estimated Jaccard similarity of word 3-gram shingles at or above which a turn is a near-duplicate."""
    num_perm: int = 64
    """MinHash permutations."""
    kinds: tuple[tuple[str, float], ...] = tuple((name, 1.0) for name in TASK_KINDS)
    """Task kinds of first turns and their mix weights (parse_kinds)."""


@dataclass(frozen=True)
class Continuation:
    """One continuation of a raw text prefix."""

    text: str
    stopped: bool
    """It ended on an end-of-turn token (False: cut at max_tokens)."""
    tokens: int


class Completer(Protocol):
    """Continues raw text prefixes: the local target (`regenerate.LocalCompleter`) or an endpoint's completions
    API (`endpoints.EndpointCompleter`). One interface, so self-prompting runs the same waves on either."""

    def __call__(self, prefixes: list[str], max_tokens: int, temperature: float, top_p: float,
                 label: str) -> list[Continuation]: ...


@dataclass
class FilterCounts:
    """What happened to the sampled user turns."""

    sampled: int = 0
    empty: int = 0
    cut_off: int = 0
    repetitive: int = 0
    near_duplicate: int = 0
    eval_overlap: int = 0
    kept: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def render(self) -> str:
        d = self.to_dict()
        return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d.items())


def user_turn_prefix(tokenizer, history: list[dict[str, Any]]) -> tuple[str, str]:
    """(text up to where the next user turn's content starts, text that closes a user turn).

    The template is rendered with a sentinel as the new user turn's content and cut at the sentinel, so the
    prefix carries whatever the template puts first (its default system prompt included).

    Raises:
        DraftsmithError: the tokenizer has no chat template, or the template hides the user content.
    """
    if not has_chat_template(tokenizer):
        raise DraftsmithError("self-written prompts need a chat template", got=f"{type(tokenizer).__name__} without one",
                              expected="an instruction-tuned target whose tokenizer has chat_template",
                              fix="use --prompts FILE with your own prompts for a base model")
    text = tokenizer.apply_chat_template(history + [{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if text.count(SENTINEL) != 1:
        raise DraftsmithError("the chat template does not render the user turn's content once",
                              got=f"{text.count(SENTINEL)} copies of the content", expected="exactly one",
                              fix="use --prompts FILE with your own prompts")
    prefix, suffix = text.split(SENTINEL)
    return prefix, suffix


def end_of_turn_ids(tokenizer, suffix: str) -> list[int]:
    """Token ids that end a sampled user turn: the first token of the template's turn closer, and eos."""
    ids = set()
    closer = tokenizer(suffix.strip() or suffix, add_special_tokens=False)["input_ids"]
    if closer:
        ids.add(closer[0])
    eos = tokenizer.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def is_repetitive(text: str, n: int = 3, min_words: int = 12, max_repeat_share: float = 0.5) -> bool:
    """Degenerate repetition: over half of the word n-grams are repeats of earlier ones."""
    words = WORD.findall(text.lower())
    if len(words) < min_words:
        return False
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / len(grams) > max_repeat_share


def shingles(text: str, n: int = 3) -> set[bytes]:
    words = WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


@dataclass
class TurnFilter:
    """Keeps a user turn unless it is empty, cut off, repetitive, a near-duplicate of a kept one, or of an eval prompt."""

    settings: SelfPromptSettings
    eval_texts: list[str] = field(default_factory=list)
    counts: FilterCounts = field(default_factory=FilterCounts)

    def __post_init__(self):
        from datasketch import MinHashLSH

        self.lsh = MinHashLSH(threshold=self.settings.dedup_threshold, num_perm=self.settings.num_perm)
        self.n = 0
        for text in self.eval_texts:
            self.lsh.insert(f"eval-{self.n}", self.minhash(text))
            self.n += 1

    def minhash(self, text: str):
        from datasketch import MinHash

        m = MinHash(num_perm=self.settings.num_perm, seed=1)
        m.update_batch(list(shingles(text)))
        return m

    def reason(self, text: str, stopped: bool) -> str | None:
        """Why a turn is dropped (a FilterCounts field), or None to keep it (and remember it)."""
        self.counts.sampled += 1
        text = text.strip()
        if len(text) < self.settings.min_chars:
            why = "empty"
        elif not stopped:
            why = "cut_off"
        elif is_repetitive(text):
            why = "repetitive"
        else:
            m = self.minhash(text)
            hits = self.lsh.query(m)
            if any(h.startswith("eval-") for h in hits):
                why = "eval_overlap"
            elif hits:
                why = "near_duplicate"
            else:
                self.lsh.insert(f"kept-{self.n}", m)
                self.n += 1
                self.counts.kept += 1
                return None
        setattr(self.counts, why, getattr(self.counts, why) + 1)
        return why


def eval_prompt_texts() -> list[str]:
    """User texts of every built-in eval prompt set (self-written prompts that overlap them are dropped); a
    shipped set not built yet is skipped (the first eval set is written before it exists)."""
    from draftsmith.regenerate.prompts import EVAL_SETS, SHIPPED_FILES, load_prompts

    texts = []
    for name in EVAL_SETS:
        if name in SHIPPED_FILES and not SHIPPED_FILES[name].is_file():
            continue
        texts += [m["content"] for p in load_prompts(name, None) for m in p.messages if m["role"] == "user"]
    return texts
