"""The DFlash drafter: shapes, the training mask against a hand-built one, the loss weights, the training forward
against the drafting forward on the same block, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.model.dflash import Anchors, DFlashConfig, DFlashDrafter, block_attention_mask, block_weights, sample_anchors
from draftsmith.model.eagle3 import TTTOutput, simulated_acceptance
from draftsmith.model.kernels import hard_ce_rows

V, H, HT, BS = 64, 32, 24, 4


def tiny_config(**over) -> DFlashConfig:
    base = dict(hidden_size=H, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                vocab_size=V, target_hidden_size=HT, target_num_layers=8, aux_layer_ids=(2, 4, 6), block_size=BS,
                mask_token_id=V - 1)
    return DFlashConfig(**{**base, **over})


def tiny_drafter(seed: int = 0) -> tuple[DFlashDrafter, torch.Tensor, torch.Tensor]:
    """(drafter, embed (V, H), head (V, H)) with random weights, float64 for exact comparisons."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_config()).double()
    with torch.no_grad():  # norms away from 1, so that each takes part
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter, torch.randn(V, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64) * 3


def batch(B: int = 2, S: int = 20, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, S, 3 * HT, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (B, S), generator=g)
    return aux, ids, torch.ones(B, S, dtype=torch.long)


def test_shapes_of_both_forwards():
    drafter, embed, head = tiny_drafter()
    aux, ids, mask = batch()
    out = drafter(aux, ids, mask, embed, head, num_anchors=3, generator=torch.Generator().manual_seed(0))
    assert isinstance(out, TTTOutput)
    assert out.loss.shape == () and out.loss_sum.shape == (BS - 1,)
    assert out.correct.shape == out.valid.shape == (BS - 1, 2, 3)
    assert out.count.tolist() == [6, 6, 6]  # every anchor valid: all labels supervised
    prop = drafter.propose(aux[:, :7], torch.arange(7).expand(2, 7), ids[:, 7], torch.tensor([7, 7]), 2, embed, head)
    assert prop.tokens.shape == (2, 2) and prop.logits.shape == (2, 2, V)
    assert torch.equal(prop.tokens, prop.logits.argmax(-1))


def test_the_training_mask_is_context_before_the_anchor_in_its_document_and_the_own_block():
    anchors = torch.tensor([[1, 5], [0, 4]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]])
    B, A, S, bs = 2, 2, 8, 3
    got = block_attention_mask(anchors, documents, bs)
    want = torch.zeros(B, A * bs, S + A * bs, dtype=torch.bool)
    for b in range(B):
        for a in range(A):
            for j in range(bs):
                q = a * bs + j
                for s in range(S):  # context: strictly before the anchor, same document
                    want[b, q, s] = s < anchors[b, a] and documents[b, s] == documents[b, anchors[b, a]]
                for jj in range(bs):  # its own block, both ways
                    want[b, q, S + a * bs + jj] = True
    assert torch.equal(got, want)
    # row 0, second block (anchor 5 in document 1): context keys 3 and 4 only
    assert got[0, 3, :S].nonzero().flatten().tolist() == [3, 4]


def test_anchors_are_supervised_distinct_and_their_blocks_fit_the_row_and_document():
    g = torch.Generator().manual_seed(0)
    loss_mask = (torch.rand(3, 40, generator=g) > 0.3).long()
    documents = torch.repeat_interleave(torch.arange(4), 10).expand(3, 40)
    got = sample_anchors(loss_mask, documents, BS, num_anchors=50, generator=g)
    for b in range(3):
        pos = got.positions[b][got.valid[b]].tolist()
        ok = [t for t in range(40 - BS + 1) if loss_mask[b, t] and documents[b, t + BS - 1] == documents[b, t]]
        assert sorted(pos) == ok  # 50 > candidates: every candidate once, nothing else
        assert (got.positions[b][~got.valid[b]] == 0).all()
    few = sample_anchors(torch.ones(1, 40, dtype=torch.long), None, BS, num_anchors=5, generator=g)
    assert few.valid.all() and len(set(few.positions[0].tolist())) == 5


def test_loss_weights_skip_the_anchor_decay_and_follow_the_loss_mask():
    loss_mask = torch.ones(1, 12, dtype=torch.long)
    loss_mask[0, 3] = 0
    anchors = Anchors(torch.tensor([[1, 6]]), torch.tensor([[True, False]]))
    w = block_weights(anchors, loss_mask, 5, gamma=2.0)  # (1, 2, 4): positions 1..4
    decay = [math.exp(-k / 2.0) for k in range(4)]
    assert w[0, 0].tolist() == pytest.approx([decay[0], 0.0, decay[2], decay[3]])  # token 3 unsupervised
    assert w[0, 1].tolist() == [0.0] * 4  # an invalid anchor carries no loss


def naive_loss(drafter, embed, head, aux, ids, loss_mask, anchors: Anchors, gamma: float):
    """The training loss through autograd over full logits, block by block from `propose`'s path."""
    total, weight = 0.0, 0.0
    for b in range(ids.shape[0]):
        for a, ok in zip(anchors.positions[b].tolist(), anchors.valid[b].tolist()):
            if not ok:
                continue
            logits = drafter.propose(aux[b:b + 1, :a], torch.arange(a)[None], ids[b, a:a + 1], torch.tensor([a]),
                                     BS - 1, embed, head).logits[0]  # (Bs-1, V)
            ce = F.cross_entropy(logits, ids[b, a + 1:a + BS], reduction="none")
            w = loss_mask[b, a + 1:a + BS] * torch.exp(-torch.arange(BS - 1, dtype=torch.float64) / gamma)
            total, weight = total + (w * ce).sum(), weight + w.sum()
    return total / weight


def test_training_forward_equals_the_drafting_forward_block_by_block_in_loss_argmax_and_gradients():
    drafter, embed, head = tiny_drafter()
    aux, ids, loss_mask = batch()
    loss_mask[1, 9:12] = 0
    anchors = Anchors(torch.tensor([[0, 5, 11], [3, 7, 16]]), torch.tensor([[True, True, True], [True, True, False]]))
    out = drafter(aux, ids, loss_mask, embed, head, anchors=anchors, gamma=3.0)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    want = naive_loss(drafter, embed, head, aux, ids, loss_mask, anchors, 3.0)
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-10)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)
    # the argmax of each supervised label equals the drafting forward's greedy draft
    prop = drafter.propose(aux[:1, :5], torch.arange(5)[None], ids[0, 5:6], torch.tensor([5]), BS - 1, embed, head)
    assert torch.equal(out.correct[:, 0, 1], prop.tokens[0] == ids[0, 6:6 + BS - 1])


def test_a_packed_row_trains_each_block_as_its_document_alone():
    drafter, embed, head = tiny_drafter()
    aux, ids, loss_mask = batch(B=1, S=20)
    documents = torch.tensor([[0] * 8 + [1] * 12])
    anchors = Anchors(torch.tensor([[11]]), torch.tensor([[True]]))
    packed = drafter(aux, ids, loss_mask, embed, head, anchors=anchors, documents=documents)
    alone = drafter(aux[:, 8:], ids[:, 8:], loss_mask[:, 8:], embed, head,
                    anchors=Anchors(torch.tensor([[3]]), torch.tensor([[True]])))
    assert packed.loss.item() == pytest.approx(alone.loss.item(), rel=1e-10)
    assert torch.equal(packed.correct, alone.correct)


def test_drafting_sees_only_real_context_slots():
    drafter, embed, head = tiny_drafter()
    aux, ids, _ = batch(B=1)
    short = drafter.propose(aux[:, :6], torch.arange(6)[None], ids[:, 6], torch.tensor([6]), 3, embed, head)
    padded_aux = torch.cat([aux[:, :6], torch.randn(1, 4, 3 * HT, dtype=torch.float64)], dim=1)
    valid = torch.tensor([[True] * 6 + [False] * 4])
    padded = drafter.propose(padded_aux, torch.arange(10)[None], ids[:, 6], torch.tensor([6]), 3, embed, head, valid)
    torch.testing.assert_close(short.logits, padded.logits)


def test_block_acceptance_is_one_plus_the_leading_correct_supervised_positions():
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool).T[:, None]  # (P 3, B 1, A 3)
    valid = torch.ones(3, 1, 3, dtype=torch.bool)
    valid[1, 0, 1] = False  # block 1's second label unsupervised: its run stops there
    total, blocks = simulated_acceptance(correct, valid, 3)
    assert (total, blocks) == (3 + 2 + 1, 3)


def test_hard_ce_rows_matches_autograd():
    z = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    labels, w = torch.randint(0, 11, (5,)), torch.rand(5, dtype=torch.float64)
    ce, grad, top = hard_ce_rows(z.detach(), labels, w)
    want = F.cross_entropy(z, labels, reduction="none")
    (want * w).sum().backward()
    torch.testing.assert_close(ce, want.detach())
    torch.testing.assert_close(grad, z.grad)
    assert torch.equal(top, z.argmax(-1))


def test_a_mask_token_outside_the_vocabulary_or_a_block_of_one_is_refused():
    with pytest.raises(DraftsmithError, match="mask token"):
        tiny_config(mask_token_id=V)
    with pytest.raises(DraftsmithError, match="block"):
        tiny_config(block_size=1)
    drafter, embed, head = tiny_drafter()
    aux, ids, _ = batch(B=1)
    with pytest.raises(DraftsmithError, match="at most block size - 1"):
        drafter.propose(aux[:, :4], torch.arange(4)[None], ids[:, 4], torch.tensor([4]), BS, embed, head)


def test_config_round_trips_and_names_vllms_layer_ids():
    cfg = tiny_config()
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["family"] == "dflash"
    assert cfg.target_layer_ids == [1, 3, 5]


def test_a_dflash_checkpoint_round_trips_in_vllms_layout_and_every_reader_gets_the_family(tmp_path):
    from draftsmith.model.checkpoint import load_drafter, read_drafter_config, read_drafter_weights, save_drafter

    drafter, embed, head = tiny_drafter()
    drafter = drafter.float()
    path = save_drafter(drafter, tmp_path / "dflash", extra={"target": "tiny"})
    config = read_drafter_config(path)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 3, 5]}
    assert (config["block_size"], config["target_hidden_size"], config["num_hidden_layers"]) == (BS, HT, 2)
    assert config["draftsmith"]["drafter"]["family"] == "dflash"
    assert "is_causal" not in config and "layer_types" not in config  # vLLM: non-causal draft attention
    keys = set(read_drafter_weights(path))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)
    loaded = load_drafter(path, embed_tokens=embed.float())
    assert isinstance(loaded, DFlashDrafter) and loaded.config == drafter.config
    aux, ids, _ = batch(B=1)
    args = (aux[:, :6].float(), torch.arange(6)[None], ids[:, 6], torch.tensor([6]), 3, embed.float(), head.float())
    torch.testing.assert_close(loaded.propose(*args).logits, drafter.propose(*args).logits)


def test_a_dflash_config_whose_engine_fields_contradict_its_block_is_refused(tmp_path):
    import json

    from draftsmith.model.checkpoint import load_drafter, save_drafter

    path = save_drafter(tiny_drafter()[0].float(), tmp_path / "dflash")
    config = json.loads((path / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [2, 4, 6]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftsmithError, match="contradicts itself"):
        load_drafter(path)
