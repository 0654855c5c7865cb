"""Reference speculative decoder: lossless greedy (chain, tree, batch > 1), distribution-preserving sampling,
tree construction, engine aux-id reading."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import pytest
import torch

import draftsmith.eval.decoder as decoder
from conftest import CORPUS
from draftsmith.regenerate.chat import prompt_ids
from draftsmith.eval.decoder import (DecodeSettings, choose, decode_batch, speculative_decode,
                                target_decode)
from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter, engine_walk_acceptance, simulated_acceptance
from draftsmith.target import load_target
from draftsmith.eval.tree import Candidates, DraftTree, accept_path, ancestry_of, chain_tree, select_tree
from draftsmith.model.vocab import build_draft_vocab


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


AUX = (2, 4, 5)
CHAIN = DecodeSettings(k=4, max_new_tokens=24)
TREE = DecodeSettings(k=4, topk=3, draft_tokens=10, max_new_tokens=24)


def prompts_for(tok, n: int) -> list[list[int]]:
    """n chat prompts of varied lengths."""
    return [prompt_ids(tok, [{"role": "user", "content": f"{CORPUS[i % len(CORPUS)]} {'x ' * (i % 5)}{i}"}])
            for i in range(n)]


def with_eos(settings: DecodeSettings, tok) -> DecodeSettings:
    from dataclasses import replace

    return replace(settings, eos_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def reference(target_and_drafter):
    """The target's own greedy continuations of 50 prompts (transformers' own masks, one token at a time)."""
    model, tok, _ = target_and_drafter
    prompts = prompts_for(tok, 50)
    settings = with_eos(CHAIN, tok)
    return prompts, [target_decode(model, p, settings).tokens for p in prompts]


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_output_is_token_identical_to_target_greedy_on_50_prompts(target_and_drafter, reference, settings):
    model, tok, drafter = target_and_drafter
    prompts, base = reference
    steps = 0
    for i, (ids, want) in enumerate(zip(prompts, base)):
        spec = speculative_decode(model, drafter, ids, AUX, with_eos(settings, tok))
        assert spec.tokens == want, (i, spec.tokens, want)
        steps += len(spec.accepted)
    assert steps > 50


def oracle_draft(reference_tokens: dict[int, list[int]], rng):
    """Wrap `decoder.draft`: put the target's true continuation on a root path of every tree (so deep paths
    are accepted, also through later siblings), and break one node of it for about half the rows."""
    real = decoder.draft

    def draft(drafter, state, settings):
        tree = real(drafter, state, settings)
        tokens = tree.tokens.clone()
        for r, seq in enumerate(state.rows):
            truth = reference_tokens[seq][len(state.tokens[seq]) - state.prompt_lens[seq]:]
            node = rng.randrange(1, tokens.shape[1])
            path = [j for j in range(tokens.shape[1]) if tree.ancestry[r, node, j]][1:]
            for j in path:
                d = int(tree.depth[r, j])
                tokens[r, j] = truth[d - 1] if d - 1 < len(truth) else 0
            if path and rng.random() < 0.5:
                tokens[r, rng.choice(path)] += 1
        return DraftTree(tokens=tokens, parent=tree.parent, depth=tree.depth, ancestry=tree.ancestry)

    return draft


@pytest.mark.parametrize("settings,batch", [(CHAIN, 1), (TREE, 1), (CHAIN, 8), (TREE, 8)],
                         ids=["chain-b1", "tree-b1", "chain-b8", "tree-b8"])
def test_deep_acceptance_keeps_output_identical_per_sequence(target_and_drafter, reference, monkeypatch,
                                                             settings, batch):
    """Trees that hold the true continuation (often not on the first sibling) are accepted deep; the caches
    must keep exactly the accepted path, per row, while rows of different lengths share a batch."""
    import random

    model, tok, drafter = target_and_drafter
    prompts, base = reference
    prompts, base = prompts[:24], base[:24]
    accepted = []
    for start in range(0, len(prompts), batch):
        group = list(range(start, min(start + batch, len(prompts))))
        monkeypatch.setattr(decoder, "draft", oracle_draft({j: base[g] for j, g in enumerate(group)},
                                                           random.Random(start)))
        res = decode_batch(model, drafter, [prompts[g] for g in group], AUX, with_eos(settings, tok))
        for j, g in enumerate(group):
            assert res.tokens[j] == base[g], (g, res.tokens[j], base[g])
            accepted += res.accepted[j]
    assert sum(accepted) / len(accepted) > 1.0, "the oracle trees were barely accepted: the test tests nothing"
    # a chain is k deep; a random drafter's 10-node tree is mostly 2 deep (wide near the root)
    assert max(accepted) >= 2
    if settings.topk == 1:
        assert max(accepted) == settings.k


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_batched_greedy_with_a_real_drafter_matches_target_greedy(target_and_drafter, reference, settings):
    model, tok, drafter = target_and_drafter
    prompts, base = reference
    res = decode_batch(model, drafter, prompts[:16], AUX, with_eos(settings, tok))
    assert res.tokens == base[:16]


def test_batched_drafts_equal_single_sequence_drafts(target_and_drafter, reference, monkeypatch):
    """Padding, holes and per-row positions must not change what the drafter proposes for a sequence:
    the trees drafted for each prompt at batch 6 equal those drafted for it alone."""
    model, tok, drafter = target_and_drafter
    prompts, _ = reference
    real = decoder.draft

    def trees(batch_prompts):
        seen = {}

        def spy(drafter, state, settings):
            tree = real(drafter, state, settings)
            for r, seq in enumerate(state.rows):
                seen.setdefault(seq, []).append(tree.tokens[r].tolist())
            return tree

        monkeypatch.setattr(decoder, "draft", spy)
        decode_batch(model, drafter, batch_prompts, AUX, with_eos(TREE, tok))
        return seen

    batched = trees(prompts[:6])
    for i in range(6):
        assert trees([prompts[i]])[0] == batched[i], i


def test_plain_batched_decoding_matches_target_greedy(target_and_drafter, reference):
    """k = 0 (the batched speed-up baseline) is plain greedy decoding through the same masks."""
    model, tok, _ = target_and_drafter
    prompts, base = reference
    res = decode_batch(model, None, prompts[:12], AUX, with_eos(DecodeSettings(k=0, max_new_tokens=24), tok))
    assert res.tokens == base[:12]


def test_drafter_tree_mask_gives_each_node_its_own_path_context(target_and_drafter, monkeypatch):
    """Every drafted candidate's cumulative score equals the sum of log-probs the drafter gives along its
    path when the path is fed alone, as a chain: the tree mask hides siblings and cousins."""
    model, tok, drafter = target_and_drafter
    ids = prompt_ids(tok, [{"role": "user", "content": "the quick brown fox"}])
    settings = DecodeSettings(k=3, topk=3, draft_tokens=12, max_new_tokens=8)
    captured = {}
    real_select = decoder.select_tree

    def spy(root, cand, nodes, max_depth):
        captured["cand"] = cand
        return real_select(root, cand, nodes, max_depth)

    import copy

    state = decoder.prefill(model, [ids], AUX, settings)
    fresh = copy.deepcopy(state)
    monkeypatch.setattr(decoder, "select_tree", spy)
    decoder.draft(drafter, state, settings)
    cand = captured["cand"]
    draft_id = {int(t): i for i, t in enumerate(drafter.d2t + torch.arange(len(drafter.d2t)))}
    with torch.inference_mode():
        logp, h = decoder.catch_up(drafter, fresh)
        committed = fresh.drafter_cache.length
        for c in range(cand.tokens.shape[1]):
            path = [c]
            while int(cand.parent[0, path[0]]) >= 0:
                path.insert(0, int(cand.parent[0, path[0]]))
            total, lp, hh = 0.0, logp[0], h[0]
            for depth, node in enumerate(path):
                t = int(cand.tokens[0, node])
                total += float(lp[draft_id[t]])
                if depth + 1 < len(path):
                    n = fresh.drafter_cache.length
                    allowed = torch.cat([fresh.drafter_valid, torch.ones(1, n - committed + 1, dtype=torch.bool)], 1)
                    h_out = drafter.decode_step(torch.tensor([[t]]), hh[None, None],
                                                fresh.root_pos[:, None] + depth, fresh.drafter_cache, allowed[:, None])
                    hh = h_out[0, 0]
                    lp = decoder.draft_head(drafter, hh)
            fresh.drafter_cache.crop(committed)
            assert abs(total - float(cand.score[0, c])) < 1e-4, (c, total, float(cand.score[0, c]))


def test_chain_accepts_an_oracle_draft_whole_and_stops_at_the_first_miss(target_and_drafter):
    """An oracle draft (the target's own continuation) must be accepted whole: the accept rule is right."""
    model, tok, _ = target_and_drafter
    ids = prompt_ids(tok, [{"role": "user", "content": "print hello world"}])
    base = target_decode(model, ids, DecodeSettings(max_new_tokens=6))
    root = torch.tensor([base.tokens[0]])
    good = chain_tree(root, torch.tensor([base.tokens[1:5]]))
    # node i's logits: the target's prediction after the root and d_1..d_i
    logits = model(torch.tensor([ids + base.tokens])).logits[:, len(ids):len(ids) + 5]  # (1, 5, V)
    path = accept_path(good, logits.argmax(-1))
    assert (int(path.accepted[0]), int(path.bonus[0])) == (4, base.tokens[5])
    wrong = base.tokens[1:3] + [(base.tokens[3] + 1) % 300] + base.tokens[4:5]
    path = accept_path(chain_tree(root, torch.tensor([wrong])), logits.argmax(-1))
    assert (int(path.accepted[0]), int(path.bonus[0])) == (2, base.tokens[3])
    assert path.on_path[0].tolist() == [True, True, True, False, False]


def small_tree() -> DraftTree:
    """root(0) -> a(1)=5, b(2)=7; a -> c(3)=9; b -> d(4)=9, e(5)=4."""
    parent = torch.tensor([[0, 0, 0, 1, 2, 2]])
    return DraftTree(tokens=torch.tensor([[1, 5, 7, 9, 9, 4]]), parent=parent,
                     depth=torch.tensor([[0, 1, 1, 2, 2, 2]]), ancestry=ancestry_of(parent, 2))


def test_tree_accepts_the_path_through_a_later_sibling():
    tree = small_tree()
    assert tree.ancestry[0, 5].tolist() == [True, False, True, False, False, True]
    # the target wants 7 after the root, 4 after b, 3 after e
    choice = torch.tensor([[7, 0, 4, 0, 0, 3]])
    path = accept_path(tree, choice)
    assert (int(path.accepted[0]), int(path.bonus[0])) == (2, 3)
    assert path.on_path[0].tolist() == [True, False, True, False, False, True]
    path = accept_path(tree, torch.tensor([[8, 0, 4, 0, 0, 3]]))  # nothing matches: the bonus is the root's choice
    assert (int(path.accepted[0]), int(path.bonus[0])) == (0, 8)


def test_select_tree_keeps_every_chosen_nodes_ancestors_even_on_ties():
    g = torch.Generator().manual_seed(0)
    B, topk, depth = 64, 3, 4
    parents, scores, tokens, depths = [], [], [], []
    frontier_score = torch.zeros(B, 1)
    frontier_ids = torch.full((B, 1), -1)
    offset = 0
    for d in range(1, depth + 1):
        width = frontier_ids.shape[1]
        step = -torch.randint(0, 3, (B, width, topk), generator=g).float()  # many exact ties, zeros included
        s = (frontier_score[:, :, None] + step).flatten(1)
        parents.append(frontier_ids.repeat_interleave(topk, 1))
        scores.append(s)
        tokens.append(torch.randint(0, 100, s.shape, generator=g))
        depths.append(torch.full((s.shape[1],), d))
        frontier_score, sel = s.topk(topk, dim=-1)
        frontier_ids = offset + sel
        offset += s.shape[1]
    cand = Candidates(tokens=torch.cat(tokens, 1), parent=torch.cat(parents, 1), score=torch.cat(scores, 1),
                      depth=torch.cat(depths))
    tree = select_tree(torch.zeros(B, dtype=torch.long), cand, 12, depth)
    for b in range(B):
        for i in range(1, 12):
            p = int(tree.parent[b, i])
            assert p < i and int(tree.depth[b, i]) == int(tree.depth[b, p]) + 1, (b, i)
    assert (tree.ancestry.sum(-1) == tree.depth + 1).all()


def test_tree_sampling_emits_exact_target_samples():
    """Sample the target at every node, follow the matching child: the first emitted token must follow p(root)
    and the second, after child a (token 5), p(a), although a, b, c, d, e are fixed drafts.

    40,000 rows: each frequency has standard error <= sqrt(0.25/40000) = 0.0025 (first token) and
    <= 0.0025/sqrt(P(first = 5)) ~ 0.0045 (second); tolerance 0.02 is > 4.4 sigma: by chance < 1e-4.
    """
    g = torch.Generator().manual_seed(0)
    V, rows = 10, 40000
    logits = torch.randn(6, V, generator=g)
    logits[0, 5] += 1.0  # make the root's first child likely enough to measure what follows it
    tree = small_tree()
    tree = DraftTree(tokens=tree.tokens.expand(rows, 6), parent=tree.parent.expand(rows, 6),
                     depth=tree.depth.expand(rows, 6), ancestry=tree.ancestry.expand(rows, 6, 6))
    path = accept_path(tree, choose(logits.expand(rows, 6, V), 1.0, g))
    first = torch.where(path.accepted >= 1, torch.where(path.on_path[:, 1], 5, 7), path.bonus)
    p = torch.softmax(logits, -1)
    assert torch.allclose(torch.bincount(first, minlength=V).float() / rows, p[0], atol=0.02)
    after_a = path.on_path[:, 1]
    second = torch.where(path.accepted[after_a] >= 2, 9, path.bonus[after_a])
    assert torch.allclose(torch.bincount(second, minlength=V).float() / int(after_a.sum()), p[1], atol=0.02)


@pytest.mark.parametrize("settings", [DecodeSettings(k=3, temperature=0.8, max_new_tokens=20),
                                      DecodeSettings(k=3, topk=2, draft_tokens=6, temperature=0.8, max_new_tokens=20)],
                         ids=["chain", "tree"])
def test_speculative_sampling_runs_and_reports_acceptance(target_and_drafter, settings):
    model, tok, drafter = target_and_drafter
    ids = prompt_ids(tok, [{"role": "user", "content": "the quick brown fox"}])
    res = speculative_decode(model, drafter, ids, AUX, settings, seed=1)
    again = speculative_decode(model, drafter, ids, AUX, settings, seed=1)
    assert len(res.tokens) == 20 and all(0 <= a <= 3 for a in res.accepted)
    assert res.tokens == again.tokens, "seeded sampling is reproducible"


def test_settings_follow_sglang_tree_rules():
    assert DecodeSettings(k=5, topk=4, draft_tokens=8).nodes == 8
    assert DecodeSettings(k=4).nodes == 5
    with pytest.raises(Exception, match="chain"):
        DecodeSettings(k=4, topk=1, draft_tokens=8)
    with pytest.raises(Exception, match="tree can hold"):
        DecodeSettings(k=2, topk=2, draft_tokens=8)  # at most 1 + 2 + 4 = 7 candidates


def test_eval_summary_without_a_baseline_says_not_measured(tmp_path):
    """--no-baseline: the markdown says n/a, the JSON null (strict JSON, no NaN), the plots draw tau only."""
    import json
    from dataclasses import asdict

    from draftsmith.eval.evaluation import plot, recommend, report_markdown, summarize

    r = summarize(4, [2, 0, 1, 4], spec_tokens=11, spec_s=2.0, base_tokens=0, base_s=0.0, model_s=1.9, identical=None)
    text = report_markdown([r], {"limit": 1})
    assert "nan" not in text and "| n/a | n/a |" in text and "speed-up n/a" in text
    assert "| 2.75 |" in text  # tau: (2 + 0 + 1 + 4) accepted + 4 bonus tokens over 4 steps
    doc = json.loads(json.dumps(asdict(r)), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert doc["speedup"] is None and doc["tokens_per_s_base"] is None
    r2 = summarize(2, [2, 1], spec_tokens=5, spec_s=1.0, base_tokens=0, base_s=0.0, model_s=0.9, identical=None)
    assert recommend([r, r2]) is r  # by tau without a speed-up
    assert all(p.exists() for p in plot([r, r2], tmp_path))


@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_output": True}],
                         ids=["plain", "input-norm-and-normed-output"])
def test_engine_walk_of_teacher_forced_steps_equals_decoded_tau(target_and_drafter, reference, norms):
    """`engine_walk_acceptance` over TTT outputs on the target's own greedy text predicts what decoding measures.

    The drafter is first trained a little on that text, so that it accepts some drafts and misses others (a random
    drafter accepts nothing, which would prove nothing). The all-starts figure is reported beside it: it is the one
    that over-states decoded tau.
    """
    from copy import deepcopy


    from draftsmith.model.eagle3 import engine_walk_acceptance, simulated_acceptance, step_masks

    model, tok, drafter = target_and_drafter
    drafter = deepcopy(drafter)
    if norms:
        from dataclasses import replace

        plain = drafter
        drafter = Eagle3Drafter(replace(plain.config, **norms)).eval()
        assert drafter.load_state_dict(plain.state_dict(), strict=False).missing_keys == ["input_norm.weight"]
        with torch.no_grad():
            drafter.input_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    prompts, _ = reference
    k, n_new = 3, 24
    # The target's greedy text, k + 1 tokens past what decoding will emit, so the last chain decoding verifies sees
    # the same continuation in the teacher-forced steps.
    longer = [target_decode(model, p, DecodeSettings(k=0, max_new_tokens=n_new + k + 1)).tokens for p in prompts]
    feats = []
    with torch.no_grad():
        for p, new in zip(prompts, longer):
            ids = torch.tensor([p + new])
            out = model(input_ids=ids, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in AUX], dim=-1)
            mask = torch.zeros_like(ids)
            mask[0, len(p):] = 1
            feats.append((ids, mask, aux, out.hidden_states[-1], len(p)))
    counts = torch.bincount(torch.tensor([t for new in longer for t in new]), minlength=model.config.vocab_size)
    vocab = build_draft_vocab(counts, drafter.config.draft_vocab_size)  # the tokens this text uses
    with torch.no_grad():
        drafter.d2t.copy_(vocab.d2t)
        drafter.t2d.copy_(vocab.t2d)
    head = model.get_output_embeddings().weight.detach()
    opt = torch.optim.AdamW([q for q in drafter.parameters() if q.requires_grad], lr=1e-2)
    torch.manual_seed(0)
    for _ in range(3):  # partly trained
        for ids, mask, aux, last, _ in feats:
            opt.zero_grad()
            drafter(aux, ids, mask, last, head, steps=k).loss.backward()
            opt.step()
    drafter.eval()

    walk, every, decoded = [0.0, 0], [0.0, 0], [0, 0]
    with torch.no_grad():
        for (ids, mask, aux, last, n_prompt), p in zip(feats, prompts):
            out = drafter(aux, ids, mask, last, head, steps=k)
            valid = out.valid.clone()
            valid[0, 0, n_prompt - 2 + n_new:] = False  # decoding's roots: its first n_new - 1 tokens
            for acc, fn in ((walk, engine_walk_acceptance), (every, simulated_acceptance)):
                s, c = fn(out.correct, valid, k)
                acc[0] += s
                acc[1] += c
            res = speculative_decode(model, drafter, p, AUX, DecodeSettings(k=k, max_new_tokens=n_new))
            decoded[0] += sum(a + 1 for a in res.accepted)
            decoded[1] += len(res.accepted)
    tau_walk, tau_every, tau_decoded = walk[0] / walk[1], every[0] / every[1], decoded[0] / decoded[1]
    assert 1.3 < tau_decoded < k + 0.7, f"partly trained drafter expected, got decoded tau {tau_decoded:.3f}"
    assert walk[1] == decoded[1] and tau_walk == pytest.approx(tau_decoded, abs=1e-9), (walk, decoded, tau_every)
    assert tau_every > tau_walk  # the all-starts simulation over-states it


def test_masked_gqa_is_switched_on_for_cpus_only_and_a_preset_value_wins(monkeypatch):
    import os

    monkeypatch.delenv(decoder.MASKED_GQA, raising=False)
    assert not decoder.masked_gqa("cuda") and decoder.MASKED_GQA not in os.environ
    assert decoder.masked_gqa("cpu") and os.environ[decoder.MASKED_GQA] == "1"
    monkeypatch.setenv(decoder.MASKED_GQA, "0")
    assert not decoder.masked_gqa(torch.device("cpu")) and os.environ[decoder.MASKED_GQA] == "0"


def test_masked_gqa_gives_the_same_verification_and_the_same_greedy_output(target_and_drafter, reference, monkeypatch):
    """The switch takes effect (the KV heads are no longer repeated) and changes no logit nor token."""
    import transformers.integrations.sdpa_attention as sdpa

    model, tok, drafter = target_and_drafter
    prompts, base = reference
    repeats = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: repeats.append(1) or real(*a))
    ids = torch.tensor([prompts[0]])
    n = ids.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None]
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(decoder.MASKED_GQA, flag)
        repeats.clear()
        with torch.inference_mode():
            out[flag] = decoder.target_forward(model, ids, torch.arange(n)[None], None, allowed, AUX)
        assert bool(repeats) == (flag == "0")
    torch.testing.assert_close(out["1"], out["0"], rtol=1e-6, atol=1e-6)
    for ids, want in list(zip(prompts, base))[:10]:  # the switch is still "1"
        assert speculative_decode(model, drafter, ids, AUX, with_eos(CHAIN, tok)).tokens == want


def _tied_target(tiny_target, dtype: str, monkeypatch):
    """The tiny target in `dtype` with one token's output row copied onto another's: wherever one of them is
    the target's top choice the other ties it (a top-2 gap of 0), the near-tie a bf16 reduction order can flip."""
    model, tok = load_target(Path(tiny_target), dtype=dtype)
    prompt = prompts_for(tok, 1)[0]
    first = target_decode(model, prompt, CHAIN)
    t = first.tokens[2]
    u = next(i for i in range(model.config.vocab_size - 1, 0, -1) if i not in first.tokens)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[u].copy_(head[t])
    return model, tok, prompt, (min(t, u), max(t, u))


def _flip(monkeypatch, pair):
    """Verification rounds the tie the other way: where the target's choice is the lower id of the pair, the
    higher one comes out (what a k+1-token forward summed in another order can do)."""
    real = decoder.choose

    def flipped(logits, temperature, generator):
        out = real(logits, temperature, generator)
        return torch.where(out == pair[0], torch.full_like(out, pair[1]), out)

    monkeypatch.setattr(decoder, "choose", flipped)


def test_a_bf16_divergence_at_a_near_tie_is_a_note_with_its_place_and_gap(tiny_target, target_and_drafter,
                                                                           monkeypatch):
    from draftsmith.bench.verdict import eval_verdict
    from draftsmith.eval.evaluation import decisive

    model, _, prompt, pair = _tied_target(tiny_target, "bfloat16", monkeypatch)
    drafter = deepcopy(target_and_drafter[2]).to(torch.bfloat16)
    plain = target_decode(model, prompt, CHAIN)
    assert pair[0] in plain.tokens and len(plain.top2) == len(plain.tokens)
    _flip(monkeypatch, pair)
    spec = speculative_decode(model, drafter, prompt, AUX, CHAIN).tokens
    d = decoder.first_divergence(7, plain, spec, model.dtype)
    assert spec != plain.tokens and d.position == plain.tokens.index(pair[0])
    assert (d.sequence, d.gap, d.dtype, d.near_tie) == (7, 0.0, "bfloat16", True) and d.tolerance > 0
    ev = {"tau": 2.0, "k": 4, "speedup": 1.5, "identical_to_target": False, "divergence": decisive([d])}
    v = eval_verdict(ev)
    assert v["decision"] == "go" and not any("a decoder or export bug" in r for r in v["reasons"])
    assert any(r.startswith("note: greedy output first differs at sequence 7, token "
                            f"{d.position}") and "near-tie" in r for r in v["reasons"])


def test_the_same_divergence_in_float32_is_a_bug(tiny_target, target_and_drafter, monkeypatch):
    from draftsmith.bench.verdict import eval_verdict
    from draftsmith.eval.evaluation import decisive

    model, _, prompt, pair = _tied_target(tiny_target, "float32", monkeypatch)
    plain = target_decode(model, prompt, CHAIN)
    _flip(monkeypatch, pair)
    spec = speculative_decode(model, target_and_drafter[2], prompt, AUX, CHAIN).tokens
    d = decoder.first_divergence(0, plain, spec, model.dtype)
    assert (d.gap, d.tolerance, d.near_tie) == (0.0, 0.0, False)
    v = eval_verdict({"tau": 2.0, "k": 4, "speedup": 1.5, "identical_to_target": False, "divergence": decisive([d])})
    assert v["decision"] == "no-go"
    assert any("a decoder or export bug" in r and "float32 decoding is exact" in r for r in v["reasons"])


def test_a_broken_acceptance_rule_in_bf16_is_still_a_bug(tiny_target, target_and_drafter, monkeypatch):
    """Every drafted token accepted whatever the target chose: the output leaves the target's where its top two
    logits are far apart, and the verdict says decoder bug even in bf16."""
    from draftsmith.bench.verdict import eval_verdict
    from draftsmith.eval.evaluation import decisive
    from draftsmith.eval.tree import AcceptedPath

    model, tok = load_target(Path(tiny_target), dtype="bfloat16")
    drafter = deepcopy(target_and_drafter[2]).to(torch.bfloat16)
    prompts = prompts_for(tok, 4)
    plains = [target_decode(model, p, CHAIN) for p in prompts]

    def accept_all(tree, choice):
        rows = torch.arange(choice.shape[0], device=choice.device)
        last = tree.depth.argmax(dim=-1)
        return AcceptedPath(accepted=tree.depth[rows, last], on_path=tree.ancestry[rows, last],
                            bonus=choice[rows, last])

    monkeypatch.setattr(decoder, "accept_path", accept_all)
    divs = [decoder.first_divergence(i, plain, speculative_decode(model, drafter, p, AUX, CHAIN).tokens, model.dtype)
            for i, (p, plain) in enumerate(zip(prompts, plains))]
    divs = [d for d in divs if d]
    assert divs and all(d.gap is not None for d in divs)
    worst = decisive(divs)
    assert not worst["near_tie"] and worst["gap"] > worst["tolerance"] > 0
    v = eval_verdict({"tau": 5.0, "k": 4, "speedup": 3.0, "identical_to_target": False, "divergence": worst})
    assert v["decision"] == "no-go" and any("a decoder or export bug" in r for r in v["reasons"])


def test_identical_output_has_no_divergence_and_tolerances_follow_the_dtype(target_and_drafter, reference):
    model, _, drafter = target_and_drafter
    prompts, _ = reference
    plain = target_decode(model, prompts[0], CHAIN)
    assert decoder.first_divergence(0, plain, speculative_decode(model, drafter, prompts[0], AUX, CHAIN).tokens,
                                    model.dtype) is None
    assert decoder.flip_tolerance(torch.float32, 20.0) == 0.0
    assert decoder.flip_tolerance(torch.bfloat16, 20.0) == 4 * 2 ** -7 * 20.0
    assert decoder.flip_tolerance(torch.float16, 20.0) == 4 * 2 ** -10 * 20.0
