"""The facts `draftsmith check` evaluates its rules against: one flat dict per deployment, computed from the
target's and the drafter's config.json files, tokenizer file names and safetensors headers (never weight data),
the engine flags, and the engine release's row of the facts table (rules/engine_facts.json, read out of the wheels
by scripts/engine_facts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from packaging.version import Version

from draftsmith.conventions import (
    MLA_DRAFTER_ARCHITECTURES,
    MLA_MODEL_TYPES,
    aux_ids_for_format,
    aux_reading,
    engine_default_aux_ids,
    engine_reads,
    facts_table,
    find_aux_ids,
    infer_boundary,
    table_release,
)
from draftsmith.preflight.engineflags import gpu_compute_capability, int_or_none, vllm_draft_arch, guess_vllm_method
from draftsmith.hfconfig import (
    DRAFTER_DEFAULTED,
    config_attribute,
    nested,
    read_dir_config,
    sglang_context_length,
    text_config_path,
    with_class_defaults,
    with_standard_names,
)
from draftsmith.preflight.rulebook import RuleBook, version_in
from draftsmith.preflight.safetensors_header import ModelTensors, read_model_tensors
from draftsmith.target import describe_target, text_config_of

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "tokenizer_config.json")


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
    uses_aux_hidden_state: bool = True
    """`eagle_config.use_aux_hidden_state` (vLLM reads it there: requires_aux_hidden_states); false for a head
    trained on the target's last hidden state alone."""


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
        uses_aux_hidden_state=eagle.get("use_aux_hidden_state", True) is not False,
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
        "engine_d2t_full_vocab_unloadable": get("d2t_full_vocab_unloadable"),
        "engine_kv_mixed_page_groups": get("kv_mixed_page_groups"), "engine_spec_v2_topk": get("spec_v2_topk"),
        "engine_mrope_propose_reads_positions": get("mrope_propose_reads_positions"),
        "engine_aux_forced_runners": get("aux_forced_runners"), "engine_mrv2_default": get("mrv2_default"),
        "engine_fc_aux_count": get("fc_aux_count"), "engine_draft_layer_kv_config": get("draft_layer_kv_config"),
        "engine_layer_types_unshifted": get("layer_types_unshifted"),
        "engine_aux_unpacked_twice": get("aux_unpacked_twice"), "engine_capture_ignored_archs": get("capture_ignored_archs"),
    }


def version_table(entries: list[dict], version: str, key: str) -> set:
    """Union of `key` lists over the table rows whose `versions` include `version` (cumulative tables)."""
    out: set = set()
    for row in entries:
        if version_in(row["versions"], version):
            out |= set(row[key])
    return out


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


def target_facts(path: Path, book: RuleBook, version: str, rf: dict[str, Any]) -> dict[str, Any]:
    config = with_class_defaults(with_standard_names(read_dir_config(path)))
    spec = describe_target(config)
    tensors = read_model_tensors(path)
    arch = spec.architectures[0] if spec.architectures else ""
    module = target_module_of(arch, rf["engine"], book, rf)
    whitelist = rf["engine_whitelist"]
    probes = rf["engine_probe_map"] or {}
    probe = probes.get(arch, probes.get("*")) if spec.has_vision else None
    # the loader reads the probe on the config the target's model class holds: an Omni wrapper's is its thinker's
    text_path = text_config_path(config)
    holder = nested(config, text_path[:-1]) if text_path and len(text_path) > 1 else config
    probe_present = probe is not None and config_attribute(holder, probe) is not None
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
        "default_aux": list(engine_default_aux_ids(spec.num_layers)),
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
    layer = filled.get("transformer_layer_config") or filled  # speculators nests the layer's config
    return {
        "drafter_path": str(path), "drafter_format": d.format, "drafter_speculators_type": raw.get("speculators_model_type"),
        "drafter_uses_aux_hidden_state": d.uses_aux_hidden_state,
        "drafter_arch": d.architectures[0] if d.architectures else None, "drafter_model_type": d.model_type,
        "drafter_is_mla": d.is_mla,
        "drafter_num_heads": (raw.get("transformer_layer_config") or raw).get("num_attention_heads"),
        "drafter_num_kv_heads": layer.get("num_key_value_heads") or layer.get("num_attention_heads"),
        "drafter_hidden_size": d.hidden_size, "drafter_target_hidden_size": d.target_hidden_size,
        "drafter_vocab_size": d.vocab_size, "drafter_draft_vocab_size": d.draft_vocab_size or d.vocab_size,
        "drafter_max_position": d.max_position_embeddings, "drafter_dtype": d.dtype,
        "drafter_context_sglang": sglang_context_length(filled.get("transformer_layer_config") or filled),
        "drafter_header_dtype": max(header_dtypes, key=header_dtypes.get) if header_dtypes else None,
        "drafter_spec_tokens": d.speculative_tokens, "drafter_aux_ids": list(d.aux_ids) if d.aux_ids else None,
        "drafter_aux_location": d.aux_location, "drafter_norm_flags": d.norm_flags,
        "drafter_uses_mrope": uses_mrope(raw.get("transformer_layer_config") or raw),
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


def uses_mrope(layer: dict[str, Any]) -> bool:
    """Whether a config's rotary settings are M-RoPE (vLLM transformers_utils/config.py `_uses_mrope`: 'mrope_section'
    in rope_parameters, which vLLM fills from rope_scaling)."""
    return any(isinstance(layer.get(k), dict) and "mrope_section" in layer[k] for k in ("rope_parameters", "rope_scaling"))


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
        reads = list(engine_default_aux_ids(n))
    elif f["facts_release"] is None and engine in ("vllm", "sglang"):  # older than any release read
        reads = list(engine_default_aux_ids(n))
    elif engine == "sglang":  # where this release reads them, then shifted the way the target's model file does
        written, _ = find_aux_ids(drafter_config, aux_reading("sglang", f["facts_release"]).locations)
        reads = sglang_capture(written, n, sglang_shift_of(f)) if written else list(engine_default_aux_ids(n))
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
        # draftsmith records what it trained in its block's `drafter` config; a hand edit changes only the top level
        trained = (f["draftsmith"].get("drafter") or {}).get(flag, f["draftsmith"].get(flag, in_config))
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
    out: dict[str, Any] = {"target_tp": int_or_none(args.get("tensor_parallel_size")) or 1,
                           "max_model_len": int_or_none(args.get("max_model_len") or args.get("context_length"))
                           or f["target_max_position"],
                           "serve_dtype": args.get("dtype") if args.get("dtype") not in (None, "auto") else f["target_dtype"]}
    out["max_num_batched_tokens"] = int_or_none(args.get("max_num_batched_tokens"))
    out["pipeline_parallel_size"] = int_or_none(args.get("pipeline_parallel_size")) or 1
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
        draft_tp = int_or_none(out["spec_draft_tp"]) or out["target_tp"]
        out["spec_draft_tp_resolved"] = draft_tp
        out["drafter_heads_indivisible"] = bool(f["drafter_num_heads"]) and f["drafter_num_heads"] % draft_tp != 0
        out["spec_draft_arch"] = vllm_draft_arch(f["drafter_arch"], out["spec_method_effective"],
                                                 f["engine_eagle3_naming"] if f["facts_release"] else "prefix_unless_suffix")
        out["spec_draft_arch_registered"] = (None if not f["engine_arch_modules"] or out["spec_draft_arch"] is None
                                             else out["spec_draft_arch"] in f["engine_arch_modules"])
        return out | vllm_runner_facts(f)
    if engine == "llamacpp":
        p_min = spec.get("spec_draft_p_min")
        return out | {"ll_spec_type": spec.get("spec_type"), "ll_p_min": float(p_min) if p_min else None}
    topk, steps = int_or_none(spec.get("speculative_eagle_topk")), int_or_none(spec.get("speculative_num_steps"))
    out.update({
        "sg_algorithm": str(spec.get("speculative_algorithm") or "").upper() or None,
        "sg_draft_path": spec.get("speculative_draft_model_path"),
        "sg_steps": steps, "sg_topk": topk, "sg_draft_tokens": int_or_none(spec.get("speculative_num_draft_tokens")),
        "sg_page_size": int_or_none(args.get("page_size")) or 1,
        "sg_attention_backend": args.get("attention_backend"),
        "sg_draft_attention_backend": args.get("speculative_draft_attention_backend"),
        "sg_cuda_graph": args.get("disable_cuda_graph", "false").lower() in ("false", "0"),
    })
    # SGLANG_ENABLE_SPEC_V2 picks the overlap (V2) EAGLE worker where environ.py defines it (0.5.4.post1-0.5.13;
    # 0.5.14 removed it); what a release then does with topk > 1 is the table's spec_v2_topk.
    spec_v2 = f["engine_env"].get("SGLANG_ENABLE_SPEC_V2")
    out["sg_spec_v2"] = spec_v2 is not None and spec_v2.lower() in ("1", "true")
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


def sglang_context_facts(args: dict[str, str], f: dict[str, Any]) -> dict[str, Any]:
    """What SGLang's draft worker does with a drafter whose own context is shorter than the target's (facts
    `draft_context`): `refused` releases raise at start unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set."""
    served = int_or_none(args.get("context_length")) or f["target_context_sglang"]
    allow = f["engine_env"].get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
    mode = f["engine_draft_context"]
    if mode == "refused" and allow is not None and allow.lower() in ("1", "true"):
        mode = "extended"
    return {"sg_served_context": served, "sg_draft_context_short": f["drafter_context_sglang"] < served,
            "sg_draft_context_mode": mode, "sg_overwrite_env": allow,
            "sg_draft_rope_raised": mode == "extended" and bool(f["engine_draft_context_rope_raised"])}


def kv_page_facts(f: dict[str, Any]) -> dict[str, Any]:
    """Per-rank KV-cache width (KV heads x head_dim) of the target's attention and of the drafter's, as vLLM sizes
    each layer's KV page (v1/kv_cache_interface.py AttentionSpec.page_size_bytes: block x 2 x KV heads x head_size x
    dtype; KV heads per rank = max(1, heads // tp), as in QKVParallelLinear), and whether they differ. None for MLA,
    whose layers have a KV spec of their own."""
    tp = f["target_tp"]
    if f["target_is_mla"] or f["drafter_is_mla"] or None in (f["target_num_kv_heads"], f["target_head_dim"],
                                                            f["drafter_num_kv_heads"], f["drafter_head_dim"]):
        return {"target_kv_heads_per_rank": None, "drafter_kv_heads_per_rank": None, "kv_page_mismatch": None}
    target_heads, drafter_heads = max(1, f["target_num_kv_heads"] // tp), max(1, f["drafter_num_kv_heads"] // tp)
    return {"target_kv_heads_per_rank": target_heads, "drafter_kv_heads_per_rank": drafter_heads,
            "kv_page_mismatch": target_heads * f["target_head_dim"] != drafter_heads * f["drafter_head_dim"]}


RUNNER_NAMES = {"v1": "V1 model runner", "v2": "Model Runner V2"}


def vllm_runner_facts(f: dict[str, Any]) -> dict[str, Any]:
    """Which vLLM model runner serves (VLLM_USE_V2_MODEL_RUNNER when set, else the release's default: `mrv2_default`;
    None where the default depends on the architecture), and whether that runner hands aux hidden states to every
    eagle3 drafter whatever its eagle_config.use_aux_hidden_state (`aux_forced_runners`); None when unknown."""
    env = f["engine_env"].get("VLLM_USE_V2_MODEL_RUNNER")
    if f["engine_mrv2_default"] == "only":
        runner = "v2"
    elif env is not None:
        runner = "v2" if env.strip().lower() in ("1", "true") else "v1"
    else:
        runner = {"off": "v1", "all": "v2"}.get(f["engine_mrv2_default"])
    forced = f["engine_aux_forced_runners"]
    if forced is None:
        here = None
    elif not forced:
        here = False
    else:
        here = None if runner is None else runner in forced
    return {"vllm_runner": runner, "vllm_runner_name": RUNNER_NAMES.get(runner, "model runner"),
            "vllm_aux_forced": here,
            "vllm_aux_forced_maybe": here is None and bool(forced)}


def vllm_drafter_load_facts(f: dict[str, Any], raw: dict[str, Any], args: dict[str, str]) -> dict[str, Any]:
    """How vLLM builds this drafter (engine facts fc_aux_count, draft_layer_kv_config, layer_types_unshifted):

    - `vllm_fc_aux_count`: the aux states fc is sized for: 3 where the release hard-wires it; else the config's
      num_aux_hidden_states, else the length of eagle_config's ids, else 3. A speculators drafter reaches vLLM
      through an adapter that copies its ids to the top level only, so it always gets 3 there.
    - `drafter_aux_count`: the number of aux ids the drafter names (None when it names none: then vLLM captures its
      default three and sizes fc for three alike). fc.weight's width, when the weights are there, is held against
      `expected_fc_in` (the engine's count x the target width) by vllm.fc-shape.
    - `vllm_draft_kv_fp8_unquantized`: --kv-cache-dtype fp8* where the drafter's layer never sees the cache config.
    - `vllm_layer_types_out_of_range`: the drafter config has a layer_types list no longer than the target's layer
      count, read at the drafter's layer index (the target's layer count) where the release does not subtract it."""
    kind = f["engine_fc_aux_count"]
    if kind == "fixed3" or (kind == "configured" and f["drafter_format"] == "speculators"):
        engine_count: int | None = 3
    elif kind == "configured":
        engine_count = int(raw.get("num_aux_hidden_states") or len(find_aux_ids(raw, ("eagle_config",))[0] or ()) or 3)
    else:
        engine_count = None
    width = f["drafter_target_hidden_size"] or f["drafter_hidden_size"]
    drafter_count = len(f["drafter_aux_ids"]) if f["drafter_aux_ids"] else None
    mismatch = None not in (engine_count, drafter_count) and engine_count != drafter_count
    layer = raw.get("transformer_layer_config") or raw
    types = layer.get("layer_types")
    kv = str(args.get("kv_cache_dtype") or "auto")
    return {
        "vllm_fc_aux_count": engine_count, "drafter_aux_count": drafter_count, "vllm_fc_aux_mismatch": mismatch,
        "expected_fc_in": engine_count * width if engine_count and width else f["expected_fc_in"],
        "expected_fc_in_target": (engine_count * f["target_hidden_size"] if engine_count and f["target_hidden_size"]
                                  else f["expected_fc_in_target"]),
        "target_aux_width": f"{engine_count or 3} x {f['target_hidden_size']}",
        "kv_cache_dtype": kv,
        "vllm_draft_kv_fp8_unquantized": f["engine_draft_layer_kv_config"] is False and kv.startswith("fp8"),
        "drafter_layer_types_len": len(types) if isinstance(types, list) else None,
        "vllm_layer_types_out_of_range": bool(f["engine_layer_types_unshifted"]) and isinstance(types, list)
        and bool(types) and len(types) <= (f["target_num_layers"] or 0),
    }


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
        from draftsmith.engines.llamacpp import llamacpp_facts

        f |= llamacpp_facts(drafter, f["target_num_layers"])
    f |= spec_facts(engine, spec, args, f)
    f |= kv_page_facts(f)
    drafter_config = read_dir_config(drafter)
    f |= aux_facts(f, engine, version, drafter_config)
    if engine == "vllm":
        f |= vllm_drafter_load_facts(f, drafter_config, args)
    if engine == "sglang":
        f["sglang_aux_unpacked_twice"] = f["engine_aux_unpacked_twice"] is not None and (
            f["target_module"] in f["engine_aux_unpacked_twice"])
        f["sglang_capture_ignored"] = f["target_arch"] in (f["engine_capture_ignored_archs"] or ())
    f |= norm_facts(f, engine, book, version)
    f["dtype_mismatch"] = (f["drafter_dtype"] or f["drafter_header_dtype"]) is not None and _dtype_name(
        f["drafter_dtype"] or f["drafter_header_dtype"]) != _dtype_name(f["serve_dtype"])
    f["drafter_dtype_name"] = _dtype_name(f["drafter_dtype"] or f["drafter_header_dtype"])
    f["serve_dtype_name"] = _dtype_name(f["serve_dtype"])
    f["target_known_mla_family"] = f["target_model_type"] in MLA_MODEL_TYPES
    archs = f["engine_draft_archs"]
    f["drafter_arch_unknown_to_engine"] = None if not archs or not f["drafter_arch"] else f["drafter_arch"] not in archs
    return f


def _dtype_name(name: str | None) -> str | None:
    aliases = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "half": "float16", "float": "float32"}
    return None if name is None else aliases.get(str(name), str(name).replace("torch.", ""))
