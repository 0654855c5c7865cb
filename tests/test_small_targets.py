"""Small targets: a six-layer target captures, trains and exports on default aux ids the user never chose, and a
target too shallow for any default is one named error when it is resolved.

EAGLE-3's (2, N//2, N-3) repeats a layer below 7 layers ((2, 3, 3) at 6); draftsmith's default there is (2, 3, 4)
(`conventions.default_aux_ids`), and export writes it out so that no engine falls back to its own (2, 3, 3).
"""

from __future__ import annotations

import json

import pytest
import torch

from badinput import refused, snapshot
from conftest import build_tiny_target, write_conversations
from draftsmith.capture.store import FeatureStore
from draftsmith.cli import main
from draftsmith.conventions import FORMAT_READER, engine_default_aux_ids, engine_reads

SIX = (2, 3, 4)  # boundary indices: the input of layers 2, 3 and 4 of six


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("six") / "target", layers=6)


@pytest.fixture(scope="module")
def six_store(six_layers, tmp_path_factory):
    """A store captured by `draftsmith capture` on the six-layer target, without --aux-ids."""
    root = tmp_path_factory.mktemp("six_store")
    conv = write_conversations(root / "conv.jsonl", n=6)
    assert main(["capture", "--target", str(six_layers), "--conversations", str(conv), "--out", str(root / "store"),
                 "--device", "cpu"]) == 0
    return root / "store"


def test_target_shows_a_six_layer_targets_distinct_default(six_layers, capsys):
    capsys.readouterr()
    assert main(["target", str(six_layers), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["num_layers"] == 6 and shown["default_aux_ids"] == list(SIX)


def test_capture_without_aux_ids_stores_three_distinct_layers_of_a_six_layer_target(six_layers, six_store):
    from transformers import AutoModelForCausalLM

    store = FeatureStore(six_store)
    assert store.verify() >= 1
    assert store.identity["aux_layer_ids"] == list(SIX)
    model = AutoModelForCausalLM.from_pretrained(six_layers).eval()
    s = store.sample(0)
    with torch.no_grad():
        out = model(s.input_ids.long()[None], output_hidden_states=True)
    want = torch.cat([out.hidden_states[i] for i in SIX], -1)[0]
    assert torch.allclose(s.aux.float(), want, atol=2e-2, rtol=2e-2)  # stored in bf16


def test_a_six_layer_drafter_exports_ids_each_engine_reads_back_as_trained(six_store, tmp_path):
    from draftsmith.export.formats import export
    from draftsmith.train.settings import TrainConfig
    from draftsmith.train.trainer import Trainer

    settings = TrainConfig(out=str(tmp_path / "run"), store=str(six_store), max_steps=2, batch_tokens=256,
                           draft_vocab_size=128, ttt_steps=2, eval_fraction=0.0, log_every=10**6, recipe="plain")
    Trainer(settings).run(progress=False)  # plain: SGLang computes no norm variant
    drafter = tmp_path / "run" / "drafter"
    assert json.loads((drafter / "config.json").read_text())["draftsmith"]["aux_layer_ids_boundary"] == list(SIX)
    for fmt in ("vllm", "sglang", "speculators"):
        config = json.loads((export(drafter, tmp_path / fmt, fmt, dtype="float32") / "config.json").read_text())
        assert engine_reads(config, 6, FORMAT_READER[fmt]) == SIX != engine_default_aux_ids(6), fmt


@pytest.mark.parametrize("layers,fix", [(3, "--aux-ids 0,1,2"), (2, "at least 3 decoder layers")])
def test_a_target_too_shallow_for_a_default_is_refused_by_name_when_resolved(layers, fix, tmp_path, capsys):
    target = build_tiny_target(tmp_path / f"t{layers}", layers=layers)
    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    before = snapshot(tmp_path)
    refused(capsys, ["target", str(target)], tmp_path, before, f"target {str(target)!r} has too few decoder layers",
            f"{layers} decoder layers", fix)
    refused(capsys, ["capture", "--target", str(target), "--conversations", str(conv), "--out", str(tmp_path / "s")],
            tmp_path, before, "has too few decoder layers", f"{layers} decoder layers", fix)


def test_a_three_layer_target_captures_on_the_ids_the_error_names(tmp_path):
    target = build_tiny_target(tmp_path / "t3", layers=3)
    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    assert main(["capture", "--target", str(target), "--conversations", str(conv), "--out", str(tmp_path / "s"),
                 "--aux-ids", "0,1,2", "--device", "cpu"]) == 0
    assert FeatureStore(tmp_path / "s").identity["aux_layer_ids"] == [0, 1, 2]
