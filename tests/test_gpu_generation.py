"""The rows decoder on CUDA with its graphs, against transformers' greedy decoding (GPU machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.generation import DecodeSettings, decode_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_cuda_graph_rows_equal_transformers_generate_in_fp32(tmp_path, attention):
    from transformers import AutoModelForCausalLM

    from conftest import build_tiny_target

    model = AutoModelForCausalLM.from_pretrained(build_tiny_target(tmp_path / "t", layers=3), dtype=torch.float32)
    model = model.cuda().eval()
    stop = model.config.eos_token_id
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 30, (40,), generator=g)]
    settings = DecodeSettings(max_new_tokens=32, rows=8, max_length=160, sync_every=4, cuda_graphs=True,
                              attention=attention)
    got, _ = decode_all(model, prompts, settings, [stop])
    for p, c in zip(prompts, got):
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                             eos_token_id=stop, pad_token_id=stop)[0, len(p):].tolist()
        want = out[:out.index(stop)] if stop in out else out
        assert c.token_ids == want
