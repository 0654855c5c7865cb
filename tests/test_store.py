"""Feature store and capture: contents, verification, resume after kill -9, and clean failures."""

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
from draftsmith.capture.local import capture
from draftsmith.errors import DraftsmithError
from draftsmith.capture.store import FeatureStore

CLI = [sys.executable, "-m", "draftsmith.cli"]


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def captured(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    conv = write_conversations(root / "conv.jsonl", n=30)
    capture(conv, root / "store", target=str(tiny_target), shard_tokens=400)
    return root, conv


def test_store_holds_the_targets_own_hidden_states(captured, tiny_target):
    from transformers import AutoModelForCausalLM

    root, _ = captured
    store = FeatureStore(root / "store")
    assert store.verify() == len(store.manifest["shards"]) > 1
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    s = store.sample(3)
    with torch.no_grad():
        out = model(s.input_ids.long()[None], output_hidden_states=True)
    aux_ids = store.identity["aux_layer_ids"]
    assert aux_ids == [2, 4, 5]  # (2, N//2, N-3) for the 8-layer target, boundary indices
    want = torch.cat([out.hidden_states[i] for i in aux_ids], -1)[0]
    assert torch.allclose(s.aux.float(), want, atol=2e-2, rtol=2e-2)  # stored in bf16
    assert torch.allclose(s.last.float(), out.hidden_states[-1][0], atol=2e-2, rtol=2e-2)
    counts = store.token_counts()
    assert int(counts.sum()) == store.manifest["num_supervised_tokens"] > 0


def test_corrupt_shard_is_refused_by_name(captured, tmp_path):
    import shutil

    root, _ = captured
    copy = tmp_path / "store"
    shutil.copytree(root / "store", copy)
    shard = copy / json.loads((copy / "manifest.json").read_text())["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match=shard.name):
        FeatureStore(copy).verify()
    r = run_cli("capture", "--verify", "--conversations", "x", "--out", copy)
    assert r.returncode == 2 and "sha256 mismatch" in r.stderr


def test_store_from_another_target_is_refused(captured):
    root, _ = captured
    store = FeatureStore(root / "store")
    with pytest.raises(DraftsmithError, match="different target"):
        store.check_target({"name": "other", "config_sha256": "0" * 64})


def test_kill_minus_9_mid_capture_then_rerun_completes_identically(captured, tiny_target, tmp_path):
    root, conv = captured
    out = tmp_path / "store"
    cmd = [*CLI, "capture", "--target", tiny_target, "--conversations", conv, "--out", out, "--shard-tokens", "400",
           "--batch-tokens", "128"]
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        m = out / "manifest.json"
        if m.exists() and len(json.loads(m.read_text())["shards"]) >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = json.loads((out / "manifest.json").read_text())
    assert not partial["complete"], "the capture finished before it could be killed; the test proves nothing"
    r = run_cli(*cmd[3:])
    assert r.returncode == 0, r.stderr
    resumed = FeatureStore(out)
    assert resumed.verify() == len(resumed.manifest["shards"])
    reference = FeatureStore(root / "store")
    assert len(resumed) == len(reference) and resumed.manifest["num_tokens"] == reference.manifest["num_tokens"]
    for k in range(len(reference)):  # same samples in the same order; features equal up to batching numerics
        a, b = resumed.sample(k), reference.sample(k)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.allclose(a.aux.float(), b.aux.float(), atol=3e-2)
    assert not list(out.glob("*.tmp"))


def test_full_disk_leaves_nothing_half_written_and_rerun_completes(captured, tiny_target, tmp_path):
    """A real write failure: the OS refuses to grow files past RLIMIT_FSIZE (EFBIG), like a full disk. The limit
    (150 kB) lets the target head (~77 kB, published first) through and stops the first shard (~210 kB)."""
    _, conv = captured
    out = tmp_path / "store"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (150000, 150000)); from draftsmith.cli import main; "
            f"sys.exit(main({[ 'capture', '--target', str(tiny_target), '--conversations', str(conv), '--out', str(out), '--shard-tokens', '400']!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "could not write shard-" in r.stderr and "fix:" in r.stderr
    assert not list(out.glob("*.tmp"))
    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.exists() else {"complete": False, "shards": []}
    assert not manifest["complete"]
    assert {p.name for p in out.glob("shard-*")} == {e["file"] for e in manifest["shards"]}  # only whole shards
    r = run_cli("capture", "--target", tiny_target, "--conversations", conv, "--out", out, "--shard-tokens", "400")
    assert r.returncode == 0, r.stderr
    assert FeatureStore(out).verify() > 0


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real filesystem of 256 KiB (tmpfs), remountable larger; skipped where `mount` is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_real_full_disk_enospc_names_what_got_expected_fix_and_the_store_resumes(captured, tiny_target,
                                                                                   small_tmpfs):
    """ENOSPC from the kernel itself (no monkeypatching): the store lives on a 256 KiB tmpfs that fills
    mid-capture; remounted at 64 MiB, the same command resumes and completes."""
    root, conv = captured
    out = small_tmpfs / "store"
    args = ["capture", "--target", tiny_target, "--conversations", conv, "--out", out, "--shard-tokens", "100"]
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert "No space left on device" in r.stderr, r.stderr  # got: the OS's own words
    for part in ("could not write shard-", "bytes free)", "expected: about", "bytes free for shard-", "fix:",
                 "rerun the same command"):
        assert part in r.stderr, f"{part!r} missing from the error:\n{r.stderr}"
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["shards"], "the disk filled before any shard; the test proves nothing"
    assert not list(out.glob("*.tmp")), "a partial file was left on the full disk"
    assert {p.name for p in out.glob("shard-*")} == {e["file"] for e in manifest["shards"]}  # only whole shards
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    resumed, reference = FeatureStore(out), FeatureStore(root / "store")
    assert resumed.verify() == len(resumed.manifest["shards"]) > len(manifest["shards"])
    assert resumed.manifest["num_tokens"] == reference.manifest["num_tokens"]
    assert all(torch.equal(resumed.sample(k).input_ids, reference.sample(k).input_ids) for k in range(len(reference)))


def test_bad_inputs_exit_2_with_what_and_fix(tiny_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "messages": [\n')
    r = run_cli("capture", "--target", tiny_target, "--conversations", bad, "--out", tmp_path / "s1")
    assert r.returncode == 2 and "line 2" in r.stderr
    good = write_conversations(tmp_path / "good.jsonl", n=2)
    r = run_cli("capture", "--target", tiny_target, "--conversations", good, "--out", tmp_path / "s2", "--aux-ids", "2,4,9")
    assert r.returncode == 2 and "aux layer ids out of range" in r.stderr
    r = run_cli("capture", "--target", tmp_path / "nope", "--conversations", good, "--out", tmp_path / "s3")
    assert r.returncode == 2 and "unknown target" in r.stderr


@pytest.mark.parametrize("aux_ids", [(2, 4, 5), (0, 1, 8), (7, 8, 3)])
def test_target_features_are_the_boundary_hidden_states(tiny_target, aux_ids):
    """Hooks on the aux layers return exactly HF's hidden_states[k], the edges included: k = 0 (the
    embeddings) and k = N (after the final norm), in the order asked."""
    from transformers import AutoModelForCausalLM

    from draftsmith.capture.local import target_features

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    att = torch.ones_like(ids)
    with torch.no_grad():
        out = model(ids, attention_mask=att, output_hidden_states=True)
    hooks_before = [len(m._forward_hooks) for m in model.modules()]
    f = target_features(model, ids, att, aux_ids)
    assert torch.equal(f.aux, torch.cat([out.hidden_states[k] for k in aux_ids], -1))
    assert torch.equal(f.last, out.hidden_states[-1])
    assert torch.equal(f.target_argmax, out.logits.argmax(-1))
    assert [len(m._forward_hooks) for m in model.modules()] == hooks_before  # ours are gone afterwards


def test_right_padded_rows_give_the_same_features_without_an_attention_mask(tiny_target):
    """capture and online training run the target on right-padded rows with no mask (causal kernels): every real
    position's aux states, final state and argmax are those of the masked forward, and of each row alone."""
    from transformers import AutoModelForCausalLM

    from draftsmith.capture.local import pad_batch, target_features
    from draftsmith.regenerate.chat import TokenizedSample

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    lengths = (12, 5, 9)
    samples = [TokenizedSample(torch.randint(1, model.config.vocab_size, (n,)).tolist(), [1] * n) for n in lengths]
    ids, att, _ = pad_batch(samples, pad_id=0)
    assert att[1].tolist() == [1] * 5 + [0] * 7  # right padding
    masked, unmasked = target_features(model, ids, att, (1, 2, 3)), target_features(model, ids, None, (1, 2, 3))
    for b, n in enumerate(lengths):
        alone = target_features(model, ids[b:b + 1, :n], None, (1, 2, 3))
        for f in (masked, unmasked):
            torch.testing.assert_close(f.aux[b, :n], alone.aux[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(f.last[b, :n], alone.last[0], rtol=1e-5, atol=1e-5)
            assert torch.equal(f.target_argmax[b, :n], alone.target_argmax[0])
