"""Self-written prompts: the target writes its own user turns (Magpie, Xu et al. 2024, arXiv 2406.08464).

An instruction-tuned model given only its chat template up to the start of a user turn (the template's
default system prompt, then the user header) continues with a plausible user request. Sampled at
temperature 1.0 / top-p 0.95 this yields varied questions on the target's own distribution, so a user with
no prompt data still gets a drafter trained on what the target answers. A follow-up turn is sampled the
same way after the first answer (the history rendered, then a new user header).

This module holds the pieces that are independent of how tokens are generated: the user-turn prefix of any
chat template, the end-of-turn stop ids, and the filters (empty or cut-off turns, degenerate repetition,
near-duplicates by MinHash over word shingles, overlap with the eval prompt sets), each counted.
`draftsmith regenerate --prompts self` (regenerate.py) runs the generation waves.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from draftsmith.regenerate.chat import has_chat_template
from draftsmith.errors import DraftsmithError

SENTINEL = "DRAFTSMITHUSERTURNSENTINEL"
WORD = re.compile(r"\w+", re.UNICODE)


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
    """User texts of every built-in eval prompt set (self-written prompts that overlap them are dropped)."""
    from draftsmith.regenerate.prompts import EVAL_SETS, load_prompts

    from draftsmith.regenerate.prompts import CHAT_EVAL_FILE

    texts = []
    for name in EVAL_SETS:
        if name == "chat-eval" and not CHAT_EVAL_FILE.is_file():
            continue
        texts += [m["content"] for p in load_prompts(name, None) for m in p.messages if m["role"] == "user"]
    return texts
