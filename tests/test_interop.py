"""export-store --format speculators: the round trip, the pre-norm final state, and the index speculators loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import build_tiny_target, write_conversations
from draftsmith.capture.local import capture
from draftsmith.errors import DraftsmithError
from draftsmith.capture.interop import (EXPORT_INFO, TOKEN_FREQ, export_speculators, final_norm, hs_path, read_speculators,
                                write_index)
from draftsmith.capture.store import FeatureStore


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny target whose final norm weight is far from 1 (so dividing by it matters), its store, its export."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("interop")
    target = build_tiny_target(root / "target")
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        torch.manual_seed(3)
        model.model.norm.weight.copy_(torch.empty(64).uniform_(0.2, 3.0) * torch.where(torch.rand(64) < 0.2, -1, 1))
    model.save_pretrained(target)
    capture(write_conversations(root / "conv.jsonl", n=12), root / "store", target=str(target), shard_tokens=300)
    info = export_speculators(root / "store", root / "out", index=False)
    return root, target, info


def test_round_trip_keeps_tokens_masks_and_aux_states_bit_for_bit(exported):
    root, _, info = exported
    store = FeatureStore(root / "store")
    assert len(store.manifest["shards"]) > 1, "the fixture should span several shards"
    back = list(read_speculators(root / "out"))
    assert len(back) == len(store) == info["num_samples"]
    for k, peer in enumerate(back):
        s = store.sample(k)
        assert torch.equal(peer.input_ids, s.input_ids), f"sample {k}: token ids differ"
        assert torch.equal(peer.loss_mask, s.loss_mask), f"sample {k}: loss mask differs"
        assert torch.equal(peer.aux, s.aux), f"sample {k}: aux states differ"
    assert info["num_tokens"] == store.manifest["num_tokens"]


def test_the_targets_own_norm_maps_the_exported_final_state_back_to_the_stores(exported):
    # speculators computes logits as verifier_lm_head(verifier_norm(h)); h must be the pre-norm state.
    from transformers import LlamaForCausalLM

    root, target, _ = exported
    norm = LlamaForCausalLM.from_pretrained(target).model.norm
    store = FeatureStore(root / "store")
    for k, peer in enumerate(read_speculators(root / "out")):
        with torch.no_grad():
            renormed = norm(peer.last.float()).to(torch.bfloat16)
        # bf16 rounding of y / w, then of the norm's output: bf16's own tolerance (rtol 1.6e-2)
        torch.testing.assert_close(renormed, store.sample(k).last, msg=f"sample {k}: final state does not round-trip")
    assert not torch.allclose(peer.last.float(), store.sample(k).last.float(), rtol=0.05), \
        "with a norm weight far from 1 the exported (pre-norm) state must differ from the stored post-norm one"


def test_hidden_state_files_have_the_layout_speculators_reads(exported):
    root, _, _ = exported
    store = FeatureStore(root / "store")
    H = store.hidden_size
    with safe_open(str(hs_path(root / "out", 0)), framework="pt") as f:
        hs, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    T = len(store.sample(0).input_ids)
    assert hs.shape == (T, 4, H) and hs.dtype == torch.bfloat16
    assert ids.dtype == torch.int64 and ids.shape == (T,)
    # speculators: hidden_states[:, :-1].flatten(1) is the [T, 3H] aux input
    assert torch.equal(hs[:, :-1].flatten(1), store.sample(0).aux)


def test_token_frequencies_count_supervised_tokens_like_prepare_data(exported):
    root, _, _ = exported
    freq = torch.load(root / "out" / TOKEN_FREQ, weights_only=True)
    store = FeatureStore(root / "store")
    want: dict[int, int] = {}
    for s in store:
        for t in s.input_ids[s.loss_mask.bool()].tolist():
            want[t] = want.get(t, 0) + 1
    assert freq == want


def test_without_datasets_the_index_is_skipped_with_the_fix(exported, monkeypatch):
    root, _, _ = exported
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    msg = write_index(root / "out")
    assert msg.startswith("not written") and "--index-only" in msg and "datasets" in msg


def test_index_loads_in_datasets_in_sample_order(exported, tmp_path):
    datasets = pytest.importorskip("datasets")
    import shutil

    root, _, _ = exported
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    assert write_index(out) == "written"
    ds = datasets.load_from_disk(str(out))  # in torch format as saved, as speculators reads it
    store = FeatureStore(root / "store")
    assert len(ds) == len(store) and not (out / ".index.tmp").exists()
    for k in (0, len(store) - 1):
        assert torch.equal(ds[k]["input_ids"], store.sample(k).input_ids.long())
        assert torch.equal(ds[k]["loss_mask"], store.sample(k).loss_mask.long())
        assert int(ds[k]["seq_len"]) == len(store.sample(k).input_ids)


def test_speculators_own_dataset_reads_the_export(exported, tmp_path):
    pytest.importorskip("speculators")
    from speculators.train.data import ArrowDataset
    import shutil

    root, _, _ = exported
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    assert write_index(out) == "written"
    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    store = FeatureStore(root / "store")
    for k in range(len(store)):
        item, s = ds[k], store.sample(k)
        assert torch.equal(item["input_ids"], s.input_ids.long()) and torch.equal(item["loss_mask"].long(), s.loss_mask.long())
        assert torch.equal(item["hidden_states"], s.aux)
        assert item["verifier_last_hidden_states"].shape == s.last.shape


def test_missing_sample_file_is_named(exported, tmp_path):
    import shutil

    root, _, _ = exported
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    hs_path(out, 2).unlink()
    with pytest.raises(DraftsmithError, match="hs_2.safetensors"):
        list(read_speculators(out))


def test_zero_norm_weight_is_refused(tmp_path):
    from transformers import LlamaForCausalLM

    target = build_tiny_target(tmp_path / "t")
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.model.norm.weight[5] = 0.0
    model.save_pretrained(target)
    with pytest.raises(DraftsmithError, match="zero weights"):
        final_norm(target)


def test_cli_exports_and_shows_a_worked_example(exported, tmp_path):
    root, target, _ = exported
    import os

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cmd = [sys.executable, "-m", "draftsmith.cli", "export-store"]
    help_text = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env).stdout
    assert "--format speculators" in help_text and "speculators train --data-path" in help_text
    res = subprocess.run([*cmd, str(root / "store"), str(tmp_path / "cli"), "--format", "speculators", "--target",
                          str(target), "--json"], capture_output=True, text=True, env=env)
    info = json.loads(res.stdout)
    assert res.returncode == (0 if info["index"] == "written" else 1), res.stderr  # 1: no index (no `datasets`)
    assert (tmp_path / "cli" / EXPORT_INFO).is_file() and hs_path(tmp_path / "cli", 0).is_file()
    assert info["num_samples"] == len(FeatureStore(root / "store"))
