"""The rules `draftsmith check` evaluates: one YAML file per engine (`rules/<engine>.yaml`), validated against the
models below, each rule a condition over the facts (`facts.gather_facts`) with the engine versions it applies to.

A finding is one line of check's report; `evaluate` turns a rule book and the facts into findings.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from draftsmith.errors import DraftsmithError

Severity = Literal["error", "warning", "ok"]


SEVERITY_ORDER = {"error": 0, "warning": 1, "ok": 2}


RULES_DIR = Path(__file__).parents[1] / "data" / "rules"


Kind = Literal["start", "serve", "accept"]


KINDS: tuple[str, ...] = get_args(Kind)
"""What an error finding costs: the server does not come up; it comes up and its engine dies on the first
request (nothing the start-up warm-up runs trips it); it comes up, serves, and accepts little."""


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    severity: Severity
    rule: str
    message: str
    fix: str
    source: str
    why: str = ""
    engine_text: str = ""
    """What the engine prints when this bites; empty for silent failures."""
    kind: str = "start"
    """`start` (the server will not come up), `serve` (it comes up and its engine dies on the first
    request) or `accept` (it comes up and accepts little); see KINDS."""


Op = Literal["eq", "ne", "in", "not_in", "lt", "gt", "contains_any", "contains_none", "is_true", "is_false",
             "present", "absent"]


UNARY_OPS = ("is_true", "is_false", "present", "absent")


_STRICT = ConfigDict(frozen=True, extra="forbid")


class Clause(BaseModel):
    """`{fact, op, value | other}`: compare a fact with a constant or with another fact."""

    model_config = _STRICT
    fact: str
    op: Op
    value: Any = None
    other: str | None = None

    @model_validator(mode="after")
    def _operand(self) -> Clause:
        has = "value" in self.model_fields_set or self.other is not None
        if (self.op in UNARY_OPS) == has:
            want = "no value and no other" if self.op in UNARY_OPS else "a value or another fact"
            raise ValueError(f"op {self.op!r} takes {want}")
        return self


class AnyOf(BaseModel):
    model_config = _STRICT
    any: list[Condition]


class AllOf(BaseModel):
    model_config = _STRICT
    all: list[Condition]


Condition = Clause | AnyOf | AllOf
AnyOf.model_rebuild()
AllOf.model_rebuild()


class Rule(BaseModel):
    """One entry of `rules/<engine>.yaml` (the header comment of each file explains the fields)."""

    model_config = _STRICT
    id: str
    versions: str = ""
    severity: Literal["error", "warning"]
    kind: Kind = "start"
    when: list[Condition]
    message: str
    fix: str
    source: str
    why: str = ""
    engine_text: str | None = None
    """What the engine prints when this bites; null for silent failures."""
    ok: str | None = None
    """Message when the rule applies and its condition does not hold (shown as an `ok` row)."""

    @field_validator("message", "fix", "source", "why")
    @classmethod
    def _strip(cls, v: str) -> str:
        return v.strip()

    @field_validator("versions")
    @classmethod
    def _specifier(cls, v: str) -> str:
        SpecifierSet(v)  # raises InvalidSpecifier, reported with the rule's position
        return v


class RuleBook(BaseModel):
    """One `rules/<engine>.yaml`: the rules and the version tables the facts are computed from."""

    model_config = _STRICT
    engine: str
    default_version: str
    rules: list[Rule]
    tables: dict[str, Any] = {}
    """Version tables the facts are computed from (targets with EAGLE-3 support, probes, ...)."""


def load_rules(engine: str, family: str = "eagle3") -> RuleBook:
    """Parse `rules/<engine>.yaml` (another drafter family: `rules/<engine>-<family>.yaml`) and validate it against
    `RuleBook`; every problem is reported at once."""
    path = RULES_DIR / (f"{engine}.yaml" if family == "eagle3" else f"{engine}-{family}.yaml")
    try:
        return RuleBook.model_validate({**(yaml.safe_load(path.read_text()) or {}), "engine": engine})
    except ValidationError as exc:
        problems = "; ".join(f"{_where(err['loc'])}: {err['msg']}" for err in exc.errors())
        raise DraftsmithError(f"{path.name} does not match the rule schema", got=problems,
                              expected="rules as documented at the top of the file (rulebook.Rule)",
                              fix=f"correct {path}") from exc


def _where(loc: tuple) -> str:
    """A pydantic error location as `rules[3].when[0].op`."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def version_in(spec: str | SpecifierSet, version: str) -> bool:
    """`version` satisfies a `packaging` specifier (pre-releases count)."""
    return SpecifierSet(str(spec)).contains(Version(version), prereleases=True)


def holds(clause: Condition, facts: dict[str, Any]) -> bool:
    """Evaluate one condition clause: {fact, op, value | other} or {any: [...]} or {all: [...]}."""
    if isinstance(clause, AnyOf):
        return any(holds(c, facts) for c in clause.any)
    if isinstance(clause, AllOf):
        return all(holds(c, facts) for c in clause.all)
    got = facts.get(clause.fact)
    want = facts.get(clause.other) if clause.other is not None else clause.value
    op = clause.op
    if op in ("present", "absent"):
        return (got is not None and got != []) == (op == "present")
    if got is None:  # comparisons with an unknown fact never fire
        return False
    ops = {
        "eq": lambda: got == want, "ne": lambda: want is not None and got != want,
        "in": lambda: want is not None and got in want, "not_in": lambda: want is not None and got not in want,
        "lt": lambda: want is not None and got < want, "gt": lambda: want is not None and got > want,
        "contains_any": lambda: any(s in str(got) for s in want),
        "contains_none": lambda: not any(s in str(got) for s in want),
        "is_true": lambda: got is True, "is_false": lambda: got is False,
    }
    return ops[op]()


def evaluate(book: RuleBook, facts: dict[str, Any], version: str) -> list[Finding]:
    """Every rule that applies at `version`: a finding when its condition holds, else its `ok` row."""
    out = []
    for rule in book.rules:
        if not version_in(rule.versions, version):
            continue
        fired = all(holds(c, facts) for c in rule.when)
        if not fired and (not rule.ok or any(facts.get(name) is None for name in _fact_names(rule.when))):
            continue  # no ok row for a rule whose facts are unknown (e.g. no weights to read)
        text = rule.message if fired else rule.ok
        out.append(Finding(severity=rule.severity if fired else "ok", rule=rule.id,
                           message=text.format_map(_Facts(facts)), fix=rule.fix.format_map(_Facts(facts)) if fired else "",
                           source=rule.source, why=rule.why if fired else "",
                           engine_text=(rule.engine_text or "").format_map(_Facts(facts)) if fired else "",
                           kind=rule.kind))
    return out


def _fact_names(clauses: list[Condition]) -> list[str]:
    names: list[str] = []
    for c in clauses:
        if isinstance(c, (AnyOf, AllOf)):
            names += _fact_names(c.any if isinstance(c, AnyOf) else c.all)
        else:
            names += [c.fact] + ([c.other] if c.other is not None else [])
    return names


def referenced_facts(rule: Rule) -> set[str]:
    """Every fact a rule names: in its conditions and in the {placeholders} of its texts."""
    texts = (rule.message, rule.fix, rule.ok or "", rule.engine_text or "")
    return set(_fact_names(rule.when)) | {name for text in texts for _, name, _, _ in string.Formatter().parse(text)
                                          if name}


class _Facts(dict):
    """format_map helper: unknown facts render as `?` instead of raising."""

    def __missing__(self, key: str) -> str:
        return "?"
