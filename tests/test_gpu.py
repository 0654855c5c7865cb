"""CUDA kernels of the training path, against plain references (runs on the GPU machine; skipped elsewhere).

Tolerances: bf16 inputs; each check compares our error against the fp32 reference with the error of the
plain bf16 alternative (SDPA), so a wrong gradient (off by far more than rounding) fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.model.kernels import CausalAttentionLSE, causal_attention_lse_reference, ttt_attention, ttt_attention_lse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def qkv(T=512, nh=8, nkv=2, hd=128, steps=3, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n: (torch.randn(1, n, T, hd, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_()  # noqa: E731
    return mk(nh), mk(nkv), mk(nkv), [mk(nkv) for _ in range(steps)], [mk(nkv) for _ in range(steps)]


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: dynamo caches graphs per code object, so shapes another test compiled
    `ttt_unroll` for would otherwise make this test's shapes dynamic (a training run compiles one shape)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_causal_attention_lse_values_and_gradients_including_through_lse(backend):
    q, k, v, _, _ = qkv(nkv=8)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = CausalAttentionLSE.apply(q, k, v, scale, backend)
    ref_out, ref_lse = causal_attention_lse_reference(q.float(), k.float(), v.float(), scale)
    assert rel(out, ref_out) < 2e-2 and rel(lse, ref_lse) < 1e-3
    up_o, up_l = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    ours = torch.autograd.grad((out.float() * up_o).sum() + (lse * up_l).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * up_o).sum() + (ref_lse * up_l).sum(), (q, k, v))
    for name, a, b in zip("qkv", ours, ref):
        assert rel(a, b) < 3e-2, f"d{name} off by {rel(a, b):.3g}"


@pytest.mark.parametrize("steps", [1, 6])
def test_lse_merge_on_cuda_is_as_accurate_as_the_summary_key(steps):
    q, k0, v0, dk, dv = qkv(steps=steps)
    leaves = [q, k0, v0, *dk, *dv]
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    ref = ttt_attention_lse(f32[0], f32[1], f32[2], f32[3:3 + steps], f32[3 + steps:],
                            causal=causal_attention_lse_reference)
    up = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * up).sum(), f32)
    results = {}
    for name, fn in (("lse", ttt_attention_lse), ("summary", ttt_attention)):
        out = fn(q, k0, v0, dk, dv)
        grads = torch.autograd.grad((out.float() * up).sum(), leaves)
        results[name] = (rel(out, ref), max(rel(a, b) for a, b in zip(grads, g_ref)))
    (lse_out, lse_grad), (sum_out, sum_grad) = results["lse"], results["summary"]
    assert lse_out < 2 * sum_out + 1e-3 and lse_grad < 2 * sum_grad + 1e-3, results


def packed_documents(T=1024):
    documents = torch.zeros(1, T, dtype=torch.long, device="cuda")
    documents[:, 300:800], documents[:, 800:] = 1, 2
    return documents


@pytest.mark.parametrize("steps", [0, 1, 6])
def test_packed_rows_through_flex_block_mask_are_as_accurate_as_the_masked_summary_key(steps):
    """Packed rows on CUDA: FlexAttention under the document block mask (+ the lse merge for steps > 0) against
    the fp32 dense document-masked reference, values and gradients (including through flex's lse), no worse
    than the summary key under SDPA with the dense mask in bf16."""
    from functools import partial

    from draftsmith.model.kernels import document_block_mask, document_mask

    q, k0, v0, dk, dv = qkv(T=1024, steps=steps)
    documents = packed_documents()
    dense, block = document_mask(documents), document_block_mask(documents)
    leaves = [q, k0, v0, *dk, *dv]
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    if steps:
        ref = ttt_attention_lse(f32[0], f32[1], f32[2], f32[3:3 + steps], f32[3 + steps:],
                                causal=partial(causal_attention_lse_reference, mask=dense))
    else:
        ref = ttt_attention(f32[0], f32[1], f32[2], [], [], mask=dense)
    up = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * up).sum(), f32)
    results = {}
    for name, fn in (("flex", partial(ttt_attention_lse, mask=block)), ("summary", partial(ttt_attention, mask=dense))):
        out = fn(q, k0, v0, dk, dv)
        grads = torch.autograd.grad((out.float() * up).sum(), leaves)
        results[name] = (rel(out, ref), max(rel(a, b) for a, b in zip(grads, g_ref)))
    (flex_out, flex_grad), (sum_out, sum_grad) = results["flex"], results["summary"]
    assert flex_out < 2 * sum_out + 1e-3 and flex_grad < 2 * sum_grad + 1e-3, results


@pytest.mark.parametrize("compiled", [False, True, "cuda_graphs"])
def test_packed_ttt_forward_on_cuda_equals_the_unpacked_batch(compiled):
    """The whole packed CUDA path (per-row positions, flex block mask + lse merge, compiled or not, replayed as
    CUDA graphs or not) gives the unpacked batch's loss and gradients, fp32 (no autocast) so that only kernel
    rounding differs."""
    from test_drafter import packed_and_unpacked, random_documents, tiny_config

    from draftsmith.model.eagle3 import Eagle3Drafter, compile_for_training, ttt_forward
    from draftsmith.model.vocab import build_draft_vocab

    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_config(hidden_size=64, head_dim=16))
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    drafter = drafter.cuda()
    if compiled:
        compile_for_training(drafter, cuda_graphs=compiled == "cuda_graphs")
    head = torch.randn(96, 40, dtype=torch.float64)
    docs = random_documents([60, 90, 40, 120])
    for d in docs:
        d[4].copy_((d[3] @ head.T).argmax(-1))
    (ids, mask, aux, last, argmax), packed = packed_and_unpacked(docs, [[(1, 0, 90), (0, 0, 60), (2, 0, 40)],
                                                                       [(3, 0, 120)]], row_tokens=192)
    f = lambda x: x.cuda().float() if x.is_floating_point() else x.cuda()  # noqa: E731
    params = [p for p in drafter.parameters() if p.requires_grad]
    outs, grads = [], []
    for a, i, m, lst, t, documents in ((aux, ids, mask, last, argmax, None),
                                       (packed.aux, packed.input_ids, packed.loss_mask, packed.last,
                                        packed.target_argmax, packed.documents)):
        torch.compiler.cudagraph_mark_step_begin()
        out = ttt_forward(drafter, f(a), f(i), f(m), f(lst), f(head), steps=4, t_argmax=f(t),
                          documents=None if documents is None else f(documents))
        outs.append(out.loss.item())
        # copied out: with CUDA graphs the next forward's replay reuses the memory of this one's outputs
        grads.append([g.clone() for g in torch.autograd.grad(out.loss, params)])
    assert outs[1] == pytest.approx(outs[0], rel=1e-4)
    for a, b in zip(*grads):
        assert rel(b, a) < 1e-3


def test_compiled_training_steps_with_cuda_graphs_follow_the_eager_ones(monkeypatch):
    """`--compile --cuda-graphs` as the Trainer steps: the whole forward (target softmax, masks, FlexAttention
    block mask, TTT steps, loss) compiled as one graph (fullgraph: a graph break fails the test) and replayed as
    CUDA graphs, with the target head at a static address, then backward, clip and fused AdamW, over steps that
    alternate two packed batches: the losses and weights follow the eager run's (fp32, so only kernel rounding
    differs)."""
    from test_drafter import packed_and_unpacked, random_documents, tiny_config

    from draftsmith.model.eagle3 import Eagle3Drafter, compile_for_training, ttt_forward
    from draftsmith.model.vocab import build_draft_vocab

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, fullgraph=True, **kw))
    torch.manual_seed(0)
    eager = Eagle3Drafter(tiny_config(hidden_size=64, head_dim=16, norm_before_fc=True, norm_before_residual=True))
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    eager.d2t.copy_(vocab.d2t)
    eager.t2d.copy_(vocab.t2d)
    graphs = Eagle3Drafter(eager.config)
    graphs.load_state_dict(eager.state_dict())
    eager, graphs = eager.cuda(), graphs.cuda()
    compile_for_training(graphs, cuda_graphs=True)
    head = torch.randn(96, 40, device="cuda")
    torch._dynamo.mark_static_address(head)
    batches = []
    for seed in (0, 1):
        docs = random_documents([60, 90, 40, 120, 100], seed=seed)
        _, packed = packed_and_unpacked(docs, [[(1, 0, 90), (0, 0, 60), (2, 0, 40)], [(3, 0, 120), (4, 0, 100)]],
                                        row_tokens=256)
        batches.append([x.cuda().float() if x.is_floating_point() else x.cuda() for x in
                        (packed.aux, packed.input_ids, packed.loss_mask, packed.last, packed.target_argmax,
                         packed.documents)])
    losses = {}
    for name, drafter in (("eager", eager), ("graphs", graphs)):
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), fused=True)
        losses[name] = []
        for step in range(6):
            optimizer.zero_grad(set_to_none=True)
            # one micro-batch per step: TrainConfig refuses --grad-accum > 1 with --cuda-graphs, since a second
            # replay before the optimizer step overwrote the first one's gradients on the H200 (accessing them raised)
            aux, ids, mask, last, argmax, documents = batches[step % 2]
            torch.compiler.cudagraph_mark_step_begin()
            out = ttt_forward(drafter, aux, ids, mask, last, head, steps=4, t_argmax=argmax, documents=documents)
            out.loss.backward()
            losses[name].append(torch.cat([out.loss.detach().view(1), out.loss_sum]).cpu())
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
    assert losses["eager"][-2][0] < losses["eager"][0][0], "nothing trained; the comparison proves little"
    for step, (a, b) in enumerate(zip(losses["eager"], losses["graphs"])):
        assert torch.allclose(b, a, rtol=5e-3), (step, a, b)  # a stale replay output would be the other batch's
    for (key, a), b in zip(eager.named_parameters(), graphs.parameters()):
        assert rel(b, a) < 3e-2, key  # Adam's normalised steps amplify rounding where a gradient is near 0


def dflash_case(seed: int = 0, S: int = 1024, A: int = 96):
    """A DFlash drafter at SmolLM2-like head layout (hd 64, 9 / 3 heads) over a packed row of S tokens."""
    from draftsmith.model.dflash import DFlashConfig, DFlashDrafter, sample_anchors

    cfg = DFlashConfig(hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9, num_kv_heads=3,
                       head_dim=64, vocab_size=4096, target_hidden_size=576, target_num_layers=30,
                       aux_layer_ids=(2, 15, 28), block_size=16, mask_token_id=4095)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    aux = torch.randn(1, S, 3 * 576, device="cuda", generator=g)
    ids = torch.randint(0, 4095, (1, S), device="cuda", generator=g)
    loss_mask = torch.ones(1, S, dtype=torch.long, device="cuda")
    documents = (torch.arange(S, device="cuda") // 300)[None]  # four documents in the row
    embed = torch.randn(4096, 576, device="cuda", generator=g)
    head = torch.randn(4096, 576, device="cuda", generator=g) / 8
    anchors = sample_anchors(loss_mask, documents, 16, A, torch.Generator(device="cuda").manual_seed(1))
    return drafter, aux, ids, loss_mask, documents, embed, head, anchors


def test_dflash_flex_mask_training_equals_the_sdpa_mask_in_loss_and_gradients():
    """CUDA trains DFlash through a FlexAttention block mask; the boolean SDPA mask of the CPU path is the
    reference (fp32 both), so a wrong mask_mod (another block, the anchor's own position, another document) fails."""
    from draftsmith.model import dflash

    drafter, aux, ids, loss_mask, documents, embed, head, anchors = dflash_case()
    out = drafter(aux, ids, loss_mask, embed, head, anchors=anchors, documents=documents)
    out.loss.backward()
    flex_grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    mask = dflash.block_attention_mask(anchors.positions, documents, 16, flex_mask=False)
    ref = dflash.dflash_unroll(drafter, aux, ids, loss_mask, embed, head, anchors, dflash.DFLASH_LOSS_GAMMA, None,
                               documents, mask, None)
    ref.loss.backward()
    assert rel(out.loss, ref.loss) < 1e-4
    assert torch.equal(out.valid, ref.valid)
    for n, p in drafter.named_parameters():
        assert rel(flex_grads[n], p.grad) < 2e-3, n


def test_dflash_compiled_training_forward_equals_eager():
    from draftsmith.model.dflash import compile_for_training

    drafter, aux, ids, loss_mask, documents, embed, head, anchors = dflash_case(seed=2)
    eager = drafter(aux, ids, loss_mask, embed, head, anchors=anchors, documents=documents)
    compile_for_training(drafter)
    compiled = drafter(aux, ids, loss_mask, embed, head, anchors=anchors, documents=documents)
    assert rel(compiled.loss, eager.loss) < 1e-3
    assert (compiled.correct == eager.correct).float().mean() > 0.99
