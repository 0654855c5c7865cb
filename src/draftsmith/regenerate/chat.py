"""Conversations to supervised tokens: `input_ids` and `loss_mask`, built once, shared by capture and train.

The conversation is rendered with the target's own chat template. `loss_mask[t] = 1` exactly when token
t is one the target generates: assistant text, reasoning included as the template renders it, and the
end-of-turn token that closes it. Prompt, system, user and tool tokens, and the assistant header the
template adds, are 0.

How assistant spans are found: for assistant message i, the text of the conversation up to i with the
generation prompt (`P_i`) and up to and including i (`F_i`) are rendered; the span is the part of `F_i`
after `P_i`, trailing whitespace excluded. This needs the rendering of a prefix to be a prefix of the
whole rendering. Templates that drop reasoning from earlier turns (Qwen3 keeps `<think>` only after the
last user turn) break that, so the same is tried on the conversation as such a template would render
it: reasoning removed from every assistant turn before the last user turn.

Known pitfalls avoided (docs/training.md §11, item 5): the mask is never shifted here (the trainer
shifts ids and mask together), and the first assistant token and the end-of-turn token are supervised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from draftsmith.errors import DraftsmithError

# Used only for tokenizers without a chat template; printed once as a banner by callers.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class TokenizedSample:
    """input_ids and loss_mask, both of length T; `loss_mask[t] == 1` marks a generated token."""

    input_ids: list[int]
    loss_mask: list[int]

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: `reasoning_content` kept, `meta`-like keys dropped."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content"):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def drop_earlier_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as a template that keeps reasoning only after the last user turn renders it."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i < last_user:
            m = {"role": "assistant", "content": THINK_BLOCK.sub("", m["content"])}
        out.append(m)
    return out


def render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    template = None if has_chat_template(tokenizer) else FALLBACK_TEMPLATE
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=template)


def assistant_spans(tokenizer, messages: list[dict[str, Any]], full: str) -> list[tuple[int, int]] | None:
    """Character spans of assistant turns in `full`, or None when prefixes do not render as prefixes."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            return None
        end = len(upto.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return spans


def tokenize_conversation(tokenizer, messages: list[dict[str, Any]], max_length: int | None = None) -> TokenizedSample:
    """Render a conversation with the target's chat template and mark the generated tokens.

    Args:
        tokenizer: a fast (offset-capable) Hugging Face tokenizer of the target.
        messages: [{"role", "content", "reasoning_content"?}, ...].
        max_length: truncate to this many tokens (the mask is truncated with the ids).
    Returns:
        TokenizedSample with input_ids and loss_mask of equal length.
    Raises:
        DraftsmithError: the template renders prefixes inconsistently in a way not handled here.
    """
    messages = for_template(messages)
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = assistant_spans(tokenizer, messages, full)
    if spans is None:
        dropped = drop_earlier_reasoning(messages)
        if render(tokenizer, dropped, add_generation_prompt=False) == full:
            spans = assistant_spans(tokenizer, dropped, full)
    if spans is None:
        raise DraftsmithError(
            "the chat template does not render conversation prefixes as prefixes",
            got=f"template of {type(tokenizer).__name__}; {len(messages)} messages",
            expected="render(messages[:i]) to be a prefix of render(messages), or a template that only "
            "drops reasoning from turns before the last user turn",
            fix="split multi-turn conversations into one conversation per assistant turn",
        )
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    span_iter = iter(sorted(spans))
    current = next(span_iter, None)
    for t, (start, end) in enumerate(offsets):
        while current is not None and start >= current[1]:
            current = next(span_iter, None)
        # A token overlapping the span is generated by the model (boundary tokens included).
        if current is not None and end > current[0] and start < current[1]:
            mask[t] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedSample(list(ids), mask)


def prompt_ids(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation plus the assistant header, tokenized exactly as `tokenize_conversation`."""
    text = render(tokenizer, for_template(messages), add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
