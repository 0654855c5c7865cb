"""Conversations JSONL: exactly once, torn lines, and prompt sources."""

from __future__ import annotations

import json

import pytest

from draftsmith.regenerate.conversations import Conversation, ConversationWriter, finished_ids, read_conversations
from draftsmith.errors import DraftsmithError
from draftsmith.regenerate.prompts import load_prompts


def test_writer_skips_done_ids_and_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "c.jsonl"
    with ConversationWriter(path) as w:
        assert w.write(Conversation("a", [{"role": "user", "content": "x"}]))
        assert not w.write(Conversation("a", [{"role": "user", "content": "y"}]))
    with open(path, "a") as f:
        f.write('{"id": "b", "messages": [{"role": "us')  # a crash mid-line
    assert finished_ids(path) == {"a"}
    with ConversationWriter(path) as w:
        assert w.dropped_bytes > 0
        assert w.write(Conversation("b", [{"role": "user", "content": "z"}]))
    assert [c.id for c in read_conversations(path)] == ["a", "b"]


def test_malformed_line_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\nnot json\n')
    with pytest.raises(DraftsmithError, match="line 2"):
        list(read_conversations(path))


def test_builtin_train_and_eval_prompts_never_overlap():
    train, evals = load_prompts("train"), load_prompts("eval")
    assert len(evals) == 164 and len(train) > 500
    text = lambda ps: {m["content"] for p in ps for m in p.messages}
    assert not text(train) & text(evals)
    assert len({p.id for p in train}) == len(train)


def test_prompt_sources(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "one"}, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "two"},
                                              {"role": "assistant", "content": "dropped"}]},
            {"conversations": [{"from": "human", "value": "three"}, {"from": "gpt", "value": "dropped"}]},
            {"id": "mt", "turns": ["four", "five"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(str(path))
    assert [p.messages[-1]["content"] for p in prompts] == ["one", "two", "three", "five"]
    assert prompts[3].id == "mt" and prompts[3].num_user_turns == 2
    assert all(m["role"] != "assistant" for p in prompts for m in p.messages)
