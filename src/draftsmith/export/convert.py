"""`draftsmith convert SRC DST --to FORMAT`: read a public EAGLE-3 drafter layout, write another.

Source layouts, detected from config.json and the tensor names (docs/training.md §7):

| layout      | config                                         | layer keys   | aux ids read as                     |
|-------------|------------------------------------------------|--------------|-------------------------------------|
| draftsmith  | has a `draftsmith` block                       | either       | the block's boundary ids            |
| eagle       | `LlamaForCausalLM` (SafeAILab/EAGLE release)   | `midlayer.*` | none: EAGLE captures boundaries     |
|             |                                                |              | (2, N//2, N-3) (`modeling_llama_kv`)|
| specforge   | `LlamaForCausalLMEagle3` (SpecForge / SGLang)  | `midlayer.*` | layer outputs: boundary = id + 1    |
| modelopt    | `LlamaForCausalLMEagle3` + `eagle_config`      | `layers.0.*` | layer outputs: boundary = id + 1    |
| speculators | `Eagle3Speculator` (0.9.0 trainer:             | `layers.0.*` | boundaries (vLLM reads them as is)  |
|             | `Eagle3DraftModel`) + `speculators_config`     |              |                                     |

ModelOpt (NVIDIA/Model-Optimizer `modelopt/torch/export/plugins/hf_spec_export.py`): keys `fc`,
`layers.0.*`, `norm`, optional `d2t`, `lm_head`, no `t2d` (draftsmith derives it from `d2t`), no
`target_hidden_size` (read from `fc.weight`); aux ids come from a forward hook on decoder-layer
outputs, defaults `[1, N//2-1, N-4]` (`modelopt/torch/speculative/plugins/transformers.py`).
speculators: vLLM's `update_eagle3` defaults `norm_before_residual` to True when absent
(vllm/transformers_utils/configs/speculators/algos.py), so that is how an absent flag is read.

DFlash drafters (z-lab's `DFlashDraftModel` layout, speculators' `dflash`, draftsmith's own) are read and written
by `export.dflash` (`convert` hands them over on their family, `conventions.drafter_family`).

Refused, with the reason: MLA drafters (no faithful Llama layout), more than one decoder layer, norm
variants or biases draftsmith's drafter lacks, unknown tensors (listed), an `embed_tokens` copy (unless
`--drop-embeddings`), aux ids whose target depth is unknown. Output: a draftsmith checkpoint
(`--to draftsmith`, readable by `draftsmith eval`) or any `draftsmith export` format, owned as `export`'s is:
an OUT of the user's (`--overwrite` replaces it) or one overlapping SRC is refused before SRC is read, and OUT
is swapped in whole, so a failure leaves the old one as it was.

    draftsmith convert ./EAGLE3-LLaMA3.1-Instruct-8B ./eagle3-vllm --to vllm --target meta-llama/Llama-3.1-8B-Instruct
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, model_validator

from draftsmith.model.checkpoint import (NOT_EXPORTED, WEIGHTS, draftsmith_drafter_config, hf_config,
                                         read_drafter_config, read_drafter_weights, save_weights)
from draftsmith.bench.guard import EXPECTED_KEY, expected_from_eval_json
from draftsmith.config import Settings, add_flags, check_choices, from_flags
from draftsmith.conventions import (
    AUX_CONVENTIONS,
    DFLASH,
    drafter_family,
    MLA_DRAFTER_ARCHITECTURES,
    MLA_MODEL_TYPES,
    TRAINER_CONVENTIONS,
    engine_default_aux_ids,
    find_aux_ids,
    to_boundary,
    validate_aux_ids,
)
from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter
from draftsmith.errors import DraftsmithError
from draftsmith.export.formats import (DEFAULT_K, DTYPES, FORMATS, check_export_out, refuse_unread_norms,
                                       write_layout)
from draftsmith.export import dflash
from draftsmith.outputs import replace_dir

LAYOUTS = ("draftsmith", "eagle", "specforge", "modelopt", "speculators")
MLA_KEY_PARTS = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_b_proj")
# Tensors of the drafter module that a public file may carry under these names.
PLAIN_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "input_norm.weight")
LAYER_PREFIXES = {"midlayer.": "midlayer.", "layers.0.": "midlayer."}


@dataclass(frozen=True)
class SourceDrafter:
    """A drafter read from any layout, in draftsmith's key names and config."""

    layout: str
    config: DrafterConfig
    tensors: dict[str, torch.Tensor]
    """draftsmith key -> tensor, dtypes as stored."""
    aux_ids_read: list[int] | None
    """The ids as written in the source file (None: it named none)."""
    aux_convention: str
    notes: list[str] = field(default_factory=list)
    """What was derived or changed, each with its reason (printed and kept in the output config)."""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    layout: str
    to: str
    aux_layer_ids_boundary: tuple[int, ...]
    notes: list[str]


# --- reading ----------------------------------------------------------------------------------------

def detect_layout(config: dict, keys: set[str]) -> str:
    """Which public layout a (config.json, tensor names) pair is; refuses MLA drafters and unknown ones."""
    arch = (config.get("architectures") or [""])[0]
    if "draftsmith" in config:
        return "draftsmith"
    mla_keys = sorted(k for k in keys if any(p in k for p in MLA_KEY_PARTS))
    if arch in MLA_DRAFTER_ARCHITECTURES or config.get("model_type") in MLA_MODEL_TYPES or "kv_lora_rank" in config or mla_keys:
        raise DraftsmithError(
            "an MLA drafter cannot be converted to a Llama layout faithfully",
            got=f"architectures {config.get('architectures')}, model_type {config.get('model_type')!r}, "
                f"MLA tensors {mla_keys[:4]}",
            expected="a dense Llama EAGLE-3 drafter (q/k/v/o projections)",
            fix="serve it in its own layout (vLLM routes Eagle3DeepseekV2ForCausalLM to deepseek_eagle3), "
                "or train a dense drafter: draftsmith train")
    has_mid = any(k.startswith("midlayer.") for k in keys)
    has_layers = any(k.startswith("layers.") for k in keys)
    if "speculators_model_type" in config or arch == "Eagle3Speculator":
        if config.get("speculators_model_type", "eagle3") != "eagle3":
            raise DraftsmithError("not an EAGLE-3 speculator", got=f"speculators_model_type "
                                  f"{config.get('speculators_model_type')!r}", expected="'eagle3'",
                                  fix="convert EAGLE-3 drafters only")
        return "speculators"
    if arch == "LlamaForCausalLMEagle3" and has_mid:
        return "specforge"
    if arch == "LlamaForCausalLMEagle3" and has_layers:
        return "modelopt"
    if arch == "LlamaForCausalLM" and has_mid:
        return "eagle"
    raise DraftsmithError("unknown drafter layout", got=f"architectures {config.get('architectures')}, "
                          f"layer keys {'midlayer.*' if has_mid else 'layers.*' if has_layers else 'none'}",
                          expected="one of " + ", ".join(LAYOUTS) + " (draftsmith convert --help)",
                          fix="check that SRC is an EAGLE-3 drafter directory")


def rename_tensors(tensors: dict[str, torch.Tensor], drop_embeddings: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Public names -> draftsmith names. Every tensor is mapped, or refused by name; none is skipped."""
    out, notes, unknown = {}, [], []
    for name, t in tensors.items():
        prefix = next((p for p in LAYER_PREFIXES if name.startswith(p)), None)
        if prefix:
            out[LAYER_PREFIXES[prefix] + name[len(prefix):]] = t
        elif name in PLAIN_KEYS:
            out[name] = t
        elif name in NOT_EXPORTED and drop_embeddings:
            notes.append(f"dropped {name} {list(t.shape)}: the drafter uses the target's embedding "
                         "(--drop-embeddings)")
        else:
            unknown.append(f"{name} {list(t.shape)}")
    if unknown:
        embed = any(u.startswith(NOT_EXPORTED[0]) for u in unknown)
        raise DraftsmithError(
            f"{len(unknown)} tensor(s) have no place in draftsmith's EAGLE-3 drafter",
            got=", ".join(sorted(unknown)[:12]) + (" ..." if len(unknown) > 12 else ""),
            expected="fc, midlayer.* / layers.0.*, norm, lm_head, d2t, t2d (input_norm with norm_before_fc)",
            fix=("pass --drop-embeddings if the drafter's embed_tokens is the target's own copy; " if embed else "")
            + "a second decoder layer or per-chunk fc norms (fc_norm) cannot be represented faithfully")
    return out, notes


def layer_fields(config: dict, layout: str) -> dict:
    """The flat Llama fields of a drafter config (speculators nests them in transformer_layer_config).

    transformers 5 writes RoPE as `rope_parameters` {rope_type, rope_theta} (speculators 0.9.0's trainer
    does); its rope_theta is lifted to the top, where older writers put it.
    """
    if layout == "speculators":
        inner = config.get("transformer_layer_config")
        if not isinstance(inner, dict):
            raise DraftsmithError("speculators config without transformer_layer_config", got=str(config)[:200],
                                  expected="a dict transformer_layer_config (vLLM requires it)", fix="re-export it")
        config = {**inner, **{k: v for k, v in config.items() if k != "transformer_layer_config"}}
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config = {**config, "rope_theta": rope["rope_theta"]}
    return config


def sliding_window_binds(cfg: dict) -> bool:
    """A sliding-window layer whose window is shorter than the context (speculators 0.9.0 trains every
    layer with sliding_window 2048 unless --full-attention-indices names it); draftsmith attends fully."""
    sliding = "sliding_attention" in (cfg.get("layer_types") or []) or bool(cfg.get("use_sliding_window"))
    window = cfg.get("sliding_window")
    return sliding and window is not None and window < cfg.get("max_position_embeddings", 2048)


def unfaithful_fields(cfg: dict, layout: str) -> list[str]:
    """Every config setting draftsmith's drafter cannot reproduce (empty = convertible)."""
    eagle = cfg.get("eagle_config") or {}
    checks = [
        (cfg.get("num_hidden_layers", 1) != 1, f"num_hidden_layers {cfg.get('num_hidden_layers')} (one layer only)"),
        (bool(cfg.get("fc_norm")), "fc_norm true"),
        (bool(cfg.get("attention_bias")), "attention_bias true"),
        (bool(cfg.get("mlp_bias") or cfg.get("bias")), "mlp / fc bias"),
        (cfg.get("hidden_act", "silu") != "silu", f"hidden_act {cfg.get('hidden_act')!r}"),
        (cfg.get("rope_scaling") not in (None, {}), f"rope_scaling {cfg.get('rope_scaling')} (plain RoPE only)"),
        ((cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default",
         f"rope_parameters {cfg.get('rope_parameters')} (plain RoPE only)"),
        (sliding_window_binds(cfg), f"sliding_window {cfg.get('sliding_window')} < context "
         f"{cfg.get('max_position_embeddings')} (full attention only; speculators: --full-attention-indices 0)"),
        (cfg.get("logit_scale", 1.0) != 1.0, f"logit_scale {cfg.get('logit_scale')}"),
        (eagle.get("use_aux_hidden_state") is False, "eagle_config.use_aux_hidden_state false (not EAGLE-3)"),
        # ModelOpt's eagle_config switches (hf_spec_export.py template); draftsmith always has both norms.
        (eagle.get("use_input_layernorm_in_first_layer") is False, "use_input_layernorm_in_first_layer false"),
        (eagle.get("use_last_layernorm") is False, "use_last_layernorm false"),
        (bool(eagle.get("use_mtp_layernorm")), "use_mtp_layernorm true"),
        ((eagle.get("parallel_draft_step") or 1) > 1, f"parallel_draft_step {eagle.get('parallel_draft_step')}"),
    ]
    return [msg for bad, msg in checks if bad]


def eagle_flag(config: dict, key: str) -> Any:
    """A flag vLLM's llama_eagle3 also reads from the config's eagle_config (norm_before_fc)."""
    return (config.get("eagle_config") or {}).get(key)


def boundary_ids(ids: list[int] | None, convention: str, target_layers: int) -> tuple[int, int, int]:
    """The ids as boundary indices (`draftsmith.conventions`); no ids -> what the engines capture by default."""
    if not ids:
        return tuple(validate_aux_ids(engine_default_aux_ids(target_layers), target_layers))
    return tuple(validate_aux_ids(to_boundary(ids, convention), target_layers))


def vocab_maps(tensors: dict[str, torch.Tensor], vocab: int, draft_vocab: int, notes: list[str]) -> None:
    """Fill or check d2t / t2d in place: t2d is derived from d2t when absent and must agree when present."""
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise DraftsmithError("draft vocabulary without a d2t map", got=f"draft_vocab_size {draft_vocab} < "
                                  f"vocab_size {vocab} and no d2t tensor", expected="d2t [draft_vocab_size]",
                                  fix="convert the checkpoint that was trained with this vocabulary")
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
        notes.append("d2t absent, draft vocab = full vocab: identity map written")
    d2t = tensors["d2t"].to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    if "t2d" in tensors and not torch.equal(tensors["t2d"].to(torch.bool), t2d):
        raise DraftsmithError("d2t and t2d disagree", got="t2d marks other tokens than arange + d2t",
                              expected="t2d[arange(Vd) + d2t] = True, False elsewhere", fix="re-export the drafter")
    if "t2d" not in tensors:
        notes.append("t2d absent: derived from d2t")
    tensors["d2t"], tensors["t2d"] = d2t, t2d


def read_drafter(src: Path, target_layers: int | None = None, aux_convention: str | None = None,
                 drop_embeddings: bool = False, target_max_positions: int | None = None) -> SourceDrafter:
    """Read any supported layout into draftsmith's names and config.

    Args:
        target_layers: the target's decoder-layer count N (needed unless SRC is a draftsmith file).
        aux_convention: override how explicit ids are read ("boundary" or "layer-output").
        target_max_positions: the target's context; a smaller drafter `max_position_embeddings` is raised.
    Raises:
        DraftsmithError: a layout or setting that cannot be converted faithfully (the reason is named).
    """
    src = Path(src)
    if not (src / "config.json").is_file():
        raise DraftsmithError("not a drafter directory", got=f"no config.json in {src}",
                              expected="config.json beside the weights", fix="point SRC at the drafter folder")
    config, raw = read_drafter_config(src), read_drafter_weights(src)
    layout = detect_layout(config, set(raw))
    tensors, notes = rename_tensors(raw, drop_embeddings)
    if layout == "draftsmith":
        block = config["draftsmith"]
        cfg = draftsmith_drafter_config(config, src)
        meta = {k: v for k, v in block.items() if k not in ("drafter", "aux_layer_ids_boundary", "aux_id_convention")}
        vocab_maps(tensors, cfg.vocab_size, cfg.draft_vocab_size, notes)
        return SourceDrafter(layout, cfg, check_shapes(cfg, tensors), find_aux_ids(config)[0],
                             block.get("aux_id_convention", "vllm"), notes, meta)
    flat = layer_fields(config, layout)
    problems = unfaithful_fields(flat, layout)
    if problems:
        raise DraftsmithError(f"this {layout} drafter cannot be converted faithfully", got="; ".join(problems),
                              expected="one dense Llama layer with EAGLE-3's plain norms",
                              fix="serve it in its own layout; draftsmith's drafter has no such variant")
    if target_layers is None:
        raise DraftsmithError("the target's layer count is needed to place the aux hidden states",
                              got=f"a {layout} drafter (ids {find_aux_ids(config)[0]})",
                              expected="--target TARGET or --target-layers N",
                              fix="add --target with the model this drafter was trained for")
    convention = aux_convention or TRAINER_CONVENTIONS[layout]
    ids = boundary_ids(find_aux_ids(config)[0], convention, target_layers)
    fc = tensors.get("fc.weight")
    if fc is None or fc.shape[1] % 3:
        raise DraftsmithError("fc.weight missing or not 3 x target hidden wide", got=str(None if fc is None else
                              list(fc.shape)), expected="[hidden, 3 * target_hidden]", fix="check SRC")
    hidden, vocab = flat["hidden_size"], flat["vocab_size"]
    draft_vocab = flat.get("draft_vocab_size") or vocab
    heads = flat["num_attention_heads"]
    max_pos = flat.get("max_position_embeddings", 2048)
    if target_max_positions and max_pos < target_max_positions:
        notes.append(f"max_position_embeddings {max_pos} raised to the target's {target_max_positions} "
                     "(plain RoPE: positions past the old value are well defined; vllm-project/vllm#48894)")
        max_pos = target_max_positions
    # vLLM's llama_eagle3 reads an absent norm_before_residual as False; its speculators path as True.
    nbr = flat.get("norm_before_residual", layout == "speculators")
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=flat["intermediate_size"], num_heads=heads,
                        num_kv_heads=flat.get("num_key_value_heads", heads),
                        head_dim=flat.get("head_dim") or hidden // heads, vocab_size=vocab,
                        draft_vocab_size=draft_vocab, target_hidden_size=fc.shape[1] // 3,
                        target_num_layers=target_layers, aux_layer_ids=ids,
                        rms_norm_eps=flat.get("rms_norm_eps", 1e-6), rope_theta=flat.get("rope_theta", 10000.0),
                        max_position_embeddings=max_pos, norm_before_residual=bool(nbr),
                        norm_before_fc=bool(flat.get("norm_before_fc") or eagle_flag(config, "norm_before_fc")),
                        norm_output=bool(flat.get("norm_output")))
    vocab_maps(tensors, vocab, draft_vocab, notes)
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    meta = {"target": verifier} if verifier else {}
    return SourceDrafter(layout, cfg, check_shapes(cfg, tensors), find_aux_ids(config)[0], convention, notes, meta)


def check_shapes(cfg: DrafterConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor the drafter needs, with its shape; built on the meta device, so nothing is allocated."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Eagle3Drafter(cfg).state_dict().items() if k not in NOT_EXPORTED}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    missing = sorted(set(want) - set(got))
    wrong = sorted(f"{k} {list(got[k])} (config says {list(want[k])})" for k in set(want) & set(got) if got[k] != want[k])
    extra = sorted(set(got) - set(want))
    if missing or wrong or extra:
        raise DraftsmithError("tensors do not match the drafter config", got=f"missing {missing[:6]}, wrong shape "
                              f"{wrong[:4]}, unexpected {extra[:6]}", expected="one tensor per drafter parameter",
                              fix="the config.json and weights of SRC do not belong together")
    return tensors


# --- writing ----------------------------------------------------------------------------------------

def write_draftsmith(source: SourceDrafter, folder: Path, src: Path, dtype: str | None = None) -> Path:
    """A draftsmith checkpoint (what `draftsmith eval` and `export` read) written into `folder`; tensors keep
    their dtype."""
    cast = getattr(torch, dtype) if dtype else None
    tensors = {k: (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous()
               for k, t in source.tensors.items()}
    stored = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    origin = {"layout": source.layout, "path": str(src), "aux_ids_as_written": source.aux_ids_read,
              "aux_convention_read": source.aux_convention, "notes": source.notes}
    extra = {**source.meta, "converted_from": origin} if source.layout != "draftsmith" else source.meta
    save_weights(tensors, folder / WEIGHTS)
    (folder / "config.json").write_text(json.dumps(hf_config(source.config, "vllm", stored, extra), indent=2) + "\n")
    return Path(folder)


def target_facts(target: str | None) -> tuple[int | None, int | None, Any]:
    """(layers, max positions, spec) of a target name, or Nones without one."""
    if not target:
        return None, None, None
    from draftsmith.target import describe_target, read_config, resolve_target

    spec = describe_target(read_config(resolve_target(target)))
    return spec.num_layers, spec.max_position_embeddings, spec


def check_target_fit(cfg: DrafterConfig, spec) -> None:
    bad = [f"{name} {mine} vs target {theirs}" for name, mine, theirs in (
        ("target_hidden_size", cfg.target_hidden_size, spec.hidden_size), ("vocab_size", cfg.vocab_size, spec.vocab_size))
        if mine != theirs]
    if bad:
        raise DraftsmithError("the drafter was not trained for this target", got="; ".join(bad),
                              expected="fc input = 3 x the target's hidden size and the target's vocabulary",
                              fix="pass the target the drafter was trained for")


def convert(src: Path, out: Path, to: str, target: str | None = None, target_layers: int | None = None,
            aux_convention: str | None = None, drop_embeddings: bool = False, dtype: str | None = None,
            k: int = DEFAULT_K, overwrite: bool = False, reference: Path | None = None) -> ConvertResult:
    """Read SRC in any supported layout and write it as `to` (draftsmith or an export format) into `out`.

    Raises:
        DraftsmithError: an `out` of the user's (without `overwrite`) or one overlapping SRC, before SRC is
            read; a layout or setting that cannot be converted faithfully.
    """
    if to not in ("draftsmith", *FORMATS):
        raise DraftsmithError("unknown --to", got=to, expected=" | ".join(("draftsmith", *FORMATS)), fix="pick one")
    check_export_out(Path(src), Path(out), overwrite, "convert")
    if drafter_family(read_drafter_config(Path(src))) == DFLASH:
        source, out = dflash.convert(Path(src), Path(out), to, target, target_layers, drop_embeddings, dtype, k, overwrite)
        return ConvertResult(out, source.layout, to, source.shape.aux_layer_ids, source.notes)
    layers, max_pos, spec = target_facts(target)
    source = read_drafter(Path(src), target_layers or layers, aux_convention, drop_embeddings, max_pos)
    if spec is not None:
        check_target_fit(source.config, spec)
    if target:
        source.meta.setdefault("target", target)
    if reference:  # a public drafter carries no held-back measurement: only the user's own is recorded
        source.meta[EXPECTED_KEY] = expected_from_eval_json(json.loads(Path(reference).read_text()), k,
                                                            f"reference {reference}")
    if to != "draftsmith":
        refuse_unread_norms({"draftsmith": {"drafter": source.config.to_dict()}}, to)
    with replace_dir(Path(out).resolve(), "convert", overwrite, flag="OUT") as folder:  # resolved: OUT may be "."
        if to == "draftsmith":
            write_draftsmith(source, folder, Path(src), dtype)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = write_draftsmith(source, Path(tmp), Path(src), dtype)
                stored = str(source.tensors["fc.weight"].dtype).removeprefix("torch.")
                write_layout(ckpt, json.loads((ckpt / "config.json").read_text()), folder, to, dtype or stored, k,
                             target, Path(out))
    return ConvertResult(Path(out), source.layout, to, source.config.aux_layer_ids, source.notes)


class ConvertSettings(Settings):
    """What `convert` reads and writes: the convert verb's command line."""

    src: Path
    """Drafter directory in any supported layout."""
    out: Path
    """Where the converted drafter goes."""
    to: str
    """Layout to write: draftsmith | vllm | sglang | speculators."""
    target: str | None = None
    """The target (name, dir, .gguf): layer count, context, shape check."""
    target_layers: int | None = Field(None, ge=1)
    """The target's decoder-layer count, without --target."""
    aux_convention: str | None = None
    """Override how SRC's explicit aux ids are read: boundary | layer-output (default: the layout's own
    convention)."""
    drop_embeddings: bool = False
    """Drop an embed_tokens copy in SRC (the engines then use the target's embedding)."""
    dtype: str | None = None
    """Weights' dtype: bfloat16 | float16 | float32 (default: keep SRC's)."""
    k: int | None = Field(None, ge=1)
    """Draft tokens named in the card / speculators config (default: 3; a DFlash drafter's whole block)."""
    overwrite: bool = False
    """Replace an OUT that draftsmith did not write (its content is lost)."""
    reference: Path | None = None
    """`draftsmith eval --json` output of this drafter on held-back data: recorded as its expected acceptance,
    which `launch --guard` compares the engine with (default: none recorded)."""

    @model_validator(mode="after")
    def check_choices(self) -> ConvertSettings:
        check_choices(("--to", self.to, ("draftsmith", *FORMATS)),
                      *([("--aux-convention", self.aux_convention, AUX_CONVENTIONS)] if self.aux_convention else []),
                      *([("--dtype", self.dtype, DTYPES)] if self.dtype else []))
        return self


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("convert", help="convert a public EAGLE-3 drafter (EAGLE, SpecForge, ModelOpt, speculators) or DFlash drafter "
                       "(z-lab, speculators)",
                       **example_help(
                           "The source layout is detected; aux ids keep their meaning across conventions.\n"
                           "examples:\n"
                           "  draftsmith convert ./EAGLE3-LLaMA3.1-Instruct-8B ./eagle3-ds --to draftsmith \\\n"
                           "      --target meta-llama/Llama-3.1-8B-Instruct      # then: draftsmith eval ... --drafter ./eagle3-ds\n"
                           "  draftsmith convert ./specforge-out ./spec --to speculators --target-layers 32\n"
                           "  draftsmith convert ./modelopt-export ./vllm-ready --to vllm --target ./my-target\n"
                           "  draftsmith convert ./Qwen3-8B-DFlash-b16 ./dflash-ds --to draftsmith --target Qwen/Qwen3-8B"))
    add_flags(p, ConvertSettings, positional=("src", "out"))
    p.set_defaults(func=run_convert)


def run_convert(args) -> int:
    from draftsmith.model.checkpoint import drafter_path

    args.src = drafter_path(args.src)  # a shipped drafter's short name (smollm2), as export and eval take it
    s = from_flags(ConvertSettings, args)
    r = convert(s.src, s.out, s.to, s.target, s.target_layers, s.aux_convention, s.drop_embeddings, s.dtype,
                s.k or (None if drafter_family(read_drafter_config(s.src)) == DFLASH else DEFAULT_K), s.overwrite,
                s.reference)
    print(f"convert: {r.layout} -> {r.to} {r.out}; aux ids as boundary indices {list(r.aux_layer_ids_boundary)}")
    for note in r.notes:
        print(f"  note: {note}")
    return 0
