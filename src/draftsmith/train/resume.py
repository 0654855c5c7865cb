"""Checkpoints, exact resume, and the check that a resume continues a run made with the same settings.

OUT/checkpoints/step-NNNNNN holds the drafter (`save_drafter`) and training_state.pt: the step, the optimizer
state and the RNG states (torch CPU, Python, CUDA). OUT/checkpoints/latest names the newest, rewritten last, so
a run killed mid-save resumes from the one before. The learning rate is a pure function of the step and the data
order one of (seed, epoch) (`packing`), so the step is the whole data position: a resumed run takes the same
micro-batches with the same learning rates as one that was never stopped.

OUT/train_config.json records the settings a run was started with (`record`). A run into an --out that holds one
continues it only when every setting that shapes the weights or the data order is the same (`check_out`); only
the RESUMABLE ones may change. --overwrite starts over, deleting only what train writes there (`start_over`).

    check_out(cfg, world)            # before any work: refuse a folder of the user's, or another run's
    write_checkpoint(out / "checkpoints" / "step-000100", drafter, 100, *full_states(drafter, opt, False), False, {})
    step = restore(latest_checkpoint(out), drafter, opt, False, embed_tokens)
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from draftsmith.config import as_flags, changed, shown_changes
from draftsmith.errors import DraftsmithError
from draftsmith.model.checkpoint import load_drafter, save_drafter
from draftsmith.model.eagle3 import Eagle3Drafter
from draftsmith.outputs import MARKER, check_apart, check_output
from draftsmith.train.settings import TrainConfig
from draftsmith.train.shards import CONSUMED

RECORD = "train_config.json"
WRITES = ("checkpoints", "metrics.jsonl", RECORD, "drafter", CONSUMED, MARKER)
"""What train writes into --out: all that --overwrite deletes."""
RESUMABLE = frozenset({"max_steps", "epochs", "eval_every", "save_every", "log_every", "keep_start", "device",
                       "compile", "cuda_graphs", "parallel", "follow_timeout_s", "out", "overwrite"})
"""Settings a resume may change: the run's length (max_steps, epochs: a longer run continues on the schedule
of its new length from the step it reached), how often it evaluates, saves and logs, whether the starting
drafter may be kept, and where and how the same step computes (device, compile, cuda_graphs, parallel: `restore`
refuses an optimizer state laid out for the other --parallel mode). Every other setting, and the number of
processes, decides the weights or the data order: a resume with another value is refused."""
ONLINE_ONLY = ("target", "aux_ids", "max_length")
"""Read only by online training (an offline run takes them from its store): not compared for an offline run."""
PATHS = ("store", "conversations", "init_from")


def absolute_paths(settings: dict) -> dict:
    """The settings with each path that exists from this working directory made absolute (a short name such as
    init_from `smollm2` stays), so a record compares the same from any folder the command is run in."""
    return {k: os.path.abspath(v) if k in PATHS and v and Path(v).exists() else v for k, v in settings.items()}


def record(cfg: TrainConfig, world: int) -> dict:
    """What train_config.json records of a run: its settings (paths absolute), the peak lr they resolve to and the
    processes."""
    return {**absolute_paths(cfg.model_dump(exclude={"overwrite"})), "peak_lr": cfg.peak_lr, "world": world}


def shaping(settings: dict) -> dict:
    """The recorded settings a resume must match: lr as the peak lr it resolves to (null: its default), paths
    absolute."""
    keep = {k: v for k, v in settings.items() if k not in RESUMABLE and k not in ("lr", "peak_lr")
            and not (settings.get("store") and k in ONLINE_ONLY)}
    return {"lr": settings.get("peak_lr"), **absolute_paths(keep)}


def is_train_run(out: Path) -> bool:
    """`out` holds a run of train's (its record, or a checkpoint), marker or not."""
    return (out / RECORD).is_file() or (out / "checkpoints" / "latest").is_file()


def check_out(cfg: TrainConfig, world: int) -> None:
    """Refuse --out when it holds files train did not write, or a run trained with other settings (RESUMABLE
    excepted), unless --overwrite. Reads only; call it before any work.

    Raises:
        DraftsmithError: exit 2, naming each differing setting (old -> new) and the fixes.
    """
    # the inputs: --overwrite may not make a run of them
    check_apart(Path(cfg.out), "train", "--out", {"--store": cfg.store, "--conversations": cfg.conversations,
                                                  "--init-from": cfg.init_from})
    check_output(Path(cfg.out), "train", cfg.overwrite, owns=is_train_run)
    check_settings(cfg, world)


def check_settings(cfg: TrainConfig, world: int) -> None:
    """Refuse a run in --out trained with other settings (RESUMABLE excepted), unless --overwrite."""
    out = Path(cfg.out)
    if cfg.overwrite or not out.is_dir():
        return
    fixes = "for a new run pass another --out, or add --overwrite to delete this run's checkpoints and start over"
    checkpoint = latest_checkpoint(out)
    try:
        old = json.loads((out / RECORD).read_text()) if (out / RECORD).is_file() else None
    except (OSError, ValueError):
        old = "unreadable"
    if not isinstance(old, dict):
        if checkpoint is None:
            return
        raise DraftsmithError(f"train: {out} holds checkpoints without a readable record of their settings",
                              got=f"{checkpoint.name}, {RECORD} {'missing' if old is None else 'unreadable'}",
                              expected=f"{RECORD}, which train writes beside its checkpoints", fix=fixes)
    changes = changed(shaping(old), shaping(record(cfg, world)))
    if changes:
        at = f"its checkpoint at step {int(checkpoint.name.split('-')[-1])}" if checkpoint else "no checkpoint yet"
        raise DraftsmithError(f"train: {out} holds a run trained with other settings ({at})",
                              got=shown_changes(changes),
                              expected=f"the settings {out / RECORD} records; a resume may change only "
                                       f"{', '.join(sorted(RESUMABLE - {'out', 'overwrite'}))}",
                              fix=f"did you mean to resume it? run with {resume_flags(changes)}; {fixes}")


def resume_flags(changes: dict) -> str:
    """The recorded values of the changed settings, as the command line takes them."""
    text = as_flags({k: v for k, (v, _) in changes.items() if k != "world"})
    if "world" in changes:
        n = changes["world"][0]
        text += (" and " if text else "") + (f"torchrun --nproc-per-node {n}" if n > 1 else "one process")
    return text


def start_over(out: Path) -> None:
    """--overwrite: delete what train writes into `out` (WRITES), and nothing else there."""
    for name in WRITES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


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
