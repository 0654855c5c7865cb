"""MKL-packed linear weights for the reference decoder on a CPU: the same products, the same parameters, the same
greedy output; skipped where it cannot apply."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from draftsmith.eval.cpu_gemm import PackedLinear, mkl_packing_available, pack_linears
from draftsmith.eval.decoder import DecodeSettings, decode_batch, target_decode
from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter
from draftsmith.target import load_target

needs_mkl = pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL packing ops")


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_target(Path(tiny_target))


def linear_count(model) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@needs_mkl
def test_packed_model_keeps_its_parameters_and_computes_the_same_logits(target):
    model, _ = target
    packed = copy.deepcopy(model)
    n = linear_count(packed)
    report = pack_linears(packed, [3, 5])
    assert report.skipped is None and report.linears == n and report.rows == (3, 5)
    assert linear_count(packed) == 0 and sum(type(m) is PackedLinear for m in packed.modules()) == n
    assert packed.state_dict().keys() == model.state_dict().keys()
    if model.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.get_input_embeddings().weight
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for rows in (ids[:1, :3], ids[:1, :5], ids, ids[:1, :4]):  # packed (3, 5 rows) and not (14, 4 rows)
            want, got = model(input_ids=rows).logits, packed(input_ids=rows).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packed_layer_uses_the_pack_only_for_its_row_counts_and_never_under_autograd(monkeypatch):
    torch.manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(16, 8), [4])
    calls = []
    real = torch.ops.mkl._mkl_linear

    class Spy:
        def __call__(self, *a):
            calls.append(a[0].shape)
            return real(*a)

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", Spy())
    x = torch.randn(1, 4, 16)
    with torch.inference_mode():
        y4 = layer(x)
        layer(torch.randn(3, 16))
    assert calls == [torch.Size([1, 4, 16])]
    torch.testing.assert_close(y4, torch.nn.functional.linear(x, layer.weight, layer.bias))
    out = layer(x.requires_grad_()).sum()  # grad mode: plain F.linear, so the weight gets its gradient
    out.backward()
    assert len(calls) == 1 and layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_packing_is_skipped_with_its_reason_where_it_cannot_apply(target):
    model, _ = target
    half = copy.deepcopy(model).to(torch.bfloat16)
    report = pack_linears(half, [5])
    assert report.linears == 0 and "float32" in report.skipped and linear_count(half) > 0
    if mkl_packing_available():
        small = copy.deepcopy(model)
        report = pack_linears(small, [5], max_bytes=1)
        assert report.linears == 0 and "over the limit" in report.skipped and linear_count(small) > 0
    assert pack_linears(copy.deepcopy(model), []).skipped == "no row counts"
    assert "not packed" in report.line()


@needs_mkl
@pytest.mark.parametrize("settings", [DecodeSettings(k=4, max_new_tokens=24),
                                      DecodeSettings(k=3, topk=2, draft_tokens=6, max_new_tokens=24)],
                         ids=["chain", "tree"])
def test_greedy_speculation_on_a_packed_target_equals_target_greedy(target, settings):
    model, tok = target
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=model.config.vocab_size, draft_vocab_size=model.config.vocab_size,
                        target_hidden_size=64, target_num_layers=8, aux_layer_ids=(2, 4, 5))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg).eval()
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    packed = copy.deepcopy(model)
    assert pack_linears(packed, [settings.nodes, 2 * settings.nodes]).linears > 0
    prompts = [[1, 5, 9, 13, 2, 7][: 3 + i] for i in range(3)]
    plain = DecodeSettings(k=0, max_new_tokens=24)
    want = [target_decode(model, p, plain).tokens for p in prompts]
    one = [decode_batch(packed, drafter, [p], (2, 4, 5), settings).tokens[0] for p in prompts]
    two = decode_batch(packed, drafter, prompts[:2], (2, 4, 5), settings).tokens
    assert one == want and two == want[:2]
