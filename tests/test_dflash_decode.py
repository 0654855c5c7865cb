"""The reference decoder's DFlash block drafting: lossless greedy output, vLLM's block semantics (an oracle block is
accepted whole), cached context equal to a full recompute, and the block-size bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import draftsmith.eval.decoder as decoder
from conftest import CORPUS
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import DecodeSettings, decode_batch, prefill, target_decode
from draftsmith.model.dflash import DFlashConfig, DFlashDrafter, Proposal
from draftsmith.regenerate.chat import prompt_ids
from draftsmith.target import load_target

AUX = (2, 4, 5)
BLOCK = 6


@pytest.fixture(scope="module")
def target_and_drafter(tiny_target):
    model, tok = load_target(Path(tiny_target))
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=model.config.vocab_size, target_hidden_size=64, target_num_layers=8,
                       aux_layer_ids=AUX, block_size=BLOCK, mask_token_id=model.config.vocab_size - 1)
    torch.manual_seed(0)
    return model, tok, DFlashDrafter(cfg).eval()


def prompts_for(tok, n: int) -> list[list[int]]:
    return [prompt_ids(tok, [{"role": "user", "content": f"{CORPUS[i % len(CORPUS)]} {'x ' * (i % 5)}{i}"}])
            for i in range(n)]


def settings_for(tok, k: int) -> DecodeSettings:
    return DecodeSettings(k=k, max_new_tokens=20, eos_token_id=tok.eos_token_id)


@pytest.mark.parametrize("k", [1, 3, BLOCK - 1])
def test_greedy_block_drafting_is_token_identical_to_target_greedy(target_and_drafter, k):
    model, tok, drafter = target_and_drafter
    prompts = prompts_for(tok, 4)
    res = decode_batch(model, drafter, prompts, AUX, settings_for(tok, k))
    assert res.tokens == [target_decode(model, p, settings_for(tok, k)).tokens for p in prompts]
    assert all(0 <= a <= k for acc in res.accepted for a in acc)


def test_an_oracle_block_is_accepted_whole(target_and_drafter, monkeypatch):
    """Drafts at block positions 1..k are the tokens at root_pos + 1 .. root_pos + k: with the target's own
    continuation as the proposal, every verification accepts all k (up to the end of the answer)."""
    model, tok, drafter = target_and_drafter
    prompts, k = prompts_for(tok, 3), 3
    settings = DecodeSettings(k=k, max_new_tokens=20)  # no EOS: every answer runs to max_new_tokens
    truth = [p + target_decode(model, p, DecodeSettings(k=0, max_new_tokens=40)).tokens for p in prompts]
    rows = {}

    def oracle(self, kv_c, ctx_valid, anchor_ids, anchor_positions, k, embed, head):
        B = anchor_ids.shape[0]
        # positions count real tokens only: row r's position p is truth index p
        tokens = torch.stack([torch.tensor(truth[rows["order"][b]][int(anchor_positions[b]) + 1:
                                                                     int(anchor_positions[b]) + 1 + k])
                              for b in range(B)])
        return Proposal(tokens=tokens, logits=torch.zeros(B, k, 1))

    real_draft = decoder.draft_block

    def draft_block(drafter, state, settings, embed, head):
        rows["order"] = list(state.rows)
        return real_draft(drafter, state, settings, embed, head)

    monkeypatch.setattr(DFlashDrafter, "propose_over", oracle)
    monkeypatch.setattr(decoder, "draft_block", draft_block)
    res = decode_batch(model, drafter, prompts, AUX, settings)
    assert res.tokens == [t[len(p):len(p) + 20] for t, p in zip(truth, prompts)]
    for acc in res.accepted:
        assert acc[:-1] == [k] * (len(acc) - 1)  # every full step accepts the whole block; the last may be cut


def test_cached_context_equals_the_whole_context_recomputed(target_and_drafter, monkeypatch):
    """Each block drafted from the cache equals `propose` over every committed position's features at once."""
    model, tok, drafter = target_and_drafter
    prompts, k = prompts_for(tok, 4), 4
    seen = {"aux": None, "pos": None, "valid": None, "checked": 0}
    real_draft = decoder.draft_block

    def draft_block(drafter, state, settings, embed, head):
        p = state.pending  # every committed position's features, in order, across the iterations
        for key, new in (("aux", p.aux), ("pos", p.pos), ("valid", p.valid)):
            seen[key] = new if seen[key] is None else torch.cat([seen[key], new], 1)
        tree = real_draft(drafter, state, settings, embed, head)
        with torch.inference_mode():
            whole = drafter.propose(seen["aux"], seen["pos"], state.root, state.root_pos, settings.k, embed, head,
                                    ctx_valid=seen["valid"])
        assert torch.equal(tree.tokens[:, 1:], whole.tokens)
        seen["checked"] += 1
        return tree

    monkeypatch.setattr(decoder, "draft_block", draft_block)
    decode_batch(model, drafter, prompts[:1], AUX, settings_for(tok, k))  # batch 1: no row ever leaves mid-way
    assert seen["checked"] >= 3


def test_a_block_longer_than_block_size_minus_one_or_a_tree_is_refused(target_and_drafter):
    model, tok, drafter = target_and_drafter
    for settings in (settings_for(tok, BLOCK), DecodeSettings(k=3, topk=2, draft_tokens=5)):
        with pytest.raises(DraftsmithError, match="block size - 1"):
            decode_batch(model, drafter, prompts_for(tok, 1), AUX, settings)
