"""The one config system: frozen pydantic models whose field docstrings are `--help` and the docs' key table.

Every verb's settings and every `run` section is a `Settings` model. YAML files, dotted overrides
(`train.lr=3e-4`) and command-line flags all go through the model: values are converted to the field's
type, unknown keys are refused with a did-you-mean, and every problem is reported in one DraftsmithError.

    from_mapping(RunConfig, yaml.safe_load(text))     # a model from nested key: value pairs
    override(cfg, "train.lr=3e-4")                   # a new model with one dotted key changed
    add_flags(parser, TrainConfig)                   # --lr, --no-pack, ... with the field docs as help
    key_table(TrainStage)                            # the markdown table docs/run.md embeds

Numeric bounds are field constraints (`save_every: int = Field(100, ge=1)`, `Count` for a tuple's items), so every
entry point gets them; a value out of bounds is named with the bound, by its flag on the command line.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import json
import re
import types
import typing
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model, field_validator
from pydantic.fields import FieldInfo

from draftsmith.errors import DraftsmithError

EXAMPLE_VALUES = {int: "4", float: "3e-4", str: "text", bool: "true"}  # for "bad value" messages
JSON_FLAG = {"as_json": "--json"}  # a verb's `as_json` field is its --json flag (`json` is a BaseModel method)
FLAG_NAMES = "flag_names"  # the parsed arguments' field -> flag map (`add_flags`), for `from_flags`'s messages
BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
          "less_than": ("lt", "<")}  # pydantic's error type: its context key and the bound as written
Count = Annotated[int, Field(ge=1)]
"""A tuple item that counts something (`k: tuple[Count, ...]`): at least 1."""


class Settings(BaseModel):
    """Base of every settings model: frozen, unknown keys refused, attribute docstrings as field docs."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True,
                              coerce_numbers_to_str=True, validate_default=False,
                              allow_inf_nan=False)  # `--lr inf` trained a drafter of inf weights and said it worked

    @field_validator("*", mode="before")
    @classmethod
    def _command_line_forms(cls, value: Any, info) -> Any:
        """`a,b,c` (or one scalar) for a tuple field; `none` for an optional field."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, str) and value.lower() in ("none", "null") and is_optional(annotation):
            return None
        if tuple in (typing.get_origin(annotation), *map(typing.get_origin, typing.get_args(annotation))):
            if isinstance(value, str):
                return tuple(x.strip() for x in value.split(",") if x.strip())
            if not isinstance(value, (list, tuple, type(None), dict)):
                return (value,)
        return value


def is_optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def base_type(annotation: Any) -> Any:
    """`int | None` -> int, `tuple[int, ...]` -> tuple."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return base_type(args[0])
    return typing.get_origin(annotation) or annotation


def item_type(annotation: Any) -> Any:
    """`tuple[int, ...]` (optional or not) -> int."""
    for a in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(a) is tuple:
            return typing.get_args(a)[0]
    return str


def choices(annotation: Any) -> tuple:
    """The values a Literal or Enum field allows (through Optional), else ()."""
    kind = base_type(annotation)
    if kind is typing.Literal:
        return typing.get_args(next(a for a in (annotation, *typing.get_args(annotation))
                                    if typing.get_origin(a) is typing.Literal))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return tuple(m.value for m in kind)
    return ()


def describe(annotation: Any) -> str:
    if allowed := choices(annotation):
        return "one of " + ", ".join(map(str, allowed))
    if base_type(annotation) is tuple:  # as the command line and dotted overrides take it
        each = item_bounds(annotation)
        return f"a comma list of {describe(item_type(annotation))}" + (f" (each {each})" if each else "")
    text = str(annotation).replace("typing.", "") if not isinstance(annotation, type) else annotation.__name__
    return re.sub(r"Annotated\[(\w+), [^\]]*\]", r"\1", text)


def bounds(field: FieldInfo) -> str:
    """A field's numeric bounds as written in the key table and --help: `>= 1`, `> 0, <= 1`, `each >= 1`."""
    own = bound_text(field.metadata)
    items = item_bounds(field.annotation)
    return own or (f"each {items}" if items else "")


def bound_text(metadata: list) -> str:
    return ", ".join(f"{op} {on_command_line(getattr(m, key))}" for m in metadata
                     for key, op in BOUNDS.values() if getattr(m, key, None) is not None)


def item_bounds(annotation: Any) -> str:
    """The bounds an annotation's nested `Annotated[..., Field(...)]` carries (a tuple's items)."""
    for arg in typing.get_args(annotation):
        found = bound_text(arg.metadata) if isinstance(arg, FieldInfo) else item_bounds(arg)
        if found:
            return found
    return ""


# ---------------------------------------------------------------- mappings and dotted overrides


def section_of(cls: type[Settings], loc: tuple) -> type[Settings]:
    """The model that owns the key at `loc` (the nested section for `("train", "lrr")`)."""
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part))
        nested = field and base_type(field.annotation)
        if not (isinstance(nested, type) and issubclass(nested, Settings)):
            break
        cls = nested
    return cls


def unknown_key(key: str, known: list[str]) -> DraftsmithError:
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, known, n=1)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    return DraftsmithError(f"unknown config key {key}", got=key, expected=", ".join(prefix + k for k in known),
                           fix=f"did you mean {prefix}{close[0]}?" if close else "check the key (docs/run.md)")


def problem(cls: type[Settings], err: dict, flags: dict[str, str] | None = None) -> DraftsmithError:
    """One pydantic error as what / got / expected / fix; with `flags` (field -> flag) a value out of bounds is
    named by its flag, as the command line spelled it."""
    loc = tuple(p for p in err["loc"] if not isinstance(p, int))
    key = ".".join(map(str, loc))
    owner = section_of(cls, loc)
    if err["type"] == "extra_forbidden":
        return unknown_key(key, list(owner.model_fields))
    if err["type"] == "model_type" or err["type"] == "dict_type":
        return DraftsmithError(f"config section {key or 'root'} is not a mapping", got=repr(err["input"])[:80],
                               expected="key: value pairs", fix="check the YAML indentation")
    field = owner.model_fields.get(str(loc[-1])) if loc else None
    if field is None:  # a model-level check (a validator naming its own keys)
        return DraftsmithError("bad config", got=err["msg"].removeprefix("Value error, "),
                               expected="the values named above", fix="fix those keys (docs/run.md lists every key)")
    if err["input"] is None:
        return DraftsmithError(f"{key} cannot be null", got="null", expected=describe(field.annotation),
                               fix=f"give {key} a value")
    flag = None if flags is None else flags.get(key, "--" + key.replace("_", "-"))
    if err["type"] in BOUNDS:
        return out_of_bounds(flag or key, field, err["input"], flag is not None)
    expected = describe(field.annotation)
    if err["type"] == "finite_number":
        expected = "a finite number" + (f" {bounds(field)}" if bounds(field) else "")
    return DraftsmithError(f"bad value for {flag or key}", got=repr(err["input"]), expected=expected,
                           fix=example_fix(flag or key, field, flag is not None))


def example_fix(key: str, field: FieldInfo, flag: bool) -> str:
    """`e.g. KEY VALUE` (a flag) or `e.g. key=value`, the value valid for the field: its default, a bound, a choice
    or its type's example; `pass a value ...` when none is."""
    candidates = (field.default, *choices(field.annotation), *bound_values(field),
                  EXAMPLE_VALUES.get(base_type(field.annotation), "1"))
    example = next((v for v in candidates if v not in (None, ()) and within(v, field)), None)
    if example is None:
        return f"pass a value {bounds(field)}"
    return f"e.g. {key} {on_command_line(example)}" if flag else f"e.g. {key}={on_command_line(example)}"


def out_of_bounds(key: str, field: FieldInfo, value: Any, flag: bool) -> DraftsmithError:
    """A value past its field's bounds: the key (or flag), the value, the bounds, an example inside them and, for
    an optional field, its null and what null means (the field doc's `null: ...`)."""
    rule, null = bounds(field), "none" if flag else "null"
    fix = example_fix(key, field, flag)
    expected = f"{key} {rule}"
    if is_optional(field.annotation):
        means = re.search(r"null: (.+?)(?=\)|[.;](?:\s|$)|$)", " ".join((field.description or "").split()))
        expected += f", or {null}" + (f" ({means.group(1)})" if means else "")
        fix += f", or {key} {null}" if flag else f", or {key}={null}"
    return DraftsmithError(f"{key} out of range", got=repr(value), expected=expected, fix=fix)


def bound_values(field: FieldInfo) -> list:
    """The inclusive bounds of a field (`ge`, `le`): an example that satisfies them where the default does not."""
    return [getattr(m, k) for m in field.metadata for k in ("ge", "le") if getattr(m, k, None) is not None]


def within(value: Any, field: FieldInfo) -> bool:
    """`value` (or each item of a tuple) inside the field's bounds."""
    try:
        TypeAdapter(Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
                    ).validate_python(value)
    except (ValidationError, TypeError, ValueError):
        return False
    return True


def from_mapping(cls: type[Settings], data: Any, **fixed: Any) -> Settings:
    """`cls` from nested key: value pairs (YAML, JSON), every problem in one DraftsmithError."""
    return validated(cls, data, None, **fixed)


def validated(cls: type[Settings], data: Any, flags: dict[str, str] | None, **fixed: Any) -> Settings:
    """`cls` from `data`, every problem in one DraftsmithError naming keys (or, with `flags`, flags)."""
    if not isinstance(data, dict):
        raise DraftsmithError("config section root is not a mapping", got=repr(data)[:80],
                              expected="key: value pairs", fix="check the YAML indentation")
    try:
        return cls.model_validate({**data, **fixed})
    except ValidationError as exc:
        errors = [problem(cls, e, flags) for e in exc.errors()]
    if len(errors) == 1:
        raise errors[0]
    raise DraftsmithError(errors[0].what, got="; ".join(e.what + (f" ({e.got})" if e.got else "") for e in errors),
                          expected="every key valid", fix=errors[0].fix)


def override(cfg: Settings, *dotted: str) -> Settings:
    """`section.key=value` (or `key=value` at top level) overrides on a frozen config, through the model: all of
    them are set, then the model checks them together (train.family=dflash with train.mask_token_id=16 in either
    order)."""
    data = cfg.model_dump()
    for one in dotted:
        set_dotted(data, type(cfg), one)
    return from_mapping(type(cfg), data)


def set_dotted(data: dict, cls: type[Settings], dotted: str) -> None:
    """One `section.key=value` into `data`, a dump of `cls`; the key is checked against the model's fields."""
    if "=" not in dotted:
        raise DraftsmithError("bad override", got=dotted, expected="section.key=value", fix="e.g. train.lr=3e-4")
    key, text = dotted.split("=", 1)
    value = yaml.safe_load(text) if text.strip() else ""
    *sections, name = key.split(".")
    node, owner = data, cls
    for i, part in enumerate(sections):
        nested = owner.model_fields.get(part)
        nested_cls = nested and base_type(nested.annotation)
        if not (isinstance(nested_cls, type) and issubclass(nested_cls, Settings)):
            raise unknown_key(".".join(sections[: i + 1]), [k for k, f in owner.model_fields.items()
                                                           if is_section(f)])
        node, owner = node[part], nested_cls
    if name not in owner.model_fields or is_section(owner.model_fields[name]):
        raise unknown_key(key, [k for k, f in owner.model_fields.items() if not is_section(f)])
    node[name] = value


def is_section(field: FieldInfo) -> bool:
    nested = base_type(field.annotation)
    return isinstance(nested, type) and issubclass(nested, Settings)


def check_choices(*checks: tuple[str, Any, tuple]) -> None:
    """Refuse the first value not among its choices, naming the flag: `("--dtype", "fp8", ("float32", ...))`."""
    for flag, value, allowed in checks:
        if value not in allowed:
            raise DraftsmithError(f"unknown {flag}", got=str(value), expected=" | ".join(allowed),
                                  fix=f"pass {flag} {allowed[0]}")


def with_defaults(cls: type[Settings], name: str, doc: str, **defaults: Any) -> type[Settings]:
    """`cls` with other defaults for some fields (same keys, types and docs): for `run`'s sections where
    the pipeline's default differs from the verb's on purpose, written once, next to the reason (the fields keep
    their bounds)."""
    fields = {k: (cls.model_fields[k].annotation, FieldInfo.merge_field_infos(cls.model_fields[k], default=v))
              for k, v in defaults.items()}
    return create_model(name, __base__=cls, __doc__=doc, __module__=cls.__module__, **fields)


# ---------------------------------------------------------------- a resume against the settings it continues


def changed(recorded: dict, now: dict) -> dict[str, tuple[Any, Any]]:
    """key -> (recorded, now) for each key of `now` that `recorded` holds with another value, compared as JSON
    stores them (tuples are lists). A key the record lacks is not compared."""
    now = json.loads(json.dumps(now))
    return {k: (recorded[k], v) for k, v in now.items() if k in recorded and recorded[k] != v}


def shown_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """`lr 0.003 -> 0.001; seed 0 -> 1`."""
    return "; ".join(f"{k} {json.dumps(old)} -> {json.dumps(new)}" for k, (old, new) in changes.items())


def as_flags(values: dict[str, Any], flags: dict[str, str] | None = None) -> str:
    """Values as the command line takes them: `--lr 0.003 --no-pack --aux-ids 2,15,27`."""
    out = []
    for key, value in values.items():
        flag = (flags or {}).get(key, "--" + key.replace("_", "-"))
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            out.append(f"{flag} none")
        else:
            out.append(f"{flag} {on_command_line(tuple(value) if isinstance(value, list) else value)}")
    return " ".join(out)


# ---------------------------------------------------------------- --help and the docs' key table


def doc_of(field: FieldInfo) -> str:
    return " ".join((field.description or "").split())


def example_help(text: str) -> dict:
    """Keyword arguments for `add_parser` that keep the example's line breaks in --help."""
    return {"epilog": text, "formatter_class": argparse.RawDescriptionHelpFormatter}


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type[Settings], *,
              skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None, required: tuple[str, ...] = (),
              helps: dict[str, str] | None = None, flags: dict[str, str] | None = None,
              positional: tuple[str, ...] = ()) -> None:
    """One `--flag` per field of `cls`, its docstring (and default) as help; bools get `--no-flag`.

    Values stay as typed on the command line where the model converts them (`--aux-ids 2,15,27`).
    `only` limits the fields (one argument group at a time); `flags` spells a field's flag otherwise
    (`{"timeout_s": "--timeout"}`); `positional` names required fields taken by position (`diagnose LOG`),
    in field order. A repeatable flag (`--endpoint A --endpoint B`) is not made here: skip
    its field and add an `append` flag with `dest` the field's name and `help=doc_of(field)`."""
    named = {**(parser.get_default(FLAG_NAMES) or {}), **JSON_FLAG, **(flags or {}), **{n: n for n in positional}}
    parser.set_defaults(**{FLAG_NAMES: named})  # argument groups share their parser's defaults
    for name, field in cls.model_fields.items():
        if name in skip or (only is not None and name not in only):
            continue
        flag, doc = (flags or {}).get(name, "--" + name.replace("_", "-")), (helps or {}).get(name, doc_of(field))
        kind = base_type(field.annotation)
        if name in positional:
            parser.add_argument(name, type=kind if kind in (int, float) else None, help=doc)
            continue
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=field.default,
                                help=doc)
            continue
        must = name in required or field.is_required()
        if field.default not in (None, "", ()) and not must:
            doc += f" (default {on_command_line(field.default)})"
        if bounds(field):
            doc += f" [{bounds(field)}]"
        convert = kind if kind in (int, float) else None
        parser.add_argument(flag, dest=name, type=convert, default=None if field.is_required() else field.default,
                            required=must, help=doc)


def from_flags(cls: type[Settings], args: argparse.Namespace, **fixed: Any) -> Settings:
    """The model from parsed `add_flags` arguments; a bad value is named by its flag."""
    return validated(cls, {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)},
                     getattr(args, FLAG_NAMES, None) or {}, **fixed)


def on_command_line(value: Any) -> str:
    """A default as the flag takes it: `1,4,16` for a tuple."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def shown(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return "`" + (yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()) + "`"


def key_table(cls: type[Settings], prefix: str = "") -> str:
    """The markdown key table of a model: key, default, bounds, meaning; a section's keys as `section.key`."""
    rows = ["| key | default | bounds | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        if is_section(field):
            rows += key_table(base_type(field.annotation), f"{prefix}{name}.").splitlines()[2:]
        else:
            meaning = doc_of(field).replace("|", "\\|")
            rows.append(f"| `{prefix}{name}` | {shown(field.default)} | {bounds(field)} | {meaning} |")
    return "\n".join(rows)
