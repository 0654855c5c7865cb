"""Conventions that must never drift: aux-layer ids as every engine and trainer reads them, which engine computes
which norm variant, model families.

Every other module asks this one; nothing else spells out a shift, a default or a family list.

Aux ids. draftsmith stores *boundary indices*: id b is HF `output_hidden_states[b]`, the residual
stream entering decoder layer b (0 = the embeddings, N = the last layer's output). A *layer-output*
id o names the output of decoder layer o, which is boundary o + 1. EAGLE-3's default is the boundary
triple (2, N//2, N-3), and it is what every engine captures when a drafter names no ids
(`engine_default_aux_ids`). draftsmith trains with that triple from 7 layers on; a shallower target repeats a layer
there, so it gets the nearest distinct triple instead (`default_aux_ids`), which export writes out explicitly like
every drafter's ids.

How the engines read a drafter's explicit ids (`aux_reading`). For vLLM and SGLang, *whether* a release reads
them and *where* comes from the engine facts table (`rules/engine_facts.json`, written from the released wheels
by scripts/engine_facts.py: `aux_ids_read`, `aux_ids_from_eagle_config`); only the convention is written here:

| engine   | read as             | where, when the release reads ids      | releases (facts table)                       |
|----------|---------------------|----------------------------------------|----------------------------------------------|
| vllm     | boundary            | top level; `eagle_config` where the    | none before 0.11.1 (the default is captured);|
|          |                     | table says the runner reads it         | top level only 0.11.1-0.21.0 (0.18.0         |
|          |                     |                                        | gpu_model_runner.py:4646-4652 `hasattr`);    |
|          |                     |                                        | top level, then `eagle_config` from 0.22.0   |
| sglang   | layer output (+1)   | `eagle_config` only                    | from 0.4.9 (srt/models/llama.py              |
|          |                     |                                        | set_eagle3_layers_to_capture, "we plus 1")   |
| llamacpp | boundary            | top level only (the converter)         | 0.3.36, hand-read (not in the table):        |
|          |                     |                                        | conversion/llama.py:74-82                    |

SGLang's +1 is applied per model file (some add it only when the first id is 1); `check` reads that per-file
shift from the table too (`aux_shift`). A version older than every release the table holds has no reading.

How the trainers write them (`TRAINER_CONVENTIONS`, `trainer_default`): EAGLE (SafeAILab
traineagle3/modeling_llama_kv.py) and speculators capture boundaries; SpecForge
(algorithms/model_providers.py) and ModelOpt (plugins/hf_eagle.py) hook layer outputs, with the
default [1, N//2-1, N-4] (ModelOpt: the sorted set of those), which is EAGLE-3's boundary default
shifted by one.

Norm variants (`NORMS_READ`, `unread_norms`, `unread_by_format`): the optional norms of an EAGLE-3 drafter and
which format's engine computes which; export refuses a format that would drop one, `run` picks its recipe and its
starting drafter by them, train names the engines that serve what it trains.

Drafter families (`drafter_family`, `DFLASH`): a draftsmith drafter folder names its family in the
`draftsmith.drafter` block (`"family": "dflash"`); a folder without it is the EAGLE-3 chain. DFlash keeps the
same boundary ids (`aux_layer_ids_boundary`) and writes them per consumer: vLLM's and z-lab's
`dflash_config.target_layer_ids` are layer outputs (vLLM adds 1: gpu_model_runner.py:5270-5277), speculators'
`aux_hidden_state_layer_ids` are boundaries (vLLM subtracts 1: configs/speculators/algos.py `update_dflash`),
llama.cpp's GGUF `dflash.target_layers` are boundaries (its converter adds 1: conversion/qwen.py:735-738).

Model families: `MLA_MODEL_TYPES`, `MLA_DRAFTER_ARCHITECTURES`, `TEXT_CONFIG_PATHS` (multimodal wrappers)
and `IMAGE_TOKEN_FIELDS`, each with its source below.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from draftsmith.errors import DraftsmithError

Convention = Literal["boundary", "layer-output"]
Location = Literal["top-level", "eagle_config"]
AUX_CONVENTIONS: tuple[Convention, ...] = ("boundary", "layer-output")
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
_SHIFT = {"boundary": 0, "layer-output": 1}  # boundary index = written id + shift


# ---------------------------------------------------------------- the default and its range

MIN_DEFAULT_LAYERS = 4
"""The fewest decoder layers with three distinct boundary indices in 1..N-1 (0, the embeddings, is no layer's state)."""


def engine_default_aux_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default triple (2, N//2, N-3) as boundary indices, as vLLM and SGLang compute it when a drafter
    names no ids (docs/engines.md §3.1) and as the boundary trainers (EAGLE, speculators) write it.

    Below 7 layers it repeats a layer (6: (2, 3, 3)) or leaves the range: that is still what those engines capture.
    """
    return (2, num_layers // 2, num_layers - 3)


def default_aux_ids(num_layers: int, target: str = "the target") -> tuple[int, int, int]:
    """draftsmith's default aux ids as boundary indices: EAGLE-3's (2, N//2, N-3) wherever those are distinct
    (7 layers and more); below, the middle stays N//2 and the early and late ids step away from it only as far as
    they must to be distinct (6: (2, 3, 4); 5 and 4: (1, 2, 3)).

    `target` names the target in the error a target of fewer than MIN_DEFAULT_LAYERS layers gets.
    """
    if num_layers < MIN_DEFAULT_LAYERS:
        fix = ("use a target with at least 3 decoder layers: an EAGLE-3 drafter reads three distinct hidden states"
               if num_layers < 3 else
               "name the aux ids yourself: capture's --aux-ids 0,1,2 (train's aux_ids setting, --aux-ids, online); "
               "id 0 is the embeddings, which SGLang's layer-output ids cannot name")
        raise DraftsmithError(
            f"{target} has too few decoder layers for default aux layer ids",
            got=f"{num_layers} decoder layer{'s' if num_layers != 1 else ''}",
            expected=f"at least {MIN_DEFAULT_LAYERS} layers, so that three distinct boundary indices fit in 1..N-1",
            fix=fix,
        )
    middle = num_layers // 2
    return (min(2, middle - 1), middle, max(num_layers - 3, middle + 1))


def validate_aux_ids(aux_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Check boundary-index aux ids against the target depth; returns them as a tuple."""
    bad = [i for i in aux_ids if not 0 <= i < num_layers]
    if bad or len(aux_ids) != 3 or len(set(aux_ids)) != 3:
        shallow = num_layers < MIN_DEFAULT_LAYERS
        raise DraftsmithError(
            "aux layer ids out of range",
            got=f"{list(aux_ids)} for a target with {num_layers} layers",
            expected=f"three distinct boundary indices in [0, {num_layers - 1}] (0 = embeddings, b = output of layer "
            f"b-1); {'no default at this depth' if shallow else f'default {list(default_aux_ids(num_layers))}'}",
            fix="pick ids inside the range" if shallow else
            "drop --aux-ids to use the default, or pick ids inside the range",
        )
    return tuple(aux_ids)


DFLASH_AUX_COUNT = 5
"""Target layers a DFlash drafter reads by default: z-lab's drafters read 5 (Qwen3-8B: target_layer_ids
[1, 9, 17, 25, 33] of 36 layers)."""


def default_dflash_aux_ids(num_layers: int, count: int = DFLASH_AUX_COUNT) -> tuple[int, ...]:
    """A DFlash drafter's default target layers as boundary indices: z-lab's spread, layer outputs from 1 to N-3
    evenly (round(1 + i (N-4) / (count-1))), plus 1 for boundary ids. Where that spread repeats a layer (shallow
    targets), `count` distinct ids spread evenly over 1..N-1 instead (all of them when there are fewer)."""
    if num_layers < 2:
        raise DraftsmithError("the target has too few decoder layers for a DFlash drafter",
                              got=f"{num_layers} decoder layer{'s' if num_layers != 1 else ''}",
                              expected="at least 2, so that one layer's output (boundary 1..N-1) can be read",
                              fix="use a deeper target")
    ids = tuple(round(1 + i * (num_layers - 4) / max(count - 1, 1)) + 1 for i in range(count))
    if num_layers >= 5 and len(set(ids)) == count:
        return ids
    span = list(range(1, num_layers))
    if len(span) <= count:
        return tuple(span)
    return tuple(span[round(i * (len(span) - 1) / (count - 1))] for i in range(count))


def validate_dflash_aux_ids(aux_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Check a DFlash drafter's boundary aux ids: one or more distinct layer outputs, 1..N-1."""
    if not aux_ids or len(set(aux_ids)) != len(aux_ids) or not all(1 <= i < num_layers for i in aux_ids):
        raise DraftsmithError("DFlash aux layer ids out of range", got=f"{list(aux_ids)} for a target with "
                              f"{num_layers} layers", expected=f"distinct boundary indices in [1, {num_layers - 1}] "
                              f"(b = output of layer b-1); default {list(default_dflash_aux_ids(num_layers))}",
                              fix="drop --aux-ids to use the default, or pick ids inside the range")
    return tuple(aux_ids)


# ---------------------------------------------------------------- conventions

def to_boundary(ids: list[int] | tuple[int, ...], convention: Convention) -> tuple[int, ...]:
    """Written ids in `convention` as boundary indices (layer-output o is boundary o + 1)."""
    return tuple(int(i) + _SHIFT[convention] for i in ids)


def from_boundary(boundary: tuple[int, ...], convention: Convention) -> list[int]:
    """Boundary indices as ids written in `convention`; boundary 0 (the embeddings) has no layer-output id."""
    if convention == "layer-output" and min(boundary) < 1:
        raise DraftsmithError("aux id 0 (the embeddings) cannot be written as a layer output (SGLang, SpecForge)",
                              got=f"boundary ids {list(boundary)}", expected="ids >= 1",
                              fix="train with aux ids >= 1 for SGLang deployments")
    return [b - _SHIFT[convention] for b in boundary]


# ---------------------------------------------------------------- engines

@dataclass(frozen=True)
class AuxReading:
    """How one engine, over one version range, reads a drafter config's explicit aux ids."""

    engine: str
    versions: str
    """A `packaging` specifier."""
    locations: tuple[Location, ...]
    """Where it looks, in order; ids elsewhere are ignored (then it captures the default)."""
    convention: Convention
    source: str


FACTS_TABLE = Path(__file__).parent / "data" / "rules" / "engine_facts.json"
# Engines whose reading comes from the facts table: the convention, and where they look when they read at all.
TABLE_READINGS: dict[str, tuple[Convention, tuple[Location, ...]]] = {
    "vllm": ("boundary", ("top-level", "eagle_config")),
    "sglang": ("layer-output", ("eagle_config",)),
}
# Engines the table does not cover, one row per version range.
AUX_READINGS: tuple[AuxReading, ...] = (
    AuxReading("llamacpp", "==0.3.36", ("top-level",), "boundary",
               "llama-cpp-python 0.3.36 conversion/llama.py:74-82; src/models/llama.cpp:127"),
)
ENGINES = (*TABLE_READINGS, *dict.fromkeys(r.engine for r in AUX_READINGS))
# Export formats read by an engine above: speculators configs are vLLM's to read (top level, boundary).
FORMAT_READER = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "speculators": "vllm"}


@functools.lru_cache(maxsize=1)
def facts_table() -> dict[str, dict[str, dict[str, Any]]]:
    """The engine facts table: {engine: {release: facts}} (scripts/engine_facts.py writes it from the wheels)."""
    try:
        return json.loads(FACTS_TABLE.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftsmithError("the engine facts table is unreadable", got=f"{FACTS_TABLE}: {exc}",
                              expected="the JSON that scripts/engine_facts.py writes",
                              fix="reinstall draftsmith, or re-run scripts/engine_facts.py") from exc


def table_release(engine: str, version: str | None) -> str | None:
    """The table's release that stands for `version`: itself, else the newest one at or before it (a post
    release counts for its release); the newest release for None; None when `version` is older than all."""
    rows = facts_table().get(engine, {})
    known = sorted(rows, key=Version)
    if version is None:
        return known[-1] if known else None
    if version in rows:
        return version
    want = Version(version)
    older = [v for v in known if Version(v) <= want or (Version(v).is_postrelease and Version(v).release == want.release)]
    return older[-1] if older else None


def _table_reading(engine: str, version: str | None) -> AuxReading:
    convention, where = TABLE_READINGS[engine]
    release = table_release(engine, version)
    if release is None:
        raise DraftsmithError(f"no known aux-id reading for {engine} {version}", got=str(version),
                              expected=f"a release the facts table holds (from {min(facts_table()[engine], key=Version)})",
                              fix="check a supported engine version, or re-run scripts/engine_facts.py")
    row = facts_table()[engine][release]
    reads, nested = bool(row.get("aux_ids_read")), bool(row.get("aux_ids_from_eagle_config"))
    locations = tuple(w for w in where if reads and (w != "eagle_config" or nested))
    files = ", ".join((row.get("sources") or {}).get("aux_ids") or []) or "no file reads the ids"
    return AuxReading(engine, f"=={release}", locations, convention,
                      f"engine_facts.json {engine} {release}: aux_ids_read={reads}, "
                      f"aux_ids_from_eagle_config={nested} ({files})")


def aux_reading(engine: str, version: str | None = None) -> AuxReading:
    """The reading of `engine` at `version` (None: its newest release). `locations` is empty for a release that
    reads no explicit ids (it captures its default whatever the config says)."""
    if engine in TABLE_READINGS:
        return _table_reading(engine, version)
    rows = [r for r in AUX_READINGS if r.engine == engine]
    if not rows:
        raise DraftsmithError("unknown engine for aux ids", got=repr(engine), expected=" | ".join(ENGINES),
                              fix="pick one of those")
    if version is None:
        return rows[-1]
    for row in reversed(rows):
        if SpecifierSet(row.versions).contains(Version(version), prereleases=True):
            return row
    raise DraftsmithError(f"no known aux-id reading for {engine} {version}", got=version,
                          expected=" or ".join(r.versions for r in rows),
                          fix="check a supported engine version, or add its row to conventions.AUX_READINGS")


def find_aux_ids(config: dict[str, Any], locations: tuple[Location, ...] = ("top-level", "eagle_config"),
                 ) -> tuple[list[int] | None, Location | None]:
    """The first non-empty explicit ids in a drafter config.json among `locations`, and where they were."""
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    for where in locations:
        ids = config.get(AUX_KEY) if where == "top-level" else eagle.get(AUX_KEY)
        if ids:
            return [int(i) for i in ids], where
    return None, None


def engine_reads(config: dict[str, Any], num_layers: int, engine: str,
                 version: str | None = None) -> tuple[int, ...]:
    """The boundary indices `engine` captures for a drafter config.json (its default when it finds no ids)."""
    reading = aux_reading(engine, version)
    ids, _ = find_aux_ids(config, reading.locations)
    if ids:  # vLLM reads explicit EAGLE ids before a DFlash drafter's own (gpu_model_runner.py, DFlash aux layers)
        return to_boundary(ids, reading.convention)
    return dflash_config_boundary(config) or engine_default_aux_ids(num_layers)


def dflash_config_boundary(config: dict[str, Any]) -> tuple[int, ...] | None:
    """A DFlash drafter config's `dflash_config.target_layer_ids` as boundary ids (None without them)."""
    dflash = config.get("dflash_config")
    ids = dflash.get("target_layer_ids") if isinstance(dflash, dict) else None
    return dflash_boundary(ids) if ids else None


def engine_aux_ids(config: dict[str, Any], num_layers: int, reader: str) -> tuple[int, ...]:
    """The boundary indices a drafter config.json gets from `reader`: an engine, or `trained` (the ids it
    was trained with: the draftsmith record, else its explicit ids as boundaries, else the trainers' default)."""
    if reader != "trained":
        return engine_reads(config, num_layers, reader)
    recorded = (config.get("draftsmith") or {}).get("aux_layer_ids_boundary")
    ids, _ = find_aux_ids(config)
    return tuple(recorded or ids or dflash_config_boundary(config) or engine_default_aux_ids(num_layers))


def aux_ids_for_format(boundary: tuple[int, ...], fmt: str) -> list[int]:
    """The explicit ids to write so that the engine reading `fmt` captures `boundary`."""
    if fmt not in FORMAT_READER:
        raise DraftsmithError("unknown engine convention", got=fmt, expected=" | ".join(FORMAT_READER),
                              fix="pick one of those")
    return from_boundary(tuple(boundary), aux_reading(FORMAT_READER[fmt]).convention)


# ---------------------------------------------------------------- trainers

TRAINER_CONVENTIONS: dict[str, Convention] = {
    "draftsmith": "boundary",  # recorded in the config's draftsmith block as aux_layer_ids_boundary
    "eagle": "boundary",  # SafeAILab/EAGLE traineagle3/modeling_llama_kv.py: before layer idx
    "speculators": "boundary",  # vllm-project/speculators models/utils.py; vLLM reads them as is
    "specforge": "layer-output",  # sgl-project/SpecForge algorithms/model_providers.py
    "modelopt": "layer-output",  # NVIDIA/Model-Optimizer plugins/hf_eagle.py: hooks on decoder-layer outputs
}


def trainer_default(trainer: str, num_layers: int) -> list[int]:
    """The ids a trainer writes when told none, in its own convention."""
    if TRAINER_CONVENTIONS[trainer] == "boundary":
        return list(engine_default_aux_ids(num_layers))
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    return sorted(set(ids)) if trainer == "modelopt" else ids


def infer_boundary(ids: list[int], num_layers: int) -> tuple[int, ...] | None:
    """Boundary indices for written ids of unknown origin, when they are a default form; None otherwise."""
    if list(ids) == list(engine_default_aux_ids(num_layers)):
        return tuple(ids)
    if list(ids) == trainer_default("specforge", num_layers):
        return to_boundary(ids, "layer-output")
    return None


# ---------------------------------------------------------------- norm variants

NORM_VARIANTS = ("norm_before_fc", "norm_before_residual", "norm_output")
"""The optional norms of an EAGLE-3 drafter (DrafterConfig's fields of those names): which engine computes which
is NORMS_READ; which a recipe trains, train.settings.RECIPES."""

# Norm variants each format's engine computes (others it computes as False, silently: a drafter trained with
# them then drafts from other numbers and accepts little). vLLM's llama_eagle3 reads all three (0.32.0 source);
# SGLang's llama_eagle3 none (docs/engines.md §2.4); llama.cpp's eagle3 graph norm_before_fc and
# norm_before_residual (rules/llamacpp.yaml `norm_flags_read`).
NORMS_READ = {"vllm": NORM_VARIANTS, "speculators": NORM_VARIANTS, "sglang": (),
              "llamacpp": ("norm_before_fc", "norm_before_residual")}


def unread_norms(flags: dict, fmt: str) -> list[str]:
    """The norm variants set in `flags` (a drafter config, or a training layout) that fmt's engine does not compute."""
    return [f for f in NORM_VARIANTS if flags.get(f) and f not in NORMS_READ.get(fmt, ())]


def unread_by_format(drafter_dir: Path, formats: tuple[str, ...]) -> dict[str, list[str]]:
    """For each of `formats` whose engine would not compute some of the saved drafter's norm variants, those
    variants (formats that compute them all are left out): what `run` asks of a starting drafter."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    norms = (config.get("draftsmith") or {}).get("drafter") or config  # as model.checkpoint.drafter_block reads it
    return {fmt: unread for fmt in formats if (unread := unread_norms(norms, fmt))}


# ---------------------------------------------------------------- model families

# Text model types with multi-head latent attention: the DeepSeek / Kimi members of vLLM's
# `is_deepseek_mla` list (vllm 0.18.0 transformers_utils/model_arch_config_convertor.py:232-245; 0.33.0
# :328-342), plus `kimi_k3` (Kimi K3's text model, MLA, not in vLLM's list yet). vLLM's list also names
# deepseek_mtp, kimi_linear, longcat_flash and pangu_ultra_moe(_mtp); describe_target counts those as
# MLA through `kv_lora_rank`, which vLLM requires for every member anyway.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k3")
# EAGLE-3 drafters with MLA attention (vllm registry.py: deepseek_eagle3; sglang srt/models/kimi_k25_eagle3.py).
MLA_DRAFTER_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# Where multimodal wrappers keep the language model's config (Kimi-K2.5 `text_config`, DeepSeek-VL
# `language_config`, InternVL `llm_config`); Qwen2.5-Omni / Qwen3-Omni one level deeper, in the thinker that the
# engines serve (vllm transformers_utils/config.py get_hf_text_config: thinker_config.text_config).
TEXT_CONFIG_PATHS = (("text_config",), ("language_config",), ("llm_config",), ("thinker_config", "text_config"))
# Image-token attributes the engines' drafter loaders probe on multimodal targets (docs/engines.md §1.6).
IMAGE_TOKEN_FIELDS = ("image_token_index", "image_token_id", "media_placeholder_token_id")


# ---------------------------------------------------------------- drafter families

EAGLE3 = "eagle3"
DFLASH = "dflash"
DRAFTER_FAMILIES = (EAGLE3, DFLASH)


def drafter_family(config: dict[str, Any]) -> str:
    """The family of a drafter config.json: its `draftsmith.drafter.family`, else `dflash` for a DFlash layout
    (vLLM / z-lab `DFlashDraftModel`, speculators `dflash`), else the EAGLE-3 chain."""
    block = (config.get("draftsmith") or {}).get("drafter") or {}
    if isinstance(block, dict) and block.get("family"):
        return str(block["family"])
    archs = config.get("architectures") or []
    if config.get("speculators_model_type") == DFLASH or any(str(a).startswith("DFlash") for a in archs):
        return DFLASH
    return EAGLE3


def dflash_target_layer_ids(boundary: tuple[int, ...] | list[int]) -> list[int]:
    """Boundary ids as DFlash's `target_layer_ids` (vLLM / z-lab): layer-output ids, boundary - 1."""
    return from_boundary(tuple(boundary), "layer-output")


def dflash_boundary(target_layer_ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """DFlash's `target_layer_ids` (layer outputs) as boundary ids, + 1."""
    return to_boundary(list(target_layer_ids), "layer-output")
