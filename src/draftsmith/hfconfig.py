"""Hugging Face configs read the way the engines read them: a config.json file checked to be a JSON object, the
fields it omits filled from its transformers config class (the engines load configs through AutoConfig), GPT-2-style
aliases, and SGLang's own reading of a context length.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from draftsmith.conventions import TEXT_CONFIG_PATHS
from draftsmith.errors import DraftsmithError
from draftsmith.files import read_json


def read_dir_config(path: Path) -> dict[str, Any]:
    """The config.json of a model folder (a target or a drafter), a JSON object."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise DraftsmithError("no config.json", got=str(path), expected="a Hugging Face model directory",
                              fix="point the flag at the folder that holds config.json")
    return read_json(cfg, "model config", fix="re-download config.json (a Git LFS pointer or an HTML error page is "
                     "not a config)")


# Hugging Face configs that name the common fields through `attribute_map` aliases (transformers
# models/gpt2/configuration_gpt2.py: GPT2Config.attribute_map; the same names in GPT-J, Bloom-era configs).
HF_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
              "n_positions": "max_position_embeddings", "num_layers": "num_hidden_layers"}
"""Other names of standard fields: GPT-2's, and `num_layers` (LongCat-Flash, ChatGLM), which SGLang's own config
classes read as num_hidden_layers (sglang/srt/configs/longcat_flash.py)."""


def with_standard_names(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with hidden_size & co. filled in from their aliases (HF_ALIASES) where only those exist."""
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


def nested(config: dict[str, Any], path: tuple[str, ...]) -> Any:
    """`config[path[0]][path[1]]...`, or None where a level is missing or not a dict."""
    node: Any = config
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def text_config_path(config: dict[str, Any], needs: str | None = None) -> tuple[str, ...] | None:
    """Where a multimodal wrapper keeps its language model's config (the first of `TEXT_CONFIG_PATHS` that holds a
    dict, with the field `needs` when given); None for a plain config."""
    return next((p for p in TEXT_CONFIG_PATHS if isinstance(nested(config, p), dict)
                 and (needs is None or needs in nested(config, p))), None)


def _with_nested(config: dict[str, Any], path: tuple[str, ...], value: dict[str, Any]) -> dict[str, Any]:
    if len(path) == 1:
        return {**config, path[0]: value}
    return {**config, path[0]: _with_nested(config[path[0]], path[1:], value)}


def with_class_defaults(config: dict[str, Any], fields: tuple[str, ...] = DEFAULTED_FIELDS) -> dict[str, Any]:
    """`config` with the missing `fields` (top level and in a multimodal wrapper's text config) filled the way
    its transformers config class fills them; a config that names every field is returned as is (no import)."""
    path = text_config_path(config)
    part = nested(config, path) if path else config
    if all(f in part for f in fields[:3]) and (path or all(f in config for f in fields)):
        return config
    built = built_by_class(config)
    if path:
        inner = nested(built, path)
        own = inner if isinstance(inner, dict) and inner else (built_by_class(part) if part.get("model_type") else {})
        filled = {f: own[f] for f in fields if own.get(f) is not None}
        return _with_nested(config, path, {**filled, **part})
    return {**{f: built[f] for f in fields if built.get(f) is not None}, **config}


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
