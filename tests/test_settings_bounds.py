"""Every numeric setting has bounds on its field: a value outside them is refused on the command line (named by its
flag) and in `run`'s YAML config (named by its key) with the value, the bound and a fix, before any work, and
nothing is written. The values are the probe's (0 as a period or divisor, negative counts, `--limit 0`, `eval
--max-new-tokens 0`) and their kin."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from badinput import refused, snapshot
from draftsmith.config import from_mapping
from draftsmith.errors import DraftsmithError
from draftsmith.run.settings import RunConfig

# verb, the arguments it needs to reach its settings (OUT: a path inside the test's folder)
NEEDS = {"train": ["--store", "OUT/store", "--out", "OUT/train"], "eval": ["--drafter", "smollm2"],
         "regenerate": ["--out", "OUT/c.jsonl"], "capture": ["--conversations", "OUT/c.jsonl", "--out", "OUT/store"],
         "bench": ["--endpoint", "http://127.0.0.1:9/v1"], "launch": []}

# verb, flag, bad value, the bound the error names
CLI_CASES = [
    ("train", "--save-every", "0", ">= 1"), ("train", "--eval-every", "0", ">= 1"),
    ("train", "--grad-accum", "0", ">= 1"), ("train", "--log-every", "0", ">= 1"),
    ("train", "--max-steps", "-1", ">= 1"), ("train", "--max-steps", "0", ">= 1"),
    ("train", "--batch-tokens", "0", ">= 1"), ("train", "--row-tokens", "0", ">= 1"),
    ("train", "--lr", "0", "> 0"), ("train", "--lr", "-0.001", "> 0"), ("train", "--epochs", "0", "> 0"),
    ("train", "--ttt-steps", "0", ">= 1"), ("train", "--clip", "0", "> 0"), ("train", "--eval-fraction", "1", "< 1"),
    ("train", "--warmup-ratio", "1.5", "<= 1"), ("train", "--min-lr-ratio", "-0.1", ">= 0"),
    ("train", "--step-loss-decay", "0", "> 0"), ("train", "--draft-vocab-size", "0", ">= 1"),
    ("train", "--seed", "-1", ">= 0"), ("train", "--follow-timeout-s", "0", "> 0"),
    ("eval", "--k", "0", ">= 1"), ("eval", "--k", "2,0", ">= 1"), ("eval", "--max-new-tokens", "0", ">= 1"),
    ("eval", "--limit", "0", ">= 1"), ("eval", "--batch-size", "0", ">= 1"), ("eval", "--temperature", "-1", ">= 0"),
    ("eval", "--topk", "0", ">= 1"),
    ("regenerate", "--limit", "0", ">= 1"), ("regenerate", "--max-new-tokens", "0", ">= 1"),
    ("regenerate", "--batch-size", "0", ">= 1"), ("regenerate", "--temperature", "-0.5", ">= 0"),
    ("regenerate", "--top-p", "0", "> 0"), ("regenerate", "--top-p", "1.5", "<= 1"),
    ("regenerate", "--concurrency", "0", ">= 1"), ("regenerate", "--self-count", "0", ">= 1"),
    ("regenerate", "--multi-turn", "2", "<= 1"), ("regenerate", "--request-timeout", "0", "> 0"),
    ("regenerate", "--max-retries", "-1", ">= 0"), ("regenerate", "--error-budget", "1.5", "<= 1"),
    ("capture", "--batch-tokens", "0", ">= 1"), ("capture", "--max-length", "0", ">= 1"),
    ("capture", "--concurrency", "0", ">= 1"), ("capture", "--tp", "0", ">= 1"),
    ("capture", "--max-store-bytes", "0", ">= 1"), ("capture", "--store-wait-timeout-s", "0", "> 0"),
    ("bench", "--num-prompts", "0", ">= 1"), ("bench", "--max-tokens", "0", ">= 1"), ("bench", "--rounds", "0", ">= 1"),
    ("bench", "--warmup", "-1", ">= 0"), ("bench", "--temperature", "-1", ">= 0"), ("bench", "--timeout", "0", "> 0"),
    ("bench", "--num-speculative-tokens", "0", ">= 1"),
    ("launch", "--timeout", "0", "> 0"), ("launch", "--stall-timeout", "-5", "> 0"),
]


@pytest.mark.parametrize("verb, flag, value, bound", CLI_CASES, ids=[f"{v}{f}={x}" for v, f, x, _ in CLI_CASES])
def test_a_value_out_of_bounds_on_the_command_line_is_refused_by_its_flag(verb, flag, value, bound, tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    before = snapshot(tmp_path)
    argv = [verb, *(a.replace("OUT", str(tmp_path)) for a in NEEDS[verb]), f"{flag}={value}"]
    err = refused(capsys, argv, tmp_path, before, f"{flag} out of range", f"got:      {value.split(',')[-1]}",
                  f"expected: {flag} ", bound)
    fix = err.split("fix:")[1]
    assert f"e.g. {flag} " in fix, err


def test_an_optional_count_says_what_null_means_instead_of_taking_0_for_it(tmp_path, capsys):
    before = snapshot(tmp_path)
    err = refused(capsys, ["eval", "--drafter", "smollm2", "--limit", "0"], tmp_path, before, "--limit >= 1, or none (all)")
    assert "--limit none" in err


# section.key, bad value, the bound the error names
RUN_CASES = [("train.grad_accum", 0, ">= 1"), ("train.save_every", 0, ">= 1"), ("train.eval_every", 0, ">= 1"),
             ("train.max_steps", -1, ">= 1"), ("train.lr", 0, "> 0"), ("eval.k", [3, 0], ">= 1"),
             ("eval.max_new_tokens", 0, ">= 1"), ("eval.limit", 0, ">= 1"), ("regenerate.limit", 0, ">= 1"),
             ("regenerate.concurrency", 0, ">= 1"), ("regenerate.temperature", -1, ">= 0"),
             ("capture.batch_tokens", 0, ">= 1"), ("launch.timeout_s", 0, "> 0"), ("launch.max_model_len", 0, ">= 1"),
             ("bench.max_tokens", 0, ">= 1"), ("bench.temperature", -0.1, ">= 0")]


@pytest.mark.parametrize("key, value, bound", RUN_CASES, ids=[k for k, _, _ in RUN_CASES])
def test_a_run_config_out_of_bounds_is_refused_before_the_first_stage(key, value, bound, tmp_path, capsys):
    section, name = key.split(".")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({section: {name: value}}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("kept\n")
    before = snapshot(tmp_path)
    refused(capsys, ["run", str(config), "--out", str(run_dir)], tmp_path, before, f"{key} out of range",
            f"expected: {key} ", bound, f"e.g. {key}=")


def test_runs_sections_keep_the_verbs_bounds_under_their_own_defaults():
    """`with_defaults` gives run's sections other defaults; the bounds stay (train.save_every is 20 in run)."""
    with pytest.raises(DraftsmithError, match="train.save_every out of range"):
        from_mapping(RunConfig, {"train": {"save_every": 0}})
    assert from_mapping(RunConfig, {"train": {"save_every": 1}}).train.save_every == 1


def test_a_dotted_override_out_of_bounds_is_refused(tmp_path, capsys):
    before = snapshot(tmp_path)
    refused(capsys, ["run", "--out", str(tmp_path / "run"), "train.grad_accum=0"], tmp_path, before,
            "train.grad_accum out of range", "train.grad_accum >= 1")
    assert not Path(tmp_path / "run").exists()
