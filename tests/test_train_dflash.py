"""`draftsmith train --family dflash`: the shared Trainer trains a DFlash drafter online and offline, writes a
loadable checkpoint, resumes only what matches, and learns a tiny repeated dataset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_conversations
from draftsmith.capture.local import capture
from draftsmith.errors import DraftsmithError
from draftsmith.model.checkpoint import load_drafter, read_drafter_config
from draftsmith.model.dflash import DFlashDrafter
from draftsmith.train.settings import TrainConfig
from draftsmith.train.trainer import Trainer

FLAGS = ["--family", "dflash", "--mask-token-id", "0", "--block-size", "4", "--num-anchors", "8",
         "--drafter-layers", "1", "--batch-tokens", "256", "--lr", "3e-3", "--eval-fraction", "0.2", "--quiet"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_family_dflash_online_writes_a_loadable_drafter_and_resumes_only_what_matches(tiny_target, tmp_path):
    conv = write_conversations(tmp_path / "conv.jsonl", n=8)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "draftsmith.cli", "train", "--conversations", str(conv), "--target", str(tiny_target),
           "--out", str(out), "--max-steps", "2", *FLAGS]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "block tau" in done.stdout and "DFlash drafter: 1 layers, block 4" in done.stdout
    drafter = load_drafter(out / "drafter")
    assert isinstance(drafter, DFlashDrafter)
    assert drafter.config.aux_layer_ids == (2, 3, 4, 5, 6)  # the default spread over the 8-layer target
    assert read_drafter_config(out / "drafter")["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    steps = [r for r in records(out) if "acc" in r and "eval" not in r]
    assert [len(r["acc"]) for r in steps] == [3, 3] and all(r["block_tau"] >= 1 for r in steps)
    # a longer run continues it; another block size is refused
    longer = subprocess.run([*cmd[:-len(FLAGS) - 2], "--max-steps", "3", *FLAGS], capture_output=True, text=True)
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert max(r["step"] for r in records(out) if "loss" in r) == 3
    flags = [*FLAGS]
    flags[flags.index("--block-size") + 1] = "5"
    other = subprocess.run([*cmd[:-len(FLAGS) - 2], "--max-steps", "3", *flags], capture_output=True, text=True)
    assert other.returncode == 2 and "block_size" in other.stderr, other.stderr[-2000:]


def test_dflash_loss_goes_down_on_a_tiny_repeated_store_of_any_aux_count(tiny_target, tmp_path):
    conv = write_conversations(tmp_path / "conv.jsonl", n=4)
    capture(conv, tmp_path / "store", target=str(tiny_target))
    cfg = TrainConfig(out=str(tmp_path / "run"), store=str(tmp_path / "store"), family="dflash", mask_token_id=0,
                      block_size=4, num_anchors=16, drafter_layers=1, lr=1e-2, warmup_ratio=0.0, max_steps=30,
                      batch_tokens=512, eval_fraction=0.0, eval_every=10**6, save_every=10**6, log_every=10**6)
    with Trainer(cfg) as trainer:
        assert trainer.drafter.fc.in_features == 3 * 64  # the store's three aux layers
        trainer.run(progress=False)
    losses = [r["loss"] for r in records(tmp_path / "run") if "acc" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses  # 11.3 -> 5.8 here; an untrained drafter stays ~11


def test_dflash_settings_are_bounded_and_need_a_mask_token(tmp_path):
    with pytest.raises(DraftsmithError, match="mask token"):
        TrainConfig(out=str(tmp_path), store="s", family="dflash")
    for bad in ({"block_size": 1}, {"block_size": 65}, {"num_anchors": 0}, {"loss_gamma": 0.0}):
        with pytest.raises(Exception, match="greater|less"):
            TrainConfig(out=str(tmp_path), store="s", family="dflash", mask_token_id=0, **bad)


def test_a_trained_dflash_drafter_exports_and_evals_through_the_verbs(tiny_target, tmp_path):
    """train -> export --format vllm -> eval: the eval verb decodes with DFlash blocks (greedy output equal to the
    target's, tau within 1..k+1 at each k) and refuses a k the block cannot draft before the target loads."""
    conv = write_conversations(tmp_path / "conv.jsonl", n=8)
    run = [sys.executable, "-m", "draftsmith.cli"]
    out, exported = tmp_path / "run", tmp_path / "export-vllm"
    trained = subprocess.run([*run, "train", "--conversations", str(conv), "--target", str(tiny_target), "--out",
                              str(out), "--max-steps", "2", *FLAGS], capture_output=True, text=True)
    assert trained.returncode == 0, trained.stderr[-2000:]
    done = subprocess.run([*run, "export", str(out / "drafter"), str(exported), "--format", "vllm", "--dtype",
                           "float32"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    report = tmp_path / "eval.json"
    ev = subprocess.run([*run, "eval", "--target", str(tiny_target), "--drafter", str(exported), "--prompts",
                         "chat-eval", "--limit", "2", "--max-new-tokens", "12", "--k", "1,3", "--json", str(report)],
                        capture_output=True, text=True)
    assert ev.returncode == 0, ev.stderr[-2000:]
    rows = json.loads(report.read_text())["sweep"]
    assert [r["k"] for r in rows] == [1, 3]
    for r in rows:
        assert 1.0 <= r["tau"] <= r["k"] + 1 and r["identical_to_target"] is True
    too_long = subprocess.run([*run, "eval", "--target", str(tiny_target), "--drafter", str(exported), "--prompts",
                               "chat-eval", "--limit", "1", "--k", "4"], capture_output=True, text=True)
    assert too_long.returncode == 2 and "block size - 1" in too_long.stderr, too_long.stderr[-2000:]
