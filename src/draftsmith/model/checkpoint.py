"""Drafter checkpoints on disk, in the layout vLLM loads natively for each family: EAGLE-3's
`LlamaForCausalLMEagle3` (SGLang's too) and DFlash's `DFlashDraftModel` (z-lab's).

An EAGLE-3 directory holds `config.json` (a Llama config plus the EAGLE-3 fields) and
`model.safetensors` with the keys of `Eagle3Drafter` minus the frozen `embed_tokens`:
`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. A DFlash directory holds a Qwen3
config plus `block_size`, `target_hidden_size` and `dflash_config` (mask token, 0-based target layer ids), and
the keys of `DFlashDrafter` (`layers.*`, `fc`, `hidden_norm`, `norm`): the engine shares the target's embedding
and head. The family is the drafter block's `family` key (absent: EAGLE-3), and every reader dispatches on it.

`config.json` also carries a `draftsmith` block: the drafter config with the aux ids as boundary
indices (the convention they were trained with), so any later reader knows exactly what was trained.
Training state (optimizer, scheduler, RNG, data position) lives beside it in `training_state.pt`,
never in the model files.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.conventions import aux_ids_for_format
from draftsmith.errors import DraftsmithError
from draftsmith.files import read_json
from draftsmith.model.dflash import DFlashConfig, DFlashDrafter
from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter
from draftsmith.outputs import umask_mode

ARCHITECTURE = "LlamaForCausalLMEagle3"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
NOT_EXPORTED = ("embed_tokens.weight",)


def backbone_keys(cfg: DrafterConfig | DFlashConfig, num_layers: int) -> dict[str, Any]:
    """The decoder backbone's config keys both families write (HF Llama / Qwen3 names), in this order."""
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "num_hidden_layers": num_layers, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size}


def hf_config(cfg: DrafterConfig, engine: str = "vllm", dtype: str = "float32",
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for the LlamaForCausalLMEagle3 layout, every flag explicit so no engine default applies.

    The aux ids, in `engine`'s convention, go both at the top level and in `eagle_config`: vLLM 0.11.1-0.21.0
    reads them only at the top level, later vLLM and SGLang in `eagle_config` (engine_facts.json).
    """
    aux_ids = aux_ids_for_format(cfg.aux_layer_ids, engine)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **backbone_keys(cfg, 1),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": False,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": aux_ids,
            "use_aux_hidden_state": True,
            "norm_before_fc": cfg.norm_before_fc,
        },
        "draftsmith": {
            "drafter": cfg.to_dict(),
            "aux_layer_ids_boundary": list(cfg.aux_layer_ids),
            "aux_id_convention": engine,
            **(extra or {}),
        },
    }


def dflash_hf_config(cfg: DFlashConfig, dtype: str = "float32", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of the DFlashDraftModel layout (vLLM's qwen3_dflash, z-lab's drafters), every field explicit.

    No top-level `is_causal` or `layer_types`: vLLM then runs the draft attention non-causal. rope_theta is
    written because vLLM defaults it to 1e6. target_layer_ids are 0-based layer-output ids (boundary - 1)."""
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        **backbone_keys(cfg, cfg.num_layers),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "target_hidden_size": cfg.target_hidden_size,
        "num_target_layers": cfg.target_num_layers,
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids},
        "draftsmith": {
            "drafter": cfg.to_dict(),
            "aux_layer_ids_boundary": list(cfg.aux_layer_ids),
            "aux_id_convention": "vllm",
            **(extra or {}),
        },
    }


def drafter_state(drafter: Eagle3Drafter | DFlashDrafter, dtype: torch.dtype | None = None,
                  state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The exported tensors, in the checkpoint's key names (from `state` when given: an FSDP-gathered one)."""
    out = {}
    for name, tensor in (drafter.state_dict() if state is None else state).items():
        if name in NOT_EXPORTED:
            continue
        t = tensor.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def save_drafter(drafter: Eagle3Drafter | DFlashDrafter, path: Path, engine: str = "vllm", dtype: str = "float32",
                 extra: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json and model.safetensors (to temporary names, then renamed).

    `state`: the full state dict when the module's own is sharded (FSDP2 gathers it first)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = drafter_state(drafter, getattr(torch, dtype), state)
    save_weights(state, path / (WEIGHTS + ".tmp"))
    os.replace(path / (WEIGHTS + ".tmp"), path / WEIGHTS)
    config = (dflash_hf_config(drafter.config, dtype, extra) if isinstance(drafter.config, DFlashConfig)
              else hf_config(drafter.config, engine, dtype, extra))
    (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(path / "config.json.tmp", path / "config.json")
    return path


REWRITE_DRAFTER = "write the drafter again (`draftsmith export`, `draftsmith convert`, or a copy of the original)"


def read_drafter_config(path: Path) -> dict[str, Any]:
    """The config.json of a drafter folder (any layout), a JSON object.

    Raises:
        DraftsmithError: no config.json, or one that is not UTF-8 JSON holding an object (file, line, column).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise DraftsmithError("not a drafter checkpoint", got=f"no config.json in {path}",
                              expected="a directory written by `draftsmith train` or `draftsmith export`",
                              fix="point at the checkpoint directory")
    return read_json(path / "config.json", "drafter config", fix=REWRITE_DRAFTER)


def read_tensor_file(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one weights file (safetensors, or a pickle of tensors only: `pytorch_model.bin`).

    Raises:
        DraftsmithError: a cut or corrupt file, named (safetensors' or torch's own words as got).
    """
    try:
        if file.suffix == ".bin":
            # The original EAGLE release ships a pickle; weights_only refuses anything but tensors (docs/design.md).
            return torch.load(file, map_location="cpu", weights_only=True)
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, pickle.UnpicklingError, EOFError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DraftsmithError(f"corrupt drafter weights {file}", got=reason[:300],
                              expected="a whole weights file: safetensors (header length, JSON header, every "
                              "tensor's bytes) or a pickle of tensors", fix=REWRITE_DRAFTER) from exc


def read_drafter_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a drafter folder: model.safetensors, a sharded index, or pytorch_model.bin.

    Raises:
        DraftsmithError: no weights, a corrupt index, or a cut or corrupt weights file.
    """
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return read_tensor_file(path / WEIGHTS)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "drafter weights index", fix=REWRITE_DRAFTER).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise DraftsmithError(f"drafter weights index {index} has no weight_map", got=str(weight_map)[:120],
                                  expected='"weight_map": {tensor name: shard file}', fix=REWRITE_DRAFTER)
        return {k: v for shard in sorted(set(weight_map.values())) for k, v in read_tensor_file(path / shard).items()}
    if (path / "pytorch_model.bin").is_file():
        return read_tensor_file(path / "pytorch_model.bin")
    raise DraftsmithError("no drafter weights found", got=f"{path} has no {WEIGHTS}, sharded index or pytorch_model.bin",
                          expected="a Hugging Face style drafter directory", fix="point at the drafter's folder")


def draftsmith_drafter_config(config: dict[str, Any], path: Path) -> DrafterConfig | DFlashConfig:
    """The drafter settings of a draftsmith checkpoint's config.json (its `draftsmith.drafter` block), of the
    family the block names (`family`; absent: EAGLE-3).

    Raises:
        DraftsmithError: no draftsmith block (`draftsmith convert` reads foreign layouts), or a block that is not a
            drafter config.
    """
    if "draftsmith" not in config:
        raise DraftsmithError("checkpoint was not written by draftsmith", got=f"{path}/config.json has no "
                              "'draftsmith' block", expected="a draftsmith checkpoint",
                              fix=f"convert it first: draftsmith convert {path} OUT --to draftsmith")
    try:
        block = config["draftsmith"]["drafter"]
        family = FAMILIES[block.get("family", "eagle3")]
        cfg = family.config.from_dict(block)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DraftsmithError(f"the drafter block of {path}/config.json is not a drafter config",
                              got=f"{type(exc).__name__}: {exc}"[:300],
                              expected="draftsmith.drafter with the fields `draftsmith train` writes",
                              fix=REWRITE_DRAFTER) from exc
    engine_keys = family.engine_keys
    engine_view = {key: config[key] for key in engine_keys if key in config}
    if isinstance(cfg, DFlashConfig):  # the nested fields vLLM reads
        engine_view.update({f"dflash_config.{k}": v for k, v in (config.get("dflash_config") or {}).items()
                            if f"dflash_config.{k}" in engine_keys})
    if differ := {key: (value, getattr(cfg, engine_keys[key])) for key, value in engine_view.items()
                  if value != getattr(cfg, engine_keys[key])}:
        raise DraftsmithError(f"{path}/config.json contradicts itself: the engines read other shapes than the "
                              "drafter block", got="; ".join(f"{k} {a} (draftsmith.drafter: {b})" for k, (a, b) in
                                                             differ.items()),
                              expected="the top-level keys equal to the draftsmith.drafter block's",
                              fix=REWRITE_DRAFTER)
    return cfg


ENGINE_KEYS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
               "vocab_size": "vocab_size", "draft_vocab_size": "draft_vocab_size",
               "target_hidden_size": "target_hidden_size"}
"""Top-level config keys the engines read (HF / vLLM names) -> the DrafterConfig field each must equal."""
DFLASH_ENGINE_KEYS = {**{k: v for k, v in ENGINE_KEYS.items() if k != "draft_vocab_size"},
                      "num_hidden_layers": "num_layers", "block_size": "block_size",
                      "dflash_config.mask_token_id": "mask_token_id",
                      "dflash_config.target_layer_ids": "target_layer_ids"}
"""The same for a DFlash drafter (DFlashConfig fields)."""


class Family(NamedTuple):
    """What a drafter family's checkpoint reads: its config class, its module, its engine keys."""

    config: type
    drafter: type
    engine_keys: dict[str, str]


FAMILIES = {"eagle3": Family(DrafterConfig, Eagle3Drafter, ENGINE_KEYS),
            "dflash": Family(DFlashConfig, DFlashDrafter, DFLASH_ENGINE_KEYS)}
"""The drafter block's `family` -> its classes (a block without one is EAGLE-3's)."""


def load_drafter(path: Path, embed_tokens: torch.Tensor | None = None) -> Eagle3Drafter | DFlashDrafter:
    """Load a draftsmith-written checkpoint of either family; an EAGLE-3 drafter's frozen embedding comes from the
    target (a DFlash drafter has none: its forwards take the target's).

    Raises:
        DraftsmithError: no draftsmith block (use `draftsmith convert` for foreign layouts), a corrupt config or
            weights file, or tensors that do not match the config.
    """
    path = Path(path)
    cfg = draftsmith_drafter_config(read_drafter_config(path), path)
    drafter = FAMILIES[cfg.family].drafter(cfg)
    state = read_drafter_weights(path)
    if embed_tokens is not None and isinstance(drafter, Eagle3Drafter):
        state["embed_tokens.weight"] = embed_tokens
    try:
        missing, unexpected = drafter.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                       for k, v in state.items()}, strict=False)
    except RuntimeError as exc:  # a tensor whose shape differs from the config's
        raise DraftsmithError(f"checkpoint tensors do not match its config in {path}",
                              got=str(exc).strip().splitlines()[-1][:300], expected="the shapes config.json implies",
                              fix="re-export the drafter") from exc
    missing = [m for m in missing if m not in NOT_EXPORTED]
    if missing or unexpected:
        raise DraftsmithError(f"checkpoint tensors do not match its config in {path}",
                              got=f"missing {missing[:5]}, unexpected {unexpected[:5]}",
                              expected=f"exactly the {'DFlashDraftModel' if cfg.family == 'dflash' else ARCHITECTURE} "
                              "keys", fix="re-export the drafter")
    return drafter


def save_weights(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """A safetensors file readable as the umask says (safetensors writes 0600, which an engine running as another
    user cannot read)."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    os.chmod(file, umask_mode())


EMBEDDED_DRAFTERS = Path(__file__).parents[1] / "data" / "drafters"
"""Drafters shipped with the package, one directory per short name (`smollm2`: the embedded target's)."""


def shipped_drafter(name: object) -> Path | None:
    """The directory of the drafter shipped under this short name (`smollm2`), or None: the one place that decides."""
    if not isinstance(name, str) or not name or "/" in name:
        return None
    path = EMBEDDED_DRAFTERS / name
    return path if (path / "config.json").is_file() else None


def drafter_block(config: dict) -> dict[str, Any]:
    """The drafter settings a saved config.json records: draftsmith's own `draftsmith.model.eagle3` block, else the top
    level (an engine-format config): where conventions.unread_norms reads a drafter's norm variants."""
    return (config.get("draftsmith") or {}).get("drafter") or config


def drafter_path(name: str | Path) -> Path:
    """A drafter directory, or the shipped drafter of that short name (`smollm2`); anything else unchanged."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    return shipped_drafter(str(name)) or path
