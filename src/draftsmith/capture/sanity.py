"""Sanity of captured hidden states: refuse degenerate states before anything trains on them.

Engines have written all-zero states silently (vllm-project/vllm#46301: hybrid targets), and a wrong
layer id or a missing final norm gives states that look fine by shape. Three checks:

- `check_states`: a sample's aux and last states are finite, not all zero and not constant
  (per token: a row whose values are all equal carries nothing);
- `check_greedy`: the final hidden state through the target head gives the token the engine itself
  chose greedily (a near tie, within `TIE_MARGIN` in logits, is accepted);
- `check_store`: the first two over every sample of a store (`draftsmith capture --verify`).

    draftsmith capture --verify --out STORE
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.capture.store import FeatureStore, Sample

# fp32 logits of two engines differ by ~1e-4 on SmolLM2 (docs/engines.md §8.2: token for token in fp32); a
# bf16-stored state moves logits by up to ~0.1, so a top-2 gap below this is a tie, not a wrong state.
TIE_MARGIN = 0.25


def degenerate(x: torch.Tensor) -> str | None:
    """Why a (T, W) block of states is degenerate, or None."""
    x = x.float()
    if not torch.isfinite(x).all():
        return f"{int((~torch.isfinite(x)).sum())} non-finite values"
    if not x.abs().amax() > 0:
        return "all zero"
    flat_rows = (x.amax(dim=-1) == x.amin(dim=-1)).nonzero()
    if len(flat_rows):
        return f"constant across the hidden dimension at {len(flat_rows)} of {x.shape[0]} tokens " \
               f"(first at token {int(flat_rows[0])})"
    return None


def check_states(sample: Sample, index: int, where: str = "capture") -> None:
    """Raise when the sample's aux or last states are degenerate."""
    for name in ("aux", "last"):
        why = degenerate(getattr(sample, name))
        if why:
            raise DraftsmithError(
                f"degenerate hidden states in sample {index} ({where}): {name} is {why}",
                got=f"{name} of shape {tuple(getattr(sample, name).shape)}",
                expected="finite, non-zero states that vary across the hidden dimension",
                fix="the engine or the layer ids are wrong (vllm#46301 wrote zeros for hybrid targets): check the "
                "server's --speculative-config ids and version, then delete the store and recapture")


def check_greedy(last: torch.Tensor, head: torch.Tensor, engine_token: int) -> None:
    """The final hidden state of the last prompt token through the head must give the engine's greedy token.

    Args:
        last: (1, H) post-norm state of the last prompt token.
        head: (V, H) the target's output embeddings.
        engine_token: the token the engine generated greedily after the prompt.
    """
    logits = (last.float() @ head.float().T)[0]  # (V,)
    ours = int(logits.argmax())
    if ours == engine_token or engine_token < 0:
        return
    gap = float(logits[ours] - logits[engine_token])
    if gap <= TIE_MARGIN:
        return
    raise DraftsmithError(
        "captured final hidden state disagrees with the engine's own greedy token",
        got=f"head(norm(state)) argmax {ours}, engine token {engine_token} (logit gap {gap:.2f})",
        expected=f"the same token, or a near tie within {TIE_MARGIN}",
        fix="the last layer id or the final norm is off (vLLM's id N is the state before the norm); check "
        "--target is the model the server serves")


def check_store(store: FeatureStore) -> int:
    """`check_states` over every sample of a store; returns how many were checked."""
    for k in range(len(store)):
        i, _ = store.index[k]
        check_states(store.sample(k), k, where=store.manifest["shards"][i]["file"])
    return len(store)
