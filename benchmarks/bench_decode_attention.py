"""The rows decoder's two decode-attention paths side by side on a GPU: `matmul` (explicit fp32 scores) and `sdpa`
(one fused kernel per layer). A randomly initialised SmolLM2-135M-shaped Llama in bf16 (throughput depends on the
shapes only; random weights never emit the stop id, so every row decodes all 256 tokens, the same work for both),
1,024 rows, 3,072 prompts of 64-400 tokens, alternating runs (the first run pays the one-time CUDA start-up).

    python3 benchmarks/bench_decode_attention.py   # on the GPU machine; writes results/decode_attention.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from draftsmith.generation import DecodeSettings, decode_all  # noqa: E402

OUT = Path(__file__).parent / "results" / "decode_attention.json"


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in torch.randint(64, 400, (3072,), generator=g)]
    runs = []
    for attention in ("matmul", "sdpa", "matmul", "sdpa"):
        settings = DecodeSettings(max_new_tokens=256, rows=1024, max_length=1024, attention=attention)
        torch.manual_seed(0)
        _, stats = decode_all(model, prompts, settings, [0])
        runs.append({"attention": attention, "rows": 1024, "prompts": len(prompts), "generated": stats.generated_tokens,
                     "seconds": stats.seconds, "tokens_per_s": stats.tokens_per_s})
        print(runs[-1], flush=True)
    OUT.write_text(json.dumps({"what": __doc__.split("\n")[0], "device": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
