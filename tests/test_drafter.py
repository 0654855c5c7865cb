"""The drafter: TTT attention against a dense reference, masking by perturbation, vocabulary maps."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.model.eagle3 import (DrafterConfig, Eagle3Drafter, TTTOutput, apply_rope, rope_cos_sin, engine_walk_acceptance, simulated_acceptance,
                                step_masks, ttt_forward)
from draftsmith.model.kernels import ttt_attention
from draftsmith.model.vocab import build_draft_vocab, default_draft_vocab_size


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


def naive_ttt_loss(drafter, aux, ids, mask, last, head, steps, decay=0.8):
    """TTT written the plain way: per step, cat(embedding, hidden) through q/k/v, a dense masked attention
    over the keys of all steps so far, the head's full logits and log_softmax against the target's softmax
    over the draft vocabulary. Returns (loss, per-step argmax in target ids)."""
    d, cfg = drafter, drafter.config
    B, T = ids.shape
    a = d.midlayer.self_attn
    p = torch.softmax(last @ head[torch.arange(cfg.draft_vocab_size) + d.d2t].T, -1)  # (B, T, Vd)
    in_vocab = d.t2d[(last @ head.T).argmax(-1)]
    valid = step_masks(mask, steps)
    a_in = d.input_norm(aux) if cfg.norm_before_fc else aux
    h, keys, values, loss, tops = d.fc(a_in), [], [], 0.0, []
    for i in range(steps):
        tok = torch.cat([ids[:, 1 + i:], torch.zeros(B, 1 + i, dtype=ids.dtype)], 1)
        hn = d.midlayer.hidden_norm(h)
        x = torch.cat([d.midlayer.input_layernorm(d.embed_tokens(tok)), hn], -1)
        cos, sin = rope_cos_sin(torch.arange(T) + i, cfg.head_dim, cfg.rope_theta)
        q = apply_rope(a.q_proj(x).view(B, T, a.nh, a.hd).transpose(1, 2), cos, sin)
        keys.append(apply_rope(a.k_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2), cos, sin))
        values.append(a.v_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2))
        o = dense_reference(q, keys[0], values[0], keys[1:], values[1:])
        h = d.midlayer.finish(a.o_proj(o.transpose(1, 2).reshape(B, T, -1)), hn if cfg.norm_before_residual else h)
        logits = d.lm_head(d.norm(h))
        if cfg.norm_output:  # the next step is fed the normed state
            h = d.norm(h)
        n = T - 1 - i
        ce = -(p[:, 1 + i:] * torch.log_softmax(logits[:, :n], -1)).sum(-1)
        w = (valid[i, :, :n] & in_vocab[:, 1 + i:]).to(ce.dtype)
        loss = loss + decay ** i * (ce * w).sum() / valid[i].sum().clamp(min=1)
        tops.append(d.draft_to_target_ids(logits.argmax(-1)))
    return loss, tops


SPECULATORS_NORMS = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}


@pytest.mark.parametrize("norms, head_rows", [({}, 16384), ({"norm_before_residual": True}, 16384), ({}, 30),
                                              ({"norm_before_residual": True}, 60), (SPECULATORS_NORMS, 16384),
                                              (SPECULATORS_NORMS, 30)])
def test_ttt_forward_equals_the_naive_unroll_in_loss_argmax_and_every_gradient(norms, head_rows, monkeypatch):
    """The training path's shortcuts (embedding half of q/k/v projected once and shifted, the diagonal
    folded into one SDPA, the head + loss + argmax fused with gradients computed in the forward, in
    groups of steps: all 4 at once, 1 or 2 per group here) must not change the math: float64, against
    the plain unroll above."""
    import draftsmith.model.kernels

    monkeypatch.setattr(draftsmith.model.kernels, "HEAD_GEMM_ROWS", head_rows)
    torch.manual_seed(0)
    cfg = tiny_config(**norms)
    drafter = Eagle3Drafter(cfg).double()
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    for prm in drafter.parameters():  # norms away from 1 so that their gradients are not trivial
        if prm.dim() == 1:
            prm.data.uniform_(0.5, 1.5)
    B, T, steps = 2, 13, 4
    ids = torch.randint(0, 96, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :5] = 0
    aux, last = torch.randn(B, T, 120, dtype=torch.float64), torch.randn(B, T, 40, dtype=torch.float64)
    head = torch.randn(96, 40, dtype=torch.float64)
    out = ttt_forward(drafter, aux, ids, mask, last, head, steps=steps)
    params = [q for q in drafter.parameters() if q.requires_grad]
    ours = torch.autograd.grad(out.loss, params)
    ref_loss, ref_tops = naive_ttt_loss(drafter, aux, ids, mask, last, head, steps)
    ref = torch.autograd.grad(ref_loss, params)
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-10)
    names = [n for n, q in drafter.named_parameters() if q.requires_grad]
    for name, g, r in zip(names, ours, ref):
        assert torch.allclose(g, r, rtol=1e-8, atol=1e-12), f"gradient of {name} differs: {(g - r).abs().max()}"
    for i in range(steps):
        expect = ref_tops[i] == torch.cat([(last @ head.T).argmax(-1)[:, 1 + i:], torch.zeros(B, 1 + i, dtype=torch.long)], 1)
        assert torch.equal(out.correct[i], expect)


def test_draft_head_loss_gradients_pass_gradcheck_and_skip_work_without_grad():
    from draftsmith.model.kernels import DraftHeadLoss, soft_ce_rows

    torch.manual_seed(0)
    K, B, T, H, Vd = 3, 2, 5, 7, 11
    x = torch.randn(K, B, T, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(Vd, H, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(B, T + K, Vd, dtype=torch.float64) * 3, -1)
    p[0, 2] *= 0.5  # a row whose mass does not sum to 1 (the s factor matters)
    w = torch.rand(K, B, T, dtype=torch.float64)
    loss, ce, top = DraftHeadLoss.apply(x, weight, p, w, soft_ce_rows)
    z = x @ weight.T  # (K, B, T, Vd)
    p_steps = torch.stack([p[:, 1 + i:1 + i + T] for i in range(K)])  # step i reads rows 1+i..
    ref_ce = -(p_steps * torch.log_softmax(z, -1)).sum(-1)
    assert torch.allclose(ce, ref_ce, atol=1e-12) and torch.equal(top, z.argmax(-1))
    assert torch.allclose(loss, (ref_ce * w).sum(), atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: DraftHeadLoss.apply(a, b, p, w, soft_ce_rows)[0], (x, weight))
    calls = []

    def counting_rows(z_, p_, w_):
        calls.append(z_.shape)
        return soft_ce_rows(z_, p_, w_)

    with torch.no_grad():  # evaluation: no gradient GEMMs, nothing kept
        loss_ng, _, _ = DraftHeadLoss.apply(x, weight, p, w, counting_rows)
    assert calls == [(B, T, Vd)] * K and not loss_ng.requires_grad and loss_ng.item() == pytest.approx(loss.item())


def test_draft_head_loss_groups_its_steps_for_the_given_rows_with_the_same_loss_and_gradients(monkeypatch):
    """group_rows (the Trainer's head_rows: the most rows a micro-batch of the run has) sizes the grouping of TTT
    steps instead of the batch's own rows, so that every micro-batch groups alike; the math does not change."""
    import draftsmith.model.kernels
    from draftsmith.model.kernels import DraftHeadLoss, soft_ce_rows

    monkeypatch.setattr(draftsmith.model.kernels, "HEAD_GEMM_ROWS", 20)
    torch.manual_seed(1)
    K, B, T, H, Vd = 4, 2, 5, 7, 11  # 10 rows: groups of 2 steps by the batch's rows, 4 for 5 rows, 1 for 20
    p = torch.softmax(torch.randn(B, T + K, Vd, dtype=torch.float64), -1)
    w = torch.rand(K, B, T, dtype=torch.float64)
    x0, w0 = torch.randn(K, B, T, H, dtype=torch.float64), torch.randn(Vd, H, dtype=torch.float64)
    results, groups = [], []

    def counting_rows(z_, p_, w_):
        groups[-1] += 1
        return soft_ce_rows(z_, p_, w_)

    for group_rows in (None, 5, 20):
        x, weight = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        groups.append(0)
        loss, ce, top = DraftHeadLoss.apply(x, weight, p, w, counting_rows, group_rows)
        results.append((loss.detach(), top, *torch.autograd.grad(loss, (x, weight))))
    assert groups == [K, K, K]  # every step's rows once, whatever the grouping
    for other in results[1:]:
        assert torch.equal(other[1], results[0][1])
        for a, b in zip((other[0], *other[2:]), (results[0][0], *results[0][2:])):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_lse_merge_attention_matches_dense_mask_values_and_gradients(steps):
    """ttt_attention_lse (what CUDA runs) with the plain causal+lse reference standing in for the flash
    kernel: the merge algebra, in float64. The kernel's lse gradient is checked on the GPU
    (tests/test_gpu.py)."""
    from draftsmith.model.kernels import causal_attention_lse_reference, ttt_attention_lse

    q, k0, v0, dk, dv = random_qkv(steps)
    leaves = [q, k0, v0, *dk, *dv]
    for t in leaves:
        t.requires_grad_(True)
    ours = ttt_attention_lse(q, k0, v0, dk, dv, causal=causal_attention_lse_reference)
    ref = dense_reference(q, k0, v0, dk, dv)
    assert torch.allclose(ours, ref, atol=1e-12)
    up = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad((ours * up).sum(), leaves), torch.autograd.grad((ref * up).sum(), leaves)):
        assert torch.allclose(g, r, atol=1e-10)


def test_mlp_recomputing_its_gated_product_matches_the_plain_swiglu_in_values_and_gradients():
    """MLP.forward keeps only the gate and up projections for the backward (kernels.SwiGLUDown); the output
    and the gradients of the input and of all three weights equal autograd through the plain expression."""
    import torch.nn.functional as F

    from draftsmith.model.eagle3 import MLP
    from draftsmith.model.kernels import SwiGLUDown

    torch.manual_seed(0)
    mlp = MLP(DrafterConfig(hidden_size=16, intermediate_size=40, num_heads=2, num_kv_heads=1, head_dim=8,
                            vocab_size=32, draft_vocab_size=8, target_hidden_size=16, target_num_layers=4,
                            aux_layer_ids=(1, 2, 3))).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    leaves = [x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    ours = mlp(x)
    plain = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.allclose(ours, plain, atol=1e-13)
    up = torch.randn_like(plain)
    for g, r in zip(torch.autograd.grad((ours * up).sum(), leaves), torch.autograd.grad((plain * up).sum(), leaves)):
        assert torch.allclose(g, r, atol=1e-12)
    assert torch.autograd.gradcheck(SwiGLUDown.apply, (torch.randn(3, 6, dtype=torch.float64, requires_grad=True),
                                                       torch.randn(3, 6, dtype=torch.float64, requires_grad=True),
                                                       torch.randn(4, 6, dtype=torch.float64, requires_grad=True)))


def test_step_0_keys_repeated_once_per_unroll_give_the_same_values_and_gradients():
    """The unroll repeats step 0's K/V to the query heads once (StepCache.repeated_causal_kv) instead of once per
    step: the same attention and the same gradients into k0 / v0 as repeating inside every call, float64."""
    from draftsmith.model.eagle3 import StepCache
    from draftsmith.model.kernels import causal_attention_lse_reference, ttt_attention_lse

    q, k0, v0, dk, dv = random_qkv(3)
    assert q.shape[1] > k0.shape[1]  # grouped: the repeat is real
    leaves = [q, k0, v0, *dk, *dv]
    for t in leaves:
        t.requires_grad_(True)
    cache = StepCache(keys=[k0, *dk], values=[v0, *dv])
    groups = q.shape[1] // k0.shape[1]
    shared = cache.repeated_causal_kv(groups)
    assert cache.repeated_causal_kv(groups) is shared  # made once
    outs = [ttt_attention_lse(q, k0, v0, dk[:i], dv[:i], causal=causal_attention_lse_reference, causal_kv=shared)
            for i in (1, 2, 3)]
    refs = [ttt_attention_lse(q, k0, v0, dk[:i], dv[:i], causal=causal_attention_lse_reference) for i in (1, 2, 3)]
    up = [torch.randn_like(r) for r in refs]
    for o, r in zip(outs, refs):
        assert torch.allclose(o, r, atol=1e-12)
    ours = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, up)), leaves)
    theirs = torch.autograd.grad(sum((r * u).sum() for r, u in zip(refs, up)), leaves)
    for g, r in zip(ours, theirs):
        assert torch.allclose(g, r, atol=1e-10)


def test_ttt_output_is_a_pytree_so_fsdp2_can_hook_its_backward():
    """FSDP2 finds forward outputs by pytree traversal; an opaque TTTOutput let ranks step on unreduced
    gradients on CUDA (docs/gpu.md). The loss must be among the leaves it sees."""
    import torch.utils._pytree as pytree

    out = TTTOutput(loss=torch.tensor(1.0, requires_grad=True), loss_sum=torch.zeros(2),
                    correct=torch.zeros(2, 1, 3, dtype=torch.bool), valid=torch.ones(2, 1, 3, dtype=torch.bool))
    leaves, spec = pytree.tree_flatten(out)
    assert any(leaf is out.loss for leaf in leaves)
    assert pytree.tree_unflatten(leaves, spec) == out


def test_compiled_training_step_equals_eager():
    """`compile_for_training` (what `train --compile` runs on GPUs) changes kernels, not results: loss, argmax and
    gradients of a tiny drafter match the eager unroll (fp32, CPU inductor)."""
    from draftsmith.model.eagle3 import compile_for_training

    torch.manual_seed(0)
    eager, compiled = Eagle3Drafter(tiny_config()), Eagle3Drafter(tiny_config())
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    for d in (eager, compiled):
        d.d2t.copy_(vocab.d2t)
        d.t2d.copy_(vocab.t2d)
    compiled.load_state_dict(eager.state_dict())
    compile_for_training(compiled)
    B, T = 2, 16
    args = (torch.randn(B, T, 120), torch.randint(0, 96, (B, T)), torch.ones(B, T, dtype=torch.long),
            torch.randn(B, T, 40), torch.randn(96, 40))
    outs = [ttt_forward(d, *args, steps=3) for d in (eager, compiled)]
    grads = [torch.autograd.grad(o.loss, [q for q in d.parameters() if q.requires_grad])
             for o, d in zip(outs, (eager, compiled))]
    assert outs[1].loss.item() == pytest.approx(outs[0].loss.item(), rel=1e-5)
    assert torch.equal(outs[1].correct, outs[0].correct)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def packed_and_unpacked(docs, rows, row_tokens):
    """The same documents as one padded sample per row and packed (`pack_rows`) into `rows` of segments."""
    from draftsmith.train.features import pack_rows
    from draftsmith.capture.store import Sample

    samples = [Sample(*d) for d in docs]
    T = max(len(s.input_ids) for s in samples)
    pad = lambda x: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, T - len(x)))  # noqa: E731
    unpacked = [torch.stack([pad(getattr(s, f)) for s in samples])
                for f in ("input_ids", "loss_mask", "aux", "last", "target_argmax")]
    packed = pack_rows(rows, row_tokens, lambda k: samples[k], torch.device("cpu"), torch.float64)
    return unpacked, packed


def random_documents(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[:2] = 0  # a prompt
        docs.append((torch.randint(0, 96, (n,), generator=g), mask, torch.randn(n, 120, generator=g, dtype=torch.float64),
                     torch.randn(n, 40, generator=g, dtype=torch.float64), torch.zeros(n, dtype=torch.long)))
    return docs


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_packed_rows_give_the_loss_and_every_gradient_of_the_unpacked_batch(norm_before_residual):
    """Packing (documents back to back, positions restarting, step-0 attention inside each document, predictions
    of the next document unsupervised) changes the layout, not the math: float64, the same documents padded one
    per row vs packed three-and-one into two rows, same loss, per-step sums, accuracy counts and gradients."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_config(norm_before_residual=norm_before_residual)).double()
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    for prm in drafter.parameters():
        if prm.dim() == 1:
            prm.data.uniform_(0.5, 1.5)
    head = torch.randn(96, 40, dtype=torch.float64)
    docs = random_documents([6, 9, 4, 12])
    for d in docs:
        d[4].copy_((d[3] @ head.T).argmax(-1))  # the target argmax the store keeps
    (ids, mask, aux, last, argmax), packed = packed_and_unpacked(docs, [[(1, 0, 9), (0, 0, 6), (2, 0, 4)],
                                                                       [(3, 0, 12)]], row_tokens=20)
    assert packed.documents[0].tolist() == [0] * 9 + [1] * 6 + [2] * 4 + [3]
    params = [q for q in drafter.parameters() if q.requires_grad]
    outs, grads = [], []
    for args, documents in (((aux, ids, mask, last), None),
                            ((packed.aux, packed.input_ids, packed.loss_mask, packed.last), packed.documents)):
        out = ttt_forward(drafter, args[0], args[1], args[2], args[3], head, steps=4, t_argmax=argmax if documents is None
                          else packed.target_argmax, documents=documents)
        outs.append(out)
        grads.append(torch.autograd.grad(out.loss, params))
    (a, b), (ga, gb) = outs, grads
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-12)
    assert torch.allclose(b.loss_sum, a.loss_sum, rtol=1e-12) and torch.equal(b.count, a.count)
    assert torch.equal(b.correct_count, a.correct_count)
    assert a.count.sum() > 0 and a.loss.item() > 0
    names = [n for n, q in drafter.named_parameters() if q.requires_grad]
    for name, x, y in zip(names, ga, gb):
        assert x.abs().max() > 0, f"gradient of {name} is zero; the comparison proves nothing"
        assert torch.allclose(y, x, rtol=1e-9, atol=1e-13), f"gradient of {name} differs: {(x - y).abs().max()}"


def test_document_positions_restart_and_the_mask_stays_inside_each_document():
    from draftsmith.model.kernels import document_mask, document_positions

    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2]]
    m = document_mask(documents)[0, 0]
    assert m[4].tolist() == [0, 0, 0, 1, 1, 0, 0, 0] and m[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def test_document_spans_cover_each_row_in_order():
    from draftsmith.model.kernels import document_spans

    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 3, 3, 3, 4]])
    assert document_spans(documents).rows == (((0, 3), (3, 5), (5, 8)), ((0, 8),),
                                              ((0, 1), (1, 2), (2, 3), (3, 7), (7, 8)))


@pytest.mark.parametrize("steps", [0, 1, 4])
def test_ttt_attention_under_a_document_mask_equals_each_document_alone(steps):
    """Both attention forms (summary key, lse merge) over a packed row, under the dense mask and (summary key, the
    eager CPU path) one document span at a time, equal the dense reference run on each document separately, values
    and gradients (float64); FlexAttention's block-mask form (the CUDA path) is checked here forward only (flex has
    no CPU backward; tests/test_gpu.py checks it on CUDA)."""
    from draftsmith.model.kernels import (causal_attention_lse_reference, document_block_mask, document_mask,
                                    document_spans, flex, ttt_attention_lse)

    q, k0, v0, dk, dv = random_qkv(steps, T=13)
    documents = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [0] * 13])
    cuts = [[(0, 5), (5, 11), (11, 13)], [(0, 13)]]
    leaves = [q, k0, v0, *dk, *dv]
    for t in leaves:
        t.requires_grad_(True)
    up = torch.randn_like(q)
    ref = torch.zeros_like(q)
    for b, row in enumerate(cuts):
        for a, e in row:
            sl = lambda x: x[b:b + 1, :, a:e]  # noqa: E731
            ref[b:b + 1, :, a:e] = dense_reference(sl(q), sl(k0), sl(v0), [sl(x) for x in dk], [sl(x) for x in dv])
    g_ref = torch.autograd.grad((ref * up).sum(), leaves)
    mask = document_mask(documents)
    assert document_spans(documents).rows == tuple(map(tuple, cuts))
    forms = {"summary key": ttt_attention(q, k0, v0, dk, dv, mask=mask),
             "summary key, spans": ttt_attention(q, k0, v0, dk, dv, mask=document_spans(documents)),
             "lse merge": ttt_attention_lse(q, k0, v0, dk, dv, mask=mask)}
    for name, out in forms.items():
        assert torch.allclose(out, ref, atol=1e-12), name
        for g, r in zip(torch.autograd.grad((out * up).sum(), leaves), g_ref):
            assert torch.allclose(g, r, atol=1e-10), name
    q, k0, v0, ref = (x.detach() for x in (q, k0, v0, ref))
    dk, dv = [x.detach() for x in dk], [x.detach() for x in dv]
    with torch.no_grad():
        block = document_block_mask(documents)
        out = ttt_attention_lse(q, k0, v0, dk, dv, mask=block)
        assert torch.allclose(out, ref, atol=1e-12)
        o, lse = flex(q, k0.repeat_interleave(2, 1), v0.repeat_interleave(2, 1), block, 0.25, lse=True)
        o_ref, lse_ref = causal_attention_lse_reference(q, k0.repeat_interleave(2, 1), v0.repeat_interleave(2, 1), 0.25,
                                                        mask)
        assert torch.allclose(o, o_ref, atol=1e-12) and torch.allclose(lse, lse_ref, atol=1e-12)


def test_the_document_block_mask_from_block_ranges_is_create_block_masks():
    """`document_block_mask` builds the packed rows' BlockMask from each block's range of documents instead of
    evaluating the mask at every position: for packed rows (contiguous documents, padding last; short ones inside
    a block, long ones across blocks, one filling a whole row) its partial and full key blocks are exactly those of
    `create_block_mask`, and FlexAttention under it equals the dense mask's attention (forward, CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from draftsmith.model.kernels import FLEX_BLOCK, causal_attention_lse_reference, document_block_mask, document_mask, flex

    def dense(counts, indices):  # (B, 1, n) + (B, 1, n, n) -> (B, n, n) bool
        B, _, n = counts.shape
        out = torch.zeros(B, n, n, dtype=torch.bool)
        for b in range(B):
            for i in range(n):
                out[b, i, indices[b, 0, i, :counts[b, 0, i]].long()] = True
        return out

    T = 4 * FLEX_BLOCK
    runs = [[3, 40, 200, 100, 120, 49], [T], [130, 126, 1, 255]]  # the last length of each row is its padding
    documents = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in runs])
    assert documents.shape == (3, T)
    ours = document_block_mask(documents)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    theirs = create_block_mask(same_document_causal, 3, None, T, T, device="cpu")
    assert torch.equal(dense(ours.kv_num_blocks, ours.kv_indices), dense(theirs.kv_num_blocks, theirs.kv_indices))
    assert torch.equal(dense(ours.full_kv_num_blocks, ours.full_kv_indices),
                       dense(theirs.full_kv_num_blocks, theirs.full_kv_indices))
    assert dense(ours.full_kv_num_blocks, ours.full_kv_indices)[1].sum() == 6  # one document: every block below
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, T, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        o, lse = flex(q, k, v, ours, 0.25, lse=True)
        o_ref, lse_ref = causal_attention_lse_reference(q, k, v, 0.25, document_mask(documents))
    assert torch.allclose(o, o_ref, atol=1e-12) and torch.allclose(lse, lse_ref, atol=1e-12)


def test_the_trainers_first_ttt_step_and_the_decoders_step_are_the_same_layer():
    """`ttt_step` (q/k/v split by linearity, TTT attention) and `decode_step` (a KV cache, a causal mask) both run
    `Eagle3Drafter.step`: on the same tokens and hidden states, step 0 of the unroll is the decoder's causal
    forward (float64, to rounding)."""
    from conftest import CFG

    from draftsmith.eval.decoder import DrafterCache
    from draftsmith.model.eagle3 import StepCache

    torch.manual_seed(0)
    drafter = Eagle3Drafter(CFG).double()
    B, T, H = 2, 7, CFG.hidden_size
    ids, h = torch.randint(0, CFG.vocab_size, (B, T)), torch.randn(B, T, H, dtype=torch.float64)
    attn = drafter.midlayer.self_attn
    w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    e_qkv = torch.nn.functional.linear(drafter.midlayer.input_layernorm(drafter.embed_tokens(ids)), w_qkv[:, :H])
    with torch.no_grad():
        _, trained = drafter.ttt_step(e_qkv, h, w_qkv[:, H:], torch.arange(T), StepCache(), first=True)
        causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
        decoded = drafter.decode_step(ids, h, torch.arange(T).expand(B, T), DrafterCache(), causal)
    assert trained.shape == decoded.shape == (B, T, H)
    torch.testing.assert_close(trained, decoded, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(decoded[:, 1:], drafter.decode_step(ids, h, torch.arange(T).expand(B, T), DrafterCache(),
                                                                  torch.eye(T, dtype=torch.bool).expand(B, T, T))[:, 1:]), \
        "the mask must matter, or the comparison above says nothing"


def test_engine_walk_starts_each_chain_where_the_last_one_ended():
    # tokens 0-1 are the prompt, 2-11 the answer; step i at index t predicts token t+2+i
    loss_mask = torch.tensor([[0, 0] + [1] * 10])  # (B=1, T=12)
    correct = torch.zeros(3, 1, 12, dtype=torch.bool)  # (K=3, B, T)
    for t, steps in {1: (1, 1, 0), 2: (1, 1, 1), 4: (0, 1, 1), 5: (1, 1, 1)}.items():
        correct[:, 0, t] = torch.tensor(steps, dtype=torch.bool)
    valid = step_masks(loss_mask, 3)
    # The first chain is rooted at token 2 (the prefill's token), index 1: accepts 2 -> index 4: 0 -> 5: 3 -> 9: 0
    # -> 10: no chain (it would predict past the end). Index 2's run of 3 is skipped, as decoding never starts there.
    assert engine_walk_acceptance(correct, valid, 3) == (3 + 1 + 4 + 1, 4)
    # k=1: 1 (1) -> 3 (0) -> 4 (0) -> 5 (1) -> 7 (0) -> 8 (0) -> 9 (0)
    assert engine_walk_acceptance(correct, valid, 1) == (2 + 1 + 1 + 2 + 1 + 1 + 1, 7)
    # tokens 6-7 a user turn: the walk steps over it and restarts at the next answer's first chain (root 8, index 7)
    loss_mask[0, 6:8] = 0
    assert engine_walk_acceptance(correct, step_masks(loss_mask, 3), 3) == (3 + 1 + 1 + 1, 4)


def test_engine_walk_equals_a_step_by_step_walk_on_long_packed_rows():
    """The pointer-doubling sums equal walking chain by chain, over rows with many turns and documents."""
    g = torch.Generator().manual_seed(0)
    B, T, K = 3, 3000, 5
    loss_mask = (torch.rand(B, T, generator=g) > 0.15).long()
    documents = torch.cumsum(torch.rand(B, T, generator=g) < 0.01, dim=1)
    valid = step_masks(loss_mask, K, documents)
    correct = torch.rand(K, B, T, generator=g) < 0.7
    for k in (1, 3, 5):
        ok = (correct[:k] & valid[:k]).long().cumprod(dim=0).sum(dim=0)
        total = chains = 0
        for b in range(B):
            t = 0
            while t < T:
                if valid[0, b, t] and t > 0 and valid[0, b, t - 1]:
                    total, chains, t = total + int(ok[b, t]) + 1, chains + 1, t + int(ok[b, t]) + 1
                else:
                    t += 1
        assert engine_walk_acceptance(correct, valid, k) == (total, chains)
        assert chains > 500
