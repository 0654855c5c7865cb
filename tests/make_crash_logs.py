"""Regenerate the real vllm-cpu start-up logs kept in tests/fixtures/logs/ (one healthy, the rest crashes).

Each scenario starts vLLM's OpenAI server (the `vllm-cpu` virtualenv, see docs/engines.md §8.2)
with SmolLM2-135M as target and a tiny EAGLE-3 drafter built here, breaks one thing, and keeps the
whole combined stdout/stderr as `vllm_cpu_<name>.log`. One server runs at a time.

    .venv/bin/python tests/make_crash_logs.py            # all scenarios, about 6 minutes
    .venv/bin/python tests/make_crash_logs.py bad_fc     # just one

The expected root cause of each log lives beside it in `<log>.expected.json`; those are written by
hand from reading the log, so after regenerating, re-check them (`pytest tests/test_diagnose.py` fails on
any drift).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.engines.process import VLLM_CPU_ENV, VllmServe, engine_python, free_port, stop_tree
from draftsmith.target import resolve_target

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "logs"
START_TIMEOUT_S = 300

# The 1-layer EAGLE-3 drafter for SmolLM2 (hidden 576, 9 heads / 3 KV heads, vocab 49152) in the
# LlamaForCausalLMEagle3 layout that vLLM's llama_eagle3.py loads (docs/engines.md §1.5).
DRAFTER_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 576,
    "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "intermediate_size": 1536, "vocab_size": 49152, "draft_vocab_size": 8192, "target_hidden_size": 576,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True},
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def drafter_tensors(hidden: int = 576, inter: int = 1536, vocab: int = 49152, draft_vocab: int = 8192,
                    kv_dim: int = 192) -> dict[str, torch.Tensor]:
    """Random weights with the exact keys and shapes of an exported drafter."""
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    d2t = torch.zeros(draft_vocab, dtype=torch.int64)  # draft id i -> target id i (offsets are 0)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    return {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": w(hidden, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, hidden),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(draft_vocab, hidden),
        "d2t": d2t,
        "t2d": t2d,
    }


def write_drafter(path: Path, config: dict | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a drafter directory (config.json + model.safetensors); defaults give a loadable one."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config if config is not None else DRAFTER_CONFIG, indent=2))
    save_file(tensors if tensors is not None else drafter_tensors(), str(path / "model.safetensors"))
    return path


def write_gpt2_target(path: Path, tokenizer_from: Path) -> Path:
    """A tiny random GPT-2 (not a SupportsEagle3 model in vLLM) with SmolLM2's tokenizer and head_dim 64."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=576, n_layer=6, n_head=9, n_positions=2048, vocab_size=49152,
                     bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, path / name)
    return path


@dataclass(frozen=True)
class Scenario:
    """One start-up: how to build its inputs in `work` and the server spec to start."""

    name: str
    build: Callable[[Path, Path], VllmServe]  # (work dir, target dir) -> spec
    env: dict[str, str] = field(default_factory=dict)
    hold_port: bool = False  # bind the port first, so the server finds it taken


def good(work: Path, target: Path) -> VllmServe:
    return VllmServe(target=target, drafter=write_drafter(work / "drafter"), max_model_len=1024)


def bad_fc(work: Path, target: Path) -> VllmServe:
    tensors = drafter_tensors()
    tensors["fc.weight"] = tensors["fc.weight"][:, : 2 * 576].contiguous()  # 2 aux layers' worth
    return VllmServe(target=target, drafter=write_drafter(work / "drafter", tensors=tensors), max_model_len=1024)


def missing_config_field(work: Path, target: Path) -> VllmServe:
    config = {k: v for k, v in DRAFTER_CONFIG.items() if k != "model_type"}
    return VllmServe(target=target, drafter=write_drafter(work / "drafter", config=config), max_model_len=1024)


def missing_model(work: Path, target: Path) -> VllmServe:
    return VllmServe(target=work / "no-such-model", max_model_len=1024)


def missing_drafter(work: Path, target: Path) -> VllmServe:
    return VllmServe(target=target, drafter=work / "no-such-drafter", max_model_len=1024)


def port_taken(work: Path, target: Path) -> VllmServe:
    return VllmServe(target=target, max_model_len=1024)


def max_model_len_over_limit(work: Path, target: Path) -> VllmServe:
    return VllmServe(target=target, max_model_len=1_000_000)


def kv_cache_too_small(work: Path, target: Path) -> VllmServe:
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN lets the config pass; the 1 GiB KV cache then cannot hold one request.
    return VllmServe(target=target, max_model_len=1_000_000)


def no_eagle3_target(work: Path, target: Path) -> VllmServe:
    gpt2 = write_gpt2_target(work / "gpt2", tokenizer_from=target)
    config = {**DRAFTER_CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                                 "use_aux_hidden_state": True}}
    return VllmServe(target=gpt2, drafter=write_drafter(work / "drafter", config=config), max_model_len=1024)


SCENARIOS = {s.name: s for s in [
    Scenario("ready", good),
    Scenario("bad_fc", bad_fc, env={"VLLM_LOGGING_COLOR": "1"}),  # keep vLLM's ANSI prefixes in one log
    Scenario("missing_config_field", missing_config_field),
    Scenario("missing_model", missing_model),
    Scenario("missing_drafter", missing_drafter),
    Scenario("port_taken", port_taken, hold_port=True),
    Scenario("max_model_len", max_model_len_over_limit),
    Scenario("kv_cache_too_small", kv_cache_too_small, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}),
    Scenario("no_eagle3_target", no_eagle3_target),
]}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def run_scenario(scenario: Scenario, python: Path, target: Path) -> str:
    """Start the server for one scenario; return how it ended ('ready', 'exit N' or 'timeout')."""
    with tempfile.TemporaryDirectory(prefix=f"draftsmith-{scenario.name}-") as tmp:
        work = Path(tmp)
        spec = scenario.build(work, target)
        holder = None
        port = free_port()
        if scenario.hold_port:
            holder = socket.socket()
            holder.bind(("127.0.0.1", port))
            holder.listen()
        spec = VllmServe(**{**spec.__dict__, "port": port})
        log = FIXTURES / f"vllm_cpu_{scenario.name}.log"
        env = {**os.environ, **VLLM_CPU_ENV, "HF_HUB_OFFLINE": "1", **scenario.env}
        with open(log, "w") as out:
            proc = subprocess.Popen(spec.command(python), stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=work, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        outcome = "timeout"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                outcome = f"exit {proc.returncode}"
                break
            if healthy(port):
                outcome = "ready"
                break
            time.sleep(0.5)
        stop_tree(proc)
        if holder:
            holder.close()
        return outcome


def main(names: list[str]) -> int:
    python = engine_python("vllm")
    target = resolve_target("smollm2")
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names or list(SCENARIOS):
        t0 = time.monotonic()
        outcome = run_scenario(SCENARIOS[name], python, target)
        print(f"{name:22s} {outcome:10s} {time.monotonic() - t0:5.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
