"""Checkpoints and exact resume.

OUT/checkpoints/step-NNNNNN holds the drafter (`save_drafter`) and training_state.pt: the step, the optimizer
state and the RNG states (torch CPU, Python, CUDA). OUT/checkpoints/latest names the newest, rewritten last, so
a run killed mid-save resumes from the one before. The learning rate is a pure function of the step and the data
order one of (seed, epoch) (`packing`), so the step is the whole data position: a resumed run takes the same
micro-batches with the same learning rates as one that was never stopped.

    write_checkpoint(out / "checkpoints" / "step-000100", drafter, 100, *full_states(drafter, opt, False), False, {})
    step = restore(latest_checkpoint(out), drafter, opt, False, embed_tokens)
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.model.checkpoint import load_drafter, save_drafter
from draftsmith.model.eagle3 import Eagle3Drafter


def optimizer_layout(fsdp: bool) -> str:
    """How training_state.pt holds the optimizer state: FSDP2's full state dict keyed by name, or torch's own."""
    return "fsdp" if fsdp else "torch"


def full_states(drafter: Eagle3Drafter, optimizer: torch.optim.Optimizer, fsdp: bool) -> tuple[dict | None, dict]:
    """(model state or None for the module's own, optimizer state); under FSDP gathered on every rank
    (a collective: all ranks call it) into full, unsharded tensors keyed by parameter name."""
    if not fsdp:
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(drafter, options=options),
            get_optimizer_state_dict(drafter, optimizer, options=options))


def write_checkpoint(path: Path, drafter: Eagle3Drafter, step: int, model_state: dict | None, optim_state: dict,
                     fsdp: bool, extra: dict) -> None:
    """Write checkpoint `path` (the drafter, then training_state.pt), then point `latest` beside it at it."""
    save_drafter(drafter, path, extra={"trained_steps": step, **extra}, state=model_state)
    state = {"step": step, "optimizer": optim_state, "optimizer_layout": optimizer_layout(fsdp),
             "rng_cpu": torch.get_rng_state(), "rng_python": random.getstate()}
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, path / "training_state.pt.tmp")
    os.replace(path / "training_state.pt.tmp", path / "training_state.pt")
    (path.parent / "latest.tmp").write_text(path.name + "\n")
    os.replace(path.parent / "latest.tmp", path.parent / "latest")


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint OUT/checkpoints/latest names, or None when the run has none yet."""
    latest = out / "checkpoints" / "latest"
    return out / "checkpoints" / latest.read_text().strip() if latest.is_file() else None


def restore(path: Path, drafter: Eagle3Drafter, optimizer: torch.optim.Optimizer, fsdp: bool,
            embed_tokens: torch.Tensor) -> int:
    """Load checkpoint `path` into the drafter and optimizer, and set the RNG states it saved. Returns its step.

    Raises:
        DraftsmithError: it was written under the other --parallel mode (its optimizer state is laid out so).
    """
    saved = load_drafter(path, embed_tokens)
    state = torch.load(path / "training_state.pt", weights_only=True)
    layout = state.get("optimizer_layout", "torch")
    if layout != optimizer_layout(fsdp):
        raise DraftsmithError("checkpoint written under another --parallel mode", got=f"{layout} optimizer state in {path}",
                              expected="fsdp" if fsdp else "ddp / single process",
                              fix="resume with the --parallel mode the run was started with")
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(drafter, saved.state_dict(), options=options)
        set_optimizer_state_dict(drafter, optimizer, state["optimizer"], options=options)
    else:
        drafter.load_state_dict(saved.state_dict())
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_cpu"])
    random.setstate(state["rng_python"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    return int(state["step"])
