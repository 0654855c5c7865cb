"""The drafter: TTT attention against a dense reference, masking by perturbation, vocabulary maps."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.drafter import (DrafterConfig, Eagle3Drafter, TTTOutput, simulated_acceptance, step_masks, ttt_attention,
                                ttt_forward)
from draftsmith.vocab import build_draft_vocab, default_draft_vocab_size


def dense_reference(q, k0, v0, dk, dv):
    """The naive formulation: every key of every step in one (T x T*(i+1)) masked score matrix."""
    B, nh, T, hd = q.shape
    g = nh // k0.shape[1]
    keys = torch.cat([k0] + dk, 2).repeat_interleave(g, 1)
    values = torch.cat([v0] + dv, 2).repeat_interleave(g, 1)
    mask = torch.zeros(T, T * (1 + len(dk)), dtype=torch.bool)
    mask[:, :T] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for j in range(len(dk)):
        mask[:, T * (j + 1): T * (j + 2)] = torch.eye(T, dtype=torch.bool)
    s = (q @ keys.transpose(-1, -2)) / math.sqrt(hd)
    return torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ values


def random_qkv(steps: int, T: int = 11, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    B, nh, nkv, hd = 2, 4, 2, 16
    q = torch.randn(B, nh, T, hd, generator=g, dtype=dtype)
    k0, v0 = (torch.randn(B, nkv, T, hd, generator=g, dtype=dtype) for _ in range(2))
    dk = [torch.randn(B, nkv, T, hd, generator=g, dtype=dtype) for _ in range(steps)]
    dv = [torch.randn(B, nkv, T, hd, generator=g, dtype=dtype) for _ in range(steps)]
    return q, k0, v0, dk, dv


@pytest.mark.parametrize("steps", [0, 1, 3, 6])
def test_ttt_attention_matches_dense_mask_values_and_gradients(steps):
    q, k0, v0, dk, dv = random_qkv(steps)
    q.requires_grad_(True)
    k0.requires_grad_(True)
    out = ttt_attention(q, k0, v0, dk, dv)
    ref = dense_reference(q, k0, v0, dk, dv)
    assert torch.allclose(out, ref, atol=1e-10), (out - ref).abs().max()
    g_out = torch.autograd.grad(out.square().sum(), (q, k0))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k0))
    for a, b in zip(g_out, g_ref):
        assert torch.allclose(a, b, atol=1e-9)


def test_ttt_attention_bf16_error_is_that_of_plain_bf16_attention():
    q, k0, v0, dk, dv = random_qkv(6, T=64)
    ref = dense_reference(q, k0, v0, dk, dv)
    bf = [x.to(torch.bfloat16) for x in (q, k0, v0)]
    ours = ttt_attention(*bf, [x.to(torch.bfloat16) for x in dk], [x.to(torch.bfloat16) for x in dv]).double()
    naive = dense_reference(*[x.double() for x in bf], [x.to(torch.bfloat16).double() for x in dk],
                            [x.to(torch.bfloat16).double() for x in dv])
    # Rounding the inputs to bf16 already moves the result by `naive`'s error; ours adds at most that again.
    assert (ours - ref).abs().max() <= 2 * (naive - ref).abs().max() + 2e-2


def test_keys_of_later_steps_are_visible_only_on_the_diagonal():
    q, k0, v0, dk, dv = random_qkv(3)
    t = 5
    base = ttt_attention(q, k0, v0, dk, dv)[:, :, t]
    for j in range(3):
        perturbed = [k.clone() for k in dk]
        perturbed[j][:, :, [0, 3, 7, 10]] += 5.0  # other positions' keys of step j+1
        assert torch.allclose(ttt_attention(q, k0, v0, perturbed, dv)[:, :, t], base, atol=1e-12)
        perturbed[j][:, :, t] += 5.0  # the same position: must matter
        assert not torch.allclose(ttt_attention(q, k0, v0, perturbed, dv)[:, :, t], base, atol=1e-6)
    future = k0.clone()
    future[:, :, t + 1:] += 5.0  # step-0 keys after t: causal, invisible
    assert torch.allclose(ttt_attention(q, future, v0, dk, dv)[:, :, t], base, atol=1e-12)


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=96,
                draft_vocab_size=48, target_hidden_size=40, target_num_layers=8, aux_layer_ids=(2, 4, 5))
    return DrafterConfig(**{**base, **kw})


def test_ttt_forward_shapes_masks_and_gradients():
    torch.manual_seed(0)
    cfg = tiny_config()
    drafter = Eagle3Drafter(cfg)
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    B, T = 2, 12
    ids = torch.randint(0, 96, (B, T))
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 6:] = 1
    out = ttt_forward(drafter, torch.randn(B, T, 120), ids, mask, torch.randn(B, T, 40), torch.randn(96, 40), steps=3)
    assert out.correct.shape == (3, B, T) and out.valid.shape == (3, B, T)
    # step i at index t predicts token t+2+i: supervised iff mask[t+2+i]
    assert out.valid[0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    assert out.valid[2, 0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    out.loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.embed_tokens.weight.grad is None


def test_simulated_acceptance_counts_leading_correct_steps():
    correct = torch.tensor([[[1, 1, 0]], [[1, 0, 1]], [[0, 1, 1]]], dtype=torch.bool)  # (K=3, B=1, T=3)
    valid = torch.ones_like(correct)
    total, n = simulated_acceptance(correct, valid, 3)
    # index 0: steps 1,1,0 -> 2 accepted; index 1: 1,0 -> 1; index 2: 0 -> 0; plus one bonus each
    assert (total, n) == (2 + 1 + 0 + 3, 3)
    assert simulated_acceptance(correct, valid, 1) == (2 + 3, 3)


def test_step_masks_shift_with_the_ids():
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert step_masks(mask, 2)[:, 0].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]


def test_draft_vocab_maps_are_the_engines_d2t_and_t2d():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    v = build_draft_vocab(counts, 4)
    assert v.token_ids.tolist() == [0, 2, 3, 5]  # most frequent four, ascending; tie 2/3 both kept
    assert v.d2t.tolist() == [0, 1, 1, 2]  # target id = draft id + d2t
    assert v.t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert v.coverage == pytest.approx(30 / 34)
    assert default_draft_vocab_size(49152) == 8192 and default_draft_vocab_size(128256) == 32000


def test_soft_cross_entropy_matches_log_softmax_form_in_value_and_gradient():
    from draftsmith.drafter import SoftCrossEntropy

    torch.manual_seed(0)
    z = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(2, 5, 11, dtype=torch.float64) * 3, -1)
    p[0, 0] *= 0.5  # a row whose mass does not sum to 1 (the s factor matters)
    w = torch.rand(2, 5, dtype=torch.float64)
    ours = SoftCrossEntropy.apply(z, p)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    assert torch.allclose(ours, ref, atol=1e-12)
    (g_ours,) = torch.autograd.grad((ours * w).sum(), z)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), z)
    assert torch.allclose(g_ours, g_ref, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: SoftCrossEntropy.apply(x, p), (z,))


def test_ttt_output_is_a_pytree_so_fsdp2_can_hook_its_backward():
    """FSDP2 finds forward outputs by pytree traversal; an opaque TTTOutput let ranks step on unreduced
    gradients on CUDA (docs/gpu.md). The loss must be among the leaves it sees."""
    import torch.utils._pytree as pytree

    out = TTTOutput(loss=torch.tensor(1.0, requires_grad=True), loss_sum=torch.zeros(2),
                    correct=torch.zeros(2, 1, 3, dtype=torch.bool), valid=torch.ones(2, 1, 3, dtype=torch.bool))
    leaves, spec = pytree.tree_flatten(out)
    assert any(leaf is out.loss for leaf in leaves)
    assert pytree.tree_unflatten(leaves, spec) == out
