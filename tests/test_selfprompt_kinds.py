"""Self-written prompts steered by kind of task: the --self-kinds mix, the steered waves, and the chat-kinds set."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.regenerate.selfprompt import (TASK_KINDS, Continuation, SelfPromptSettings, TurnFilter,
                                              eval_prompt_texts, parse_kinds, steer)


def test_all_mixes_every_kind_at_equal_weight_and_a_list_keeps_its_weights():
    assert parse_kinds("all") == tuple((k, 1.0) for k in TASK_KINDS)
    assert parse_kinds("writing, math:2,coding:0.5") == (("writing", 1.0), ("math", 2.0), ("coding", 0.5))


@pytest.mark.parametrize("spec, named", [
    ("writing,maths", "unknown kind 'maths'"), ("math,math:2", "'math' given twice"),
    ("math:0", "weight '0' of 'math'"), ("math:x", "weight 'x' of 'math'"), ("math:-1", "weight '-1'"),
    ("", "unknown kind ''"), ("math:inf", "weight 'inf'")])
def test_a_bad_kind_mix_is_refused_naming_the_problem(spec, named):
    with pytest.raises(DraftsmithError, match="--self-kinds") as e:
        parse_kinds(spec)
    assert named in str(e.value)


def test_the_regenerate_settings_refuse_a_bad_kind_before_any_work():
    from draftsmith.regenerate.command import RegenerateSettings

    with pytest.raises(DraftsmithError, match="unknown kind 'poetry'"):
        RegenerateSettings(prompts="self", self_kinds="writing,poetry")
    s = RegenerateSettings(prompts="self", self_kinds="math:3,general")
    assert s.self_prompts().kinds == (("math", 3.0), ("general", 1.0))


def test_steering_draws_the_mix_seeded_with_each_kinds_system_turn_and_opener():
    turns = steer((("math", 3.0), ("general", 1.0)), 400, seed=5)
    assert [(t.kind, t.opener) for t in turns] == [(t.kind, t.opener) for t in steer((("math", 3.0), ("general", 1.0)), 400, seed=5)]
    assert [t.kind for t in turns] != [t.kind for t in steer((("math", 3.0), ("general", 1.0)), 400, seed=6)]
    math = [t for t in turns if t.kind == "math"]
    # 400 draws at p = 0.75: fewer than 250 or more than 350 math turns has odds below 1e-6.
    assert 250 < len(math) < 350 and {t.kind for t in turns} == {"math", "general"}
    assert all(t.history == [{"role": "system", "content": TASK_KINDS["math"].system}] for t in math)
    assert {t.opener for t in math} == set(TASK_KINDS["math"].openers)
    assert all(t.history == [] and t.opener == "" for t in turns if t.kind == "general")


class Recorder:
    """A completer that answers each prefix with a fixed turn and records what it was asked to continue."""

    def __init__(self):
        self.prefixes: list[str] = []

    def __call__(self, prefixes, max_tokens, temperature, top_p, label):
        start = len(self.prefixes)
        self.prefixes += prefixes
        return [Continuation(" " + " ".join(f"w{start + i}x{j}" for j in range(6)) + "?", True, 9)
                for i in range(len(prefixes))]


def test_a_steered_first_turn_is_sampled_under_its_kinds_system_turn_and_keeps_its_opener(tmp_path):
    from conftest import build_tokenizer
    from draftsmith.regenerate.command import write_self_prompts
    from draftsmith.regenerate.prompts import load_prompts

    tok, complete = build_tokenizer(), Recorder()
    out = tmp_path / "prompts.jsonl"
    counts = write_self_prompts(complete, tok, out, SelfPromptSettings(count=30, kinds=(("coding", 1), ("general", 1)), seed=2),
                                eval_texts=[])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert counts.kept == len(rows) == 30 and {r["kind"] for r in rows} == {"coding", "general"}
    for prefix, row in zip(complete.prefixes, rows):
        if row["kind"] == "coding":
            opener = next(o for o in TASK_KINDS["coding"].openers if row["prompt"].startswith(o + " w"))
            assert prefix == f"<|im_start|>system\n{TASK_KINDS['coding'].system}<|im_end|>\n<|im_start|>user\n{opener}"
        else:
            assert prefix == "<|im_start|>user\n" and row["prompt"].startswith("w")
    coding = load_prompts(f"{out}:coding")
    assert {p.kind for p in coding} == {"coding"} and len(coding) == sum(r["kind"] == "coding" for r in rows)
    with pytest.raises(DraftsmithError, match="no prompts of kind 'math'") as e:
        load_prompts(f"{out}:coding,math")
    assert "coding, general" in str(e.value)


def test_a_turn_that_adds_nothing_to_its_opener_counts_as_empty(tmp_path):
    from conftest import build_tokenizer
    from draftsmith.regenerate.command import sample_first_turns

    def blank(prefixes, max_tokens, temperature, top_p, label):
        return [Continuation("  ", True, 1) for _ in prefixes]

    flt = TurnFilter(SelfPromptSettings(), [])
    kept, _, _ = sample_first_turns(blank, build_tokenizer(), SelfPromptSettings(count=6, kinds=(("stem", 1),)), flt)
    assert kept == [] and flt.counts.empty == 6


def test_regenerate_self_records_each_conversations_kind_in_its_meta(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import build_tiny_target

    from draftsmith.regenerate.command import LocalCompleter, LocalSettings, end_of_turn_stops, regenerate_self
    from draftsmith.regenerate.conversations import ConversationWriter

    tiny = build_tiny_target(tmp_path / "t", layers=2, head_scale=3.0)  # flat logits: turns that end
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny)
    ls = LocalSettings(max_new_tokens=8, batch_size=8, decoder="generate")
    sp = SelfPromptSettings(count=24, max_turn_tokens=12, min_chars=2, seed=1, multi_turn=0.5,
                            kinds=(("roleplay", 1.0), ("math", 1.0)))
    out = tmp_path / "conv.jsonl"
    with ConversationWriter(out) as w:
        summary = regenerate_self(LocalCompleter(model, tok, ls, end_of_turn_stops(tok)[0]), tok, w, sp, ls, eval_texts=[])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary.conversations == len(rows) >= 1
    for r in rows:
        kind, first = r["meta"]["kind"], r["messages"][0]["content"]
        assert kind in ("roleplay", "math") and any(first.startswith(o) for o in TASK_KINDS[kind].openers)
        assert r["messages"][0]["role"] == "user", "the steering system turn is for sampling only, not the answer"


def test_the_chat_kinds_set_covers_every_kind_and_is_apart_from_chat_eval_and_from_training_waves():
    from draftsmith.regenerate.prompts import load_prompts

    kinds = load_prompts("chat-kinds")
    texts = [p.messages[0]["content"] for p in kinds]
    assert {p.kind for p in kinds} == set(TASK_KINDS) and len({p.id for p in kinds}) == len(kinds)
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in kinds)
    assert load_prompts("chat-kinds:math") == [p for p in kinds if p.kind == "math"]
    chat_eval = [p.messages[0]["content"] for p in load_prompts("chat-eval")]
    near = TurnFilter(SelfPromptSettings(), chat_eval)
    assert [t for t in texts if near.reason(t, True) == "eval_overlap"] == []
    assert not set(texts) & set(chat_eval)
    training = TurnFilter(SelfPromptSettings(), eval_prompt_texts())  # what every training wave drops
    assert all(training.reason(t, True) == "eval_overlap" for t in texts)
