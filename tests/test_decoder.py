"""Reference speculative decoder: lossless greedy, distribution-preserving sampling, engine aux-id reading."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import CORPUS
from draftsmith.chat import prompt_ids
from draftsmith.decoder import (DecodeSettings, accept_sampling, engine_aux_ids, speculative_decode, target_decode)
from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.target import load_target
from draftsmith.vocab import build_draft_vocab


@pytest.fixture(scope="module")
def target_and_drafter(tiny_target):
    model, tok = load_target(Path(tiny_target))
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=model.config.vocab_size, draft_vocab_size=128, target_hidden_size=64,
                        target_num_layers=8, aux_layer_ids=(2, 4, 5))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg).eval()
    vocab = build_draft_vocab(torch.arange(model.config.vocab_size, 0, -1), 128)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        drafter.d2t.copy_(vocab.d2t)
        drafter.t2d.copy_(vocab.t2d)
    return model, tok, drafter


def test_greedy_output_is_token_identical_to_target_greedy_on_50_prompts(target_and_drafter):
    model, tok, drafter = target_and_drafter
    settings = DecodeSettings(k=4, max_new_tokens=24, eos_token_id=tok.eos_token_id)
    steps = 0
    for i in range(50):
        text = f"{CORPUS[i % len(CORPUS)]} {i}"
        ids = prompt_ids(tok, [{"role": "user", "content": text}])
        spec = speculative_decode(model, drafter, ids, (2, 4, 5), settings)
        base = target_decode(model, ids, settings)
        assert spec.tokens == base.tokens, (i, spec.tokens, base.tokens)
        steps += len(spec.accepted)
    assert steps > 50


def test_drafter_that_copies_the_target_is_fully_accepted(target_and_drafter):
    """An oracle draft (the target's own continuation) must be accepted whole: the accept rule is right."""
    model, tok, _ = target_and_drafter
    ids = prompt_ids(tok, [{"role": "user", "content": "print hello world"}])
    base = target_decode(model, ids, DecodeSettings(max_new_tokens=6))
    logits = model(torch.tensor([ids + base.tokens])).logits[0, len(ids) - 1:]
    from draftsmith.decoder import accept_greedy

    accepted, bonus = accept_greedy(base.tokens[:4], logits[:5])
    assert (accepted, bonus) == (4, base.tokens[4])
    wrong = base.tokens[:2] + [(base.tokens[2] + 1) % 300] + base.tokens[3:4]
    assert accept_greedy(wrong, logits[:5]) == (2, base.tokens[2])


def test_rejection_sampling_preserves_the_target_distribution():
    """Draft from q, accept/resample against p: the first emitted token must follow p exactly.

    With 40,000 trials over 6 tokens, each empirical frequency has standard error at most
    sqrt(0.25/40000) = 0.0025; a 0.012 tolerance (4.8 sigma) fails by chance with probability < 1e-5.
    """
    g = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, 0.5, -1.0]), -1)
    p = torch.softmax(p_logits[0], -1)
    trials, counts = 40000, torch.zeros(6)
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=g))
        accepted, bonus = accept_sampling([d], [q], p_logits, 1.0, g)
        counts[d if accepted == 1 else bonus] += 1
    empirical = counts / trials
    assert torch.allclose(empirical, p, atol=0.012), (empirical, p)


def test_speculative_sampling_runs_and_reports_acceptance(target_and_drafter):
    model, tok, drafter = target_and_drafter
    ids = prompt_ids(tok, [{"role": "user", "content": "the quick brown fox"}])
    res = speculative_decode(model, drafter, ids, (2, 4, 5), DecodeSettings(k=3, temperature=0.8, max_new_tokens=20), seed=1)
    assert len(res.tokens) == 20 and all(0 <= a <= 3 for a in res.accepted)


def test_engines_read_aux_ids_differently():
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
           "draftsmith": {"aux_layer_ids_boundary": [2, 16, 29]}}
    assert engine_aux_ids(cfg, 32, "vllm") == (1, 15, 28)
    assert engine_aux_ids(cfg, 32, "sglang") == (2, 16, 29)
    assert engine_aux_ids(cfg, 32, "trained") == (2, 16, 29)
    assert engine_aux_ids({}, 32, "vllm") == engine_aux_ids({}, 32, "sglang") == (2, 16, 29)
