"""The rows decoder on CUDA with its graphs, against transformers' greedy decoding (GPU machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.regenerate.generation import RowDecodeSettings, decode_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("attention", ["sdpa", "matmul", "triton"])
def test_cuda_graph_rows_equal_transformers_generate_in_fp32(tmp_path, attention):
    from transformers import AutoModelForCausalLM

    from conftest import build_tiny_target

    model = AutoModelForCausalLM.from_pretrained(build_tiny_target(tmp_path / "t", layers=3), dtype=torch.float32)
    model = model.cuda().eval()
    stop = model.config.eos_token_id
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 30, (40,), generator=g)]
    settings = RowDecodeSettings(max_new_tokens=32, rows=8, max_length=160, sync_every=4, cuda_graphs=True,
                              attention=attention)
    got, _ = decode_all(model, prompts, settings, [stop])
    for p, c in zip(prompts, got):
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                             eos_token_id=stop, pad_token_id=stop)[0, len(p):].tolist()
        want = out[:out.index(stop)] if stop in out else out
        assert c.token_ids == want


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (32, 8)])
def test_row_attention_equals_a_float64_reference_at_every_row_length(dtype, tol, heads):
    """Per-row lengths from 0 (an inactive row: zeros) to the whole cache, across block edges, on a layer slice
    of a (layers, B, kvh, M, hd) cache as the decoder holds it; the output is poisoned first."""
    from draftsmith.regenerate.cache_attention import reference_row_attention, row_attention

    nh, kvh = heads
    B, M, hd, layers = 37, 300, 64, 2
    g = torch.Generator(device="cuda").manual_seed(nh * 100 + kvh)
    cache = torch.randn(2, layers, B, kvh, M, hd, device="cuda", generator=g).to(dtype)
    q = torch.randn(B, nh, hd, device="cuda", generator=g).to(dtype)
    lengths = torch.randint(1, M + 1, (B,), device="cuda", generator=g)
    lengths[:6] = torch.tensor([0, 1, 63, 64, 65, M], device="cuda")
    for layer in range(layers):
        keys, values = cache[0, layer], cache[1, layer]
        got = row_attention(q, keys, values, lengths, hd ** -0.5)
        want = reference_row_attention(q, keys, values, lengths, hd ** -0.5)
        assert torch.isfinite(got).all()
        assert (got[0] == 0).all(), "a row of length 0 reads nothing"
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol, f"relative error {err:.2e} over {tol} ({dtype}, nh {nh}, kvh {kvh}, layer {layer})"


def test_row_attention_ignores_what_lies_past_each_rows_length():
    """Garbage (inf / nan) past a row's length never reaches its output: the kernel masks what it loads."""
    from draftsmith.regenerate.cache_attention import reference_row_attention, row_attention

    B, kvh, nh, M, hd = 8, 3, 9, 200, 64
    keys = torch.randn(B, kvh, M, hd, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    lengths = torch.tensor([1, 5, 64, 100, 127, 128, 150, 199], device="cuda")
    clean = row_attention(torch.ones(B, nh, hd, device="cuda", dtype=torch.bfloat16), keys, values, lengths, 0.125)
    for b, n in enumerate(lengths.tolist()):
        keys[b, :, n:] = float("inf")
        values[b, :, n:] = float("nan")
    q = torch.ones(B, nh, hd, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(row_attention(q, keys, values, lengths, 0.125), clean)
    assert torch.allclose(clean.float(), reference_row_attention(q, keys.nan_to_num(0, 0, 0), values.nan_to_num(0, 0, 0),
                                                                 lengths, 0.125).float(), atol=2e-2)
