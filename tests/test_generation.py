"""The continuous-batching decoder (generation.RowDecoder) against transformers' own greedy decoding."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.regenerate.generation import RowDecodeSettings, decode_all, sample_next, supports


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from conftest import build_tiny_target

    path = build_tiny_target(tmp_path_factory.mktemp("tiny"), layers=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model


def hf_greedy(model, ids: list[int], max_new: int, stop: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
                         pad_token_id=stop)
    new = out[0, len(ids):].tolist()
    return new[:new.index(stop)] if stop in new else new


def prompts_of(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_the_tiny_llama_is_supported(tiny):
    assert supports(tiny)


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_rows_equal_transformers_generate_one_prompt_at_a_time(tiny, rows, attention):
    stop = tiny.config.eos_token_id
    prompts = prompts_of(7, tiny.config.vocab_size)
    settings = RowDecodeSettings(max_new_tokens=24, rows=rows, max_length=64, sync_every=3, attention=attention)
    got, stats = decode_all(tiny, prompts, settings, [stop])
    for p, c in zip(prompts, got):
        want = hf_greedy(tiny, p, 24, stop)
        assert c.token_ids == want, f"prompt {p}: decoder {c.token_ids} vs generate {want}"
        assert c.stopped == (len(want) < 24)
    assert stats.generated_tokens == sum(len(c.token_ids) + c.stopped for c in got)


def test_rows_are_refilled_and_a_prompt_too_long_for_a_row_is_refused(tiny):
    from draftsmith.errors import DraftsmithError

    settings = RowDecodeSettings(max_new_tokens=8, rows=2, max_length=32, sync_every=2)
    got, _ = decode_all(tiny, prompts_of(9, tiny.config.vocab_size, seed=3), settings, [tiny.config.eos_token_id])
    assert [c.index for c in got] == list(range(9)) and all(len(c.token_ids) <= 8 for c in got)
    with pytest.raises(DraftsmithError, match="does not fit"):
        decode_all(tiny, [[5] * 40], settings, [tiny.config.eos_token_id])


def test_sampling_is_seeded_and_a_row_hits_max_length(tiny):
    settings = RowDecodeSettings(max_new_tokens=40, temperature=1.0, top_p=0.9, rows=4, max_length=30, sync_every=4)
    prompts = prompts_of(6, tiny.config.vocab_size, seed=5)
    torch.manual_seed(0)
    a, _ = decode_all(tiny, prompts, settings, [tiny.config.eos_token_id])
    torch.manual_seed(0)
    b, _ = decode_all(tiny, prompts, settings, [tiny.config.eos_token_id])
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert all(len(p) + len(c.token_ids) <= 30 for p, c in zip(prompts, a))


def test_an_unknown_decode_attention_is_refused_with_the_choices():
    with pytest.raises(DraftsmithError, match="auto or triton or matmul or sdpa"):
        RowDecodeSettings(attention="flash")


def test_auto_attention_is_matmul_off_cuda_and_triton_there_is_refused(tiny):
    from draftsmith.regenerate.generation import RowDecoder, resolve_attention

    assert resolve_attention("auto", torch.device("cpu")) == "matmul"
    assert resolve_attention("sdpa", torch.device("cpu")) == "sdpa"
    assert RowDecoder(tiny, RowDecodeSettings(rows=2, max_length=16), [0]).attention == "matmul"
    with pytest.raises(DraftsmithError, match="CUDA only") as e:
        RowDecoder(tiny, RowDecodeSettings(rows=2, max_length=16, attention="triton"), [0])
    assert "matmul" in e.value.fix


def test_top_p_keeps_only_the_nucleus_and_temperature_zero_is_argmax():
    logits = torch.tensor([[4.0, 1.0, 0.5, 0.0]]).repeat(2000, 1)  # p(top) = 0.92
    torch.manual_seed(0)
    assert sample_next(logits, 1.0, 0.9).unique().tolist() == [0]  # the top token alone reaches 0.9
    drawn = sample_next(logits, 1.0, 1.0)
    share = (drawn == 0).float().mean().item()
    # 2000 draws of p = 0.92: the standard deviation of the share is 0.006, so 0.89..0.95 fails 1 in 10^6.
    assert 0.89 < share < 0.95, share
    assert sample_next(logits, 0.0, 0.5).unique().tolist() == [0]
