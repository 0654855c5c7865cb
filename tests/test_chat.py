"""Loss masks from real chat templates: exactly the assistant tokens, reasoning included, boundaries kept."""

from __future__ import annotations

import pytest

from conftest import build_tokenizer
from draftsmith.regenerate.chat import prompt_ids, tokenize_conversation

# Qwen3-style: reasoning rendered in <think> only for assistant turns after the last user turn.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
LLAMA3_STYLE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def supervised_text(tok, sample) -> str:
    return "".join(tok.decode([i]) if m else "\x00" for i, m in zip(sample.input_ids, sample.loss_mask))


def spans(tok, sample) -> list[str]:
    return [s for s in supervised_text(tok, sample).split("\x00") if s]


def test_chatml_masks_each_assistant_turn_with_its_end_token():
    tok = build_tokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "print hello"},
            {"role": "assistant", "content": "print hello world"}, {"role": "user", "content": "and the fox"},
            {"role": "assistant", "content": "the quick brown fox"}]
    sample = tokenize_conversation(tok, msgs)
    assert spans(tok, sample) == ["print hello world<|im_end|>", "the quick brown fox<|im_end|>"]
    # the first supervised token directly follows the assistant header
    first = sample.loss_mask.index(1)
    assert tok.decode(sample.input_ids[:first]).endswith("<|im_start|>assistant\n")
    # the prompt part tokenizes exactly like the inference-time prompt
    assert sample.input_ids[:first] == prompt_ids(tok, msgs[:2])


def test_qwen3_style_reasoning_is_supervised_where_rendered_and_dropped_from_earlier_turns():
    tok = build_tokenizer(QWEN3_STYLE)
    msgs = [{"role": "user", "content": "print hello"},
            {"role": "assistant", "content": "print hello world", "reasoning_content": "the user wants print"},
            {"role": "user", "content": "and the fox"},
            {"role": "assistant", "content": "the quick brown fox", "reasoning_content": "a classic sentence"}]
    got = spans(tok, tokenize_conversation(tok, msgs))
    assert got == ["print hello world<|im_end|>",
                   "<think>\na classic sentence\n</think>\n\nthe quick brown fox<|im_end|>"]


def test_llama3_style_template_masks_content_and_eot():
    tok = build_tokenizer(LLAMA3_STYLE, specials=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                                  "<|eot_id|>"), bos="<|begin_of_text|>", eos="<|eot_id|>")
    msgs = [{"role": "user", "content": "print hello"}, {"role": "assistant", "content": "print hello world"}]
    sample = tokenize_conversation(tok, msgs)
    assert spans(tok, sample) == ["print hello world<|eot_id|>"]
    assert sample.input_ids.count(tok.convert_tokens_to_ids("<|begin_of_text|>")) == 1  # no double BOS


def test_tokenizer_without_template_uses_documented_fallback():
    tok = build_tokenizer()
    tok.chat_template = None
    sample = tokenize_conversation(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert spans(tok, sample) == ["hello<|im_end|>"]


def test_truncation_cuts_ids_and_mask_together():
    tok = build_tokenizer()
    msgs = [{"role": "user", "content": "print hello"}, {"role": "assistant", "content": "the quick brown fox jumps"}]
    full = tokenize_conversation(tok, msgs)
    cut = tokenize_conversation(tok, msgs, max_length=len(full.input_ids) - 3)
    assert cut.input_ids == full.input_ids[:-3] and cut.loss_mask == full.loss_mask[:-3]


@pytest.mark.e2e
def test_smollm2_chatml_from_the_gguf():
    from transformers import AutoTokenizer

    from draftsmith.target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2"))
    msgs = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]
    sample = tokenize_conversation(tok, msgs)
    assert spans(tok, sample) == ["Hi there!<|im_end|>"]
    # SmolLM2's template adds its own system prompt when none is given: never supervised
    assert "You are a helpful AI assistant" in tok.decode(sample.input_ids)
