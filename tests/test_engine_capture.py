"""Engine capture's client and the sanity checks, against a fake capture server (unit tier, seconds).

The fake server answers `/v1/completions` and `/tokenize` as vLLM does and writes the connector's file
(`hidden_states` (T, 4, H) at the requested vLLM ids, the last one before the final norm) from a tiny
transformers target, so the whole client path (ids check, lock, final norm, store, deletion, resume)
runs without vLLM. The real server is in test_engine_capture_vllm.py (engine tier).
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import write_conversations
from draftsmith.capture.local import capture
from draftsmith.capture.vllm import (EngineSettings, check_prompt_ids, engine_capture, engine_layer_ids,
                                       final_norm, load_target_head, read_states, request_states, server_args)
from draftsmith.errors import DraftsmithError
from draftsmith.capture.sanity import check_greedy, check_store, degenerate
from draftsmith.capture.store import FeatureStore, write_shard_file

CLI = [sys.executable, "-m", "draftsmith.cli"]


class FakeCaptureServer:
    """vLLM's capture server in miniature: the target's states at `layer_ids`, written as the connector does."""

    def __init__(self, target: Path, hs_dir: Path, layer_ids: list[int] | None, shift_token: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(target).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        self.hs_dir, self.layer_ids, self.shift_token, self.requests = hs_dir, layer_ids, shift_token, 0
        self.lock, self.most_files = threading.Lock(), 0
        hs_dir.mkdir(parents=True, exist_ok=True)

    def complete(self, ids: list[int], request_id: str | None = None) -> dict:
        with self.lock:  # one forward at a time: the hook below is shared state
            return self._complete(ids, request_id)

    def _complete(self, ids: list[int], request_id: str | None) -> dict:
        self.requests += 1
        pre_norm = []
        hook = self.model.model.layers[-1].register_forward_hook(
            lambda m, a, o: pre_norm.append(o[0] if isinstance(o, tuple) else o))
        with torch.no_grad():
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
        hook.remove()
        reply = {"choices": [{"prompt_token_ids": [ids[0] + 1] + ids[1:] if self.shift_token else ids,
                              "token_ids": [int(out.logits[0, -1].argmax())]}]}
        if self.layer_ids is None:  # started without the capture flags
            return reply
        n = len(self.model.model.layers)
        states = torch.stack([pre_norm[0][0] if k == n else out.hidden_states[k][0] for k in self.layer_ids], 1)
        # vLLM's name: the request id from X-Request-Id, "cmpl-" before it and the prompt index after
        path = self.hs_dir / f"cmpl-{request_id or self.requests}-0.safetensors"
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, str(path))
        self.most_files = max(self.most_files, len(list(self.hs_dir.glob("*.safetensors"))))
        return {**reply, "kv_transfer_params": {"hidden_states_path": str(path)}}

    def tokenize(self, text: str) -> dict:
        return {"tokens": self.tokenizer(text, add_special_tokens=False)["input_ids"]}


@pytest.fixture
def fake_server(tiny_target, tmp_path, request):
    kind = getattr(request, "param", "capture")
    fake = FakeCaptureServer(tiny_target, tmp_path / "hs", None if kind == "plain" else [2, 4, 5, 8],
                             shift_token=kind == "shifted")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = (fake.complete(body["prompt"], self.headers.get("X-Request-Id")) if self.path == "/v1/completions"
                     else fake.tokenize(body["prompt"]))
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", fake
    server.shutdown()
    server.server_close()


def test_engine_store_equals_the_in_process_store_and_leaves_no_connector_files(fake_server, tiny_target, tmp_path):
    url, fake = fake_server
    conv = write_conversations(tmp_path / "conv.jsonl", n=8)
    capture(conv, tmp_path / "ref", target=str(tiny_target), shard_tokens=300)
    settings = EngineSettings(fake.hs_dir, concurrency=3)
    engine_capture(conv, tmp_path / "eng", settings, target=str(tiny_target), shard_tokens=300, endpoint=url)
    ref, eng = FeatureStore(tmp_path / "ref"), FeatureStore(tmp_path / "eng")
    assert len(eng) == len(ref) == 8 and eng.identity == ref.identity
    for k in range(len(ref)):
        a, b = ref.sample(k), eng.sample(k)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        # Both stored in bf16 from fp32 states of the same weights: at most one bf16 ulp apart.
        assert torch.allclose(a.aux.float(), b.aux.float(), rtol=1e-2, atol=1e-2)
        assert torch.allclose(a.last.float(), b.last.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(a.target_argmax, b.target_argmax)
    assert torch.equal(ref.token_counts(), eng.token_counts())
    assert not list(fake.hs_dir.iterdir()), "every request's file is deleted once stored"
    assert fake.most_files <= 3, f"at most --concurrency files in flight, saw {fake.most_files}"


def test_engine_capture_resumes_after_the_last_complete_shard(fake_server, tiny_target, tmp_path):
    url, fake = fake_server
    conv = write_conversations(tmp_path / "conv.jsonl", n=8)
    settings = EngineSettings(fake.hs_dir, concurrency=2)
    engine_capture(conv, tmp_path / "full", settings, target=str(tiny_target), shard_tokens=1, endpoint=url)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    manifest = json.loads((part / "manifest.json").read_text())
    kept = manifest["shards"][:3]  # a run killed after its third shard
    manifest.update(shards=kept, complete=False, num_samples=sum(s["num_samples"] for s in kept))
    (part / "manifest.json").write_text(json.dumps(manifest))
    before = fake.requests
    engine_capture(conv, part, settings, target=str(tiny_target), shard_tokens=1, endpoint=url)
    assert fake.requests - before == 8 - 3, "only the samples after the last complete shard are sent"
    full, resumed = FeatureStore(tmp_path / "full"), FeatureStore(part)
    assert [s["sha256"] for s in full.manifest["shards"]] == [s["sha256"] for s in resumed.manifest["shards"]]


@pytest.mark.parametrize("fake_server", ["plain"], indirect=True)
def test_a_server_without_the_capture_flags_is_named(fake_server, tiny_target, tmp_path):
    url, _ = fake_server
    with pytest.raises(DraftsmithError, match="extract_hidden_states") as err:
        request_states(url, [1, 2, 3])
    assert "--print-server-args" in str(err.value)


@pytest.mark.parametrize("fake_server", ["shifted"], indirect=True)
def test_server_token_mismatch_shows_the_first_differing_token(fake_server, tiny_target, tmp_path):
    url, fake = fake_server
    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    with pytest.raises(DraftsmithError, match="position 0") as err:
        engine_capture(conv, tmp_path / "eng", EngineSettings(fake.hs_dir), target=str(tiny_target), endpoint=url)
    assert "server" in str(err.value) and "draftsmith" in str(err.value)


def test_prompt_id_mismatch_names_position_and_both_tokens(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    check_prompt_ids(ids, list(ids), tok)
    with pytest.raises(DraftsmithError, match=f"position {len(ids) - 1}") as err:
        check_prompt_ids(ids, ids[:-1] + [ids[-1] + 1], tok)
    assert repr(tok.decode([ids[-1]])) in str(err.value)


def test_a_connector_error_file_is_reported_with_its_reason(tmp_path):
    path = tmp_path / "req.safetensors"
    Path(str(path) + ".error").write_text(json.dumps({"error": "connector folder full: 900 bytes held"}))
    with pytest.raises(DraftsmithError, match="connector folder full"):
        read_states(path, timeout_s=1)


def test_server_args_ask_for_aux_ids_plus_the_last_layer_without_prefix_caching(tmp_path):
    ids = engine_layer_ids((2, 4, 5), 8)
    assert ids == [2, 4, 5, 8]
    args = server_args(ids, EngineSettings(tmp_path, max_bytes=1000, tensor_parallel=2))
    assert "--no-enable-prefix-caching" in args and args[args.index("--tensor-parallel-size") + 1] == "2"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["draftsmith_max_bytes"] == 1000


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_before_a_start(tiny_target, tmp_path):
    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    settings = EngineSettings(tmp_path / "hs", tensor_parallel=3)  # the tiny target has 4 heads
    with pytest.raises(DraftsmithError, match="a divisor of 4: 1, 2, 4"):
        engine_capture(conv, tmp_path / "eng", settings, target=str(tiny_target), endpoint="http://127.0.0.1:9")


def test_final_norm_is_the_targets_own_norm(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    head = load_target_head(tiny_target)
    x = torch.randn(5, model.config.hidden_size) * 3
    with torch.no_grad():
        assert torch.allclose(final_norm(x, head), model.model.norm(x), atol=1e-6)
    assert torch.equal(head.head, model.lm_head.weight.detach())  # untied: the head, not the embeddings


# ---------------------------------------------------------------- sanity

def test_degenerate_states_are_named():
    good = torch.randn(4, 8)
    assert degenerate(good) is None
    assert degenerate(torch.zeros(4, 8)) == "all zero"
    assert "non-finite" in degenerate(torch.where(good > 1, float("nan"), good))
    flat = good.clone()
    flat[2] = 0.5
    assert "at 1 of 4 tokens (first at token 2)" in degenerate(flat)


def test_final_state_that_disagrees_with_the_engines_greedy_token_is_refused():
    head = torch.eye(4) * 10
    last = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    check_greedy(last, head, 1)
    check_greedy(torch.tensor([[0.0, 1.0, 0.99, 0.0]]), head, 2)  # a near tie is not an error
    with pytest.raises(DraftsmithError, match="engine token 3"):
        check_greedy(last, head, 3)


def test_a_deliberately_zeroed_shard_is_caught(tiny_target, tmp_path):
    conv = write_conversations(tmp_path / "conv.jsonl", n=6)
    store_dir = tmp_path / "store"
    capture(conv, store_dir, target=str(tiny_target), shard_tokens=200)
    store = FeatureStore(store_dir)
    assert check_store(store) == 6
    manifest = json.loads((store_dir / "manifest.json").read_text())
    entry = manifest["shards"][1]
    first = sum(s["num_samples"] for s in manifest["shards"][:1])
    samples = [store.sample(first + j) for j in range(entry["num_samples"])]
    for s in samples:
        s.aux = torch.zeros_like(s.aux)
    entry["sha256"], _ = write_shard_file(store_dir / entry["file"], samples)  # a valid file, so sha256 passes
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DraftsmithError, match=f"sample {first} \\({entry['file']}\\): aux is all zero"):
        check_store(FeatureStore(store_dir))
    r = subprocess.run([*CLI, "capture", "--verify", "--out", str(store_dir)], capture_output=True, text=True)
    assert r.returncode == 2 and "all zero" in r.stderr
