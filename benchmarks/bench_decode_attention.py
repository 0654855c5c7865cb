"""The rows decoder's decode throughput on a GPU, by decode-attention path and by row count: `triton` (each row
read only to its own length, cache_attention.py), `matmul` (explicit fp32 scores over the longest row's bucket)
and `sdpa` (one fused kernel per layer over that bucket). A randomly initialised SmolLM2-135M-shaped Llama in bf16
(throughput depends on the shapes only; random weights never emit the stop id, so every row decodes all
`--new` tokens, the same work for every run), prompts of 64-400 tokens. The first run pays the one-time CUDA
start-up (`--warmup` runs a small one first and drops it).

    python3 benchmarks/bench_decode_attention.py                       # triton vs matmul at 1,024 rows
    python3 benchmarks/bench_decode_attention.py --attention triton,matmul --rows 1024,2048,4096 --prompts 12288 \
        --out $OUT/decode_rows.json                                   # by row count

Writes benchmarks/results/decode_attention.json (or --out); one JSON line per run on stdout as it goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from draftsmith.regenerate.generation import BUCKET, RowDecodeSettings, decode_all  # noqa: E402

OUT = Path(__file__).parent / "results" / "decode_attention.json"


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", default="triton,matmul,triton,matmul", help="runs, in order (comma list)")
    ap.add_argument("--rows", default="1024", help="row counts (comma list); each attention runs at each")
    ap.add_argument("--prompts", type=int, default=3072)
    ap.add_argument("--new", type=int, default=256, help="tokens decoded per prompt")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--sync-every", type=int, default=RowDecodeSettings.sync_every)
    ap.add_argument("--warmup", action="store_true", help="a small run first, not recorded")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="instead of timed runs: the top CUDA kernels of 16 eager decode steps at ROWS full rows, "
                         "for the first --attention path")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist()
               for n in torch.randint(64, 400, (args.prompts,), generator=g)]
    if args.profile:
        profile(model, prompts, args)
        return
    if args.warmup:
        decode_all(model, prompts[:256], RowDecodeSettings(max_new_tokens=16, rows=256, max_length=args.max_length), [0])
    runs = []
    for rows in (int(r) for r in args.rows.split(",")):
        for attention in args.attention.split(","):
            settings = RowDecodeSettings(max_new_tokens=args.new, rows=rows, max_length=args.max_length,
                                      attention=attention, sync_every=args.sync_every)
            torch.manual_seed(0)
            torch.cuda.reset_peak_memory_stats()
            _, stats = decode_all(model, prompts, settings, [0])
            runs.append({"attention": attention, "rows": rows, "sync_every": args.sync_every, "prompts": len(prompts),
                         "generated": stats.generated_tokens, "seconds": round(stats.seconds, 3),
                         "tokens_per_s": round(stats.tokens_per_s), "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)})
            print(json.dumps(runs[-1]), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)  # written after every run: a killed call keeps its runs
            args.out.write_text(json.dumps({"what": __doc__.split("\n")[0], "device": torch.cuda.get_device_name(),
                                            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                            "command": "python3 benchmarks/bench_decode_attention.py " + " ".join(sys.argv[1:]),
                                            "runs": runs}, indent=1) + "\n")


def profile(model, prompts, args) -> None:
    """Kernel time of the decode step itself (eager: the graphs replay the same kernels), rows all active."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from draftsmith.regenerate.generation import RowDecoder

    rows = args.profile
    dec = RowDecoder(model, RowDecodeSettings(max_new_tokens=args.new, rows=rows, max_length=args.max_length,
                                           cuda_graphs=False, attention=args.attention.split(",")[0]), [0])
    with torch.inference_mode():
        for start in range(0, rows, 256):
            dec.prefill(list(range(start, min(rows, start + 256))), prompts[start:start + 256])
        longest = int(dec.pos.max())
        length = -(-(longest + 17) // BUCKET) * BUCKET  # the bucket RowDecoder.run reads for the next 16 steps
        for _ in range(4):
            dec.step(length)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(16):
                dec.step(length)
            torch.cuda.synchronize()
    print(f"rows {rows}, {dec.attention}, KV length {length}: top kernels of 16 steps", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90), flush=True)


if __name__ == "__main__":
    main()
