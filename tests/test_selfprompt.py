"""Self-written prompts (Magpie): the user-turn prefix of any chat template, the filters, and the four waves."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_tokenizer
from draftsmith.errors import DraftsmithError
from draftsmith.regenerate.selfprompt import (SelfPromptSettings, TurnFilter, end_of_turn_ids, is_repetitive,
                                   user_turn_prefix)

DEFAULT_SYSTEM = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_the_prefix_carries_the_templates_default_system_prompt_and_the_user_header():
    tok = build_tokenizer(DEFAULT_SYSTEM)
    prefix, suffix = user_turn_prefix(tok, [])
    assert prefix == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert suffix.startswith("<|im_end|>")
    assert end_of_turn_ids(tok, suffix) == [tok.convert_tokens_to_ids("<|im_end|>")]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    follow, _ = user_turn_prefix(tok, history)
    assert follow.endswith("<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\n") and "hi" in follow


def test_a_tokenizer_without_a_chat_template_gets_a_clear_error():
    tok = build_tokenizer()
    tok.chat_template = None
    with pytest.raises(DraftsmithError, match="need a chat template"):
        user_turn_prefix(tok, [])


def test_each_filter_fires_and_is_counted():
    flt = TurnFilter(SelfPromptSettings(), eval_texts=["Write a function that returns the sum of two integers a and b."])
    assert flt.reason("  ", True) == "empty"
    assert flt.reason("How do I bake sourdough bread at home with a starter?", False) == "cut_off"
    assert flt.reason("buy now " * 20, True) == "repetitive"
    assert flt.reason("Write a function that returns the sum of two integers a and b.", True) == "eval_overlap"
    first = "Can you recommend a healthy and balanced meal plan for a toddler with allergies to dairy and eggs?"
    assert flt.reason(first, True) is None
    assert flt.reason(first.replace("Can you", "Could you"), True) == "near_duplicate"
    assert flt.reason("I'm planning to launch a sustainable business in six months; can you help with ideas?", True) is None
    c = flt.counts
    assert (c.sampled, c.empty, c.cut_off, c.repetitive, c.eval_overlap, c.near_duplicate, c.kept) == (7, 1, 1, 1, 1, 1, 2)
    assert not is_repetitive("one two three four five six seven eight nine ten eleven twelve thirteen")


@pytest.mark.parametrize("decoder", ["rows", "generate"])
def test_regenerate_self_writes_multi_turn_conversations_and_a_rerun_skips_them(tmp_path, decoder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import build_tiny_target
    from draftsmith.regenerate.conversations import ConversationWriter
    from draftsmith.regenerate.command import LocalCompleter, LocalSettings, end_of_turn_stops, regenerate_self

    path = build_tiny_target(tmp_path / "t", layers=2, head_scale=3.0)  # flat logits: varied sampled turns
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    sp = SelfPromptSettings(count=24, max_turn_tokens=12, multi_turn=0.5, min_chars=2, seed=3)
    ls = LocalSettings(max_new_tokens=10, batch_size=8, decoder=decoder, max_length=256)  # a kind's system turn
    out = tmp_path / "conv.jsonl"
    complete = LocalCompleter(model, tok, ls, end_of_turn_stops(tok)[0])
    with ConversationWriter(out) as w:
        summary = regenerate_self(complete, tok, w, sp, ls, eval_texts=[])
    c = summary.first_turns
    assert c.sampled == 24 and c.kept + c.empty + c.cut_off + c.repetitive + c.near_duplicate + c.eval_overlap == 24
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == summary.conversations == c.kept
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert sum(r == ["user", "assistant", "user", "assistant"] for r in roles) == summary.multi_turn
    assert all(r in (["user", "assistant"], ["user", "assistant", "user", "assistant"]) for r in roles)
    with ConversationWriter(out) as w:
        again = regenerate_self(complete, tok, w, sp, ls, eval_texts=[])
    assert again.conversations == 0 and len(out.read_text().splitlines()) == len(rows)


@pytest.mark.engine
def test_self_written_prompts_through_a_real_llama_servers_completions_api(tmp_path):
    """The endpoint path of `--prompts self`: the embedded target served by llama-server, every wave sent as a raw
    prefix to /v1/completions (the chat template rendered here)."""
    from transformers import AutoTokenizer

    from draftsmith.engines import llamacpp
    from draftsmith.regenerate.conversations import ConversationWriter
    from draftsmith.regenerate.endpoints import EndpointCompleter
    from draftsmith.regenerate.command import LocalSettings, end_of_turn_stops, regenerate_self
    from draftsmith.target import embedded_gguf_path, resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2"))
    out = tmp_path / "conv.jsonl"
    with llamacpp.serve(llamacpp.LlamaServe(embedded_gguf_path()), tmp_path / "server.log") as base:
        complete = EndpointCompleter([base + "/v1"], concurrency=1, stop=(end_of_turn_stops(tok)[1],), seed=1)
        sp = SelfPromptSettings(count=4, max_turn_tokens=64, multi_turn=1.0, seed=1)
        with ConversationWriter(out) as w:
            summary = regenerate_self(complete, tok, w, sp, LocalSettings(max_new_tokens=24), eval_texts=[],
                                      backend="endpoint")
    assert summary.first_turns.sampled == 4 and summary.conversations == summary.first_turns.kept >= 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == summary.conversations and all(r["meta"]["backend"] == "endpoint" for r in rows)
    for r in rows:
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert len(users) == len(answers) and all(len(u) >= sp.min_chars for u in users) and all(answers)
        assert "<|im_start|>" not in "".join(users + answers), "the template leaked into a turn"
