"""Draft trees: EAGLE-2 style dynamic trees as tensors, and the longest-accepted-path rule.

Pure tensor functions, no models (the decoder runs the forwards). Letters: B rows of a batch, N tree
nodes (node 0 is the root: the last committed token, not yet seen by the target), C candidates.

Building a tree (Li et al., EAGLE-2, arXiv 2406.16858 §4; SGLang `eagle_utils.py` `select_top_k_tokens`
and `organize_draft_results`): the root's drafter distribution gives topk depth-1 candidates; each
later drafter step expands the topk best frontier nodes into topk children each (topk^2 candidates,
scored by the cumulative draft log-probability of their path) and keeps the best topk as the next
frontier. At the end the best N-1 of all candidates, by cumulative score, become the tree.

Verification: the target sees all N nodes at once; node i attends to the committed context plus the
nodes on its own root path (`DraftTree.ancestry`). With a choice per node (the target's argmax, or a
sample), the accepted path is the deepest node whose every node matches its parent's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidates:
    """Every drafted candidate of one draft round, in the order drafted (a parent precedes its children)."""

    tokens: torch.Tensor
    """(B, C) target-vocabulary ids."""
    parent: torch.Tensor
    """(B, C) candidate index of the parent; -1 for depth-1 candidates (children of the root)."""
    score: torch.Tensor
    """(B, C) cumulative draft log-probability of the path root..candidate."""
    depth: torch.Tensor
    """(C,) depth of each candidate (1 = child of the root)."""


@dataclass(frozen=True)
class DraftTree:
    """N nodes per row; node 0 is the root; parents precede children (index order is a topological order)."""

    tokens: torch.Tensor
    """(B, N) target-vocabulary ids."""
    parent: torch.Tensor
    """(B, N) node index of each node's parent; the root is its own parent."""
    depth: torch.Tensor
    """(B, N) distance from the root."""
    ancestry: torch.Tensor
    """(B, N, N) bool: [b, i, j] is True when node j lies on the path root..i (i included)."""


def chain_tree(root: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """A chain root -> d_1 -> ... -> d_k as a tree. root (B,), drafts (B, k)."""
    B, k = drafts.shape
    idx = torch.arange(k + 1, device=root.device)
    tokens = torch.cat([root[:, None], drafts], dim=1)  # (B, k+1)
    parent = (idx - 1).clamp(min=0).expand(B, k + 1)
    ancestry = torch.ones(k + 1, k + 1, dtype=torch.bool, device=root.device).tril().expand(B, k + 1, k + 1)
    return DraftTree(tokens=tokens, parent=parent, depth=idx.expand(B, k + 1), ancestry=ancestry)


def ancestry_of(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(B, N, N) path masks from parent pointers (B, N): row i = {i} | row parent(i), max_depth times."""
    B, N = parent.shape
    eye = torch.eye(N, dtype=torch.bool, device=parent.device).expand(B, N, N)
    anc = eye
    index = parent[:, :, None].expand(B, N, N)
    for _ in range(max_depth):  # after s rounds each row holds its path up to s levels; depth is small (<= ~8)
        anc = eye | anc.gather(1, index)
    return anc


def select_tree(root: torch.Tensor, cand: Candidates, nodes: int, max_depth: int) -> DraftTree:
    """The root plus the nodes-1 best candidates by cumulative score.

    A child's score never exceeds its parent's (log-probs are <= 0) and a stable sort keeps the lower
    index (the parent) first on ties, so the chosen set always contains every chosen node's ancestors.

    Args:
        root: (B,) the last committed token; cand: all candidates; nodes: N, the root included.
    """
    B, C = cand.tokens.shape
    best = torch.sort(cand.score, dim=-1, descending=True, stable=True).indices[:, :nodes - 1]
    chosen = best.sort(dim=-1).values  # (B, N-1) candidate ids in drafting order: parents first
    node_of = torch.zeros(B, C, dtype=torch.long, device=root.device)
    node_of.scatter_(1, chosen, torch.arange(1, nodes, device=root.device).expand(B, nodes - 1))
    cand_parent = cand.parent.gather(1, chosen)  # (B, N-1); -1 = the root
    parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
    zero = torch.zeros(B, 1, dtype=torch.long, device=root.device)
    parent = torch.cat([zero, parent], dim=1)  # (B, N)
    tokens = torch.cat([root[:, None], cand.tokens.gather(1, chosen)], dim=1)  # (B, N)
    depth = torch.cat([zero, cand.depth.expand(B, C).gather(1, chosen)], dim=1)  # (B, N)
    return DraftTree(tokens=tokens, parent=parent, depth=depth, ancestry=ancestry_of(parent, max_depth))


@dataclass(frozen=True)
class AcceptedPath:
    """The verification outcome per row."""

    accepted: torch.Tensor
    """(B,) accepted draft tokens (the depth of the last accepted node)."""
    on_path: torch.Tensor
    """(B, N) bool: the nodes root..last accepted node."""
    bonus: torch.Tensor
    """(B,) the target's choice after the last accepted node: the next root."""


def accept_path(tree: DraftTree, choice: torch.Tensor) -> AcceptedPath:
    """Longest path whose every node equals its parent's target choice.

    Greedy: choice = the target's argmax per node, so the output equals the target's own greedy decoding.
    Sampling: choice = one sample of the target distribution per node. Drafts are deterministic
    functions of the context, so accepting draft x with probability p(x) and otherwise sampling
    norm(max(0, p - onehot(x))) (speculative rejection sampling with q = onehot(x), Leviathan et al. 2023,
    as SGLang's `tree_speculative_sampling_target_only`) is the same as sampling y ~ p and accepting x
    iff y == x; siblings are distinct tokens, so at most one child matches and the emitted token at each
    node is an exact sample of p.

    Args:
        tree: the verified tree; choice: (B, N) the target's token after each node.
    """
    parent_choice = choice.gather(1, tree.parent)  # (B, N): what the target wants at each node's place
    match = tree.tokens == parent_choice
    match[:, 0] = True  # the root is committed
    ok = ~(tree.ancestry & ~match[:, None, :]).any(dim=-1)  # (B, N): every node on root..i matched
    # ok nodes form one path (siblings differ), so the deepest ok node ends it
    last = torch.where(ok, tree.depth + 1, 0).argmax(dim=-1)  # (B,)
    rows = torch.arange(choice.shape[0], device=choice.device)
    return AcceptedPath(accepted=tree.depth[rows, last], on_path=tree.ancestry[rows, last], bonus=choice[rows, last])
