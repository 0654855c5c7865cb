"""Peak memory of one TTT-7 training step at sequence 2048 with SmolLM2 shapes on CPU:
draftsmith's TTT attention (one causal SDPA call with a summary key) against the naive formulation
(every step's keys in one dense T x T*(i+1) masked score matrix). Each variant runs in its own process;
peak = the process's maximum resident set size after the step minus before it.

Run: .venv/bin/python benchmarks/bench_ttt_memory.py    -> benchmarks/results/ttt_memory.json
"""

from __future__ import annotations

import datetime
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import math, resource, sys, time, torch
import draftsmith.model.eagle3 as D
variant, T = sys.argv[1], int(sys.argv[2])
def dense(q, k0, v0, dk, dv):
    B, nh, T, hd = q.shape
    g = nh // k0.shape[1]
    keys = torch.cat([k0] + dk, 2).repeat_interleave(g, 1)
    values = torch.cat([v0] + dv, 2).repeat_interleave(g, 1)
    mask = torch.zeros(T, T * (1 + len(dk)), dtype=torch.bool)
    mask[:, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    for j in range(len(dk)):
        mask[:, T * (j + 1): T * (j + 2)] = torch.eye(T, dtype=torch.bool)
    s = (q @ keys.transpose(-1, -2)) / math.sqrt(hd)
    return torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ values
if variant == "dense":
    D.ttt_attention = dense
cfg = D.DrafterConfig(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                      draft_vocab_size=8192, target_hidden_size=576, target_num_layers=30, aux_layer_ids=(2, 15, 27))
torch.manual_seed(0)
d = D.Eagle3Drafter(cfg)
d.d2t.zero_(); d.t2d[:8192] = True
aux, last = torch.randn(1, T, 1728), torch.randn(1, T, 576)
ids, mask, head = torch.randint(0, 8192, (1, T)), torch.ones(1, T, dtype=torch.long), torch.randn(49152, 576) * 0.02
argmax = torch.randint(0, 8192, (1, T))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
out = D.ttt_forward(d, aux, ids, mask, last, head, steps=7, t_argmax=argmax)
out.loss.backward()
dt = time.perf_counter() - t
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{(after - before) / 1024:.1f} {dt:.2f}")
'''


def main() -> None:
    T = 2048
    result = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "seq": T, "ttt": 7,
              "shapes": "SmolLM2-135M drafter: hidden 576, 9/3 heads, draft vocab 8192", "device": "cpu"}
    for variant in ("draftsmith", "dense"):
        out = subprocess.run([sys.executable, "-c", CHILD, variant, str(T)], capture_output=True, text=True)
        if out.returncode != 0:
            result[variant] = {"error": out.stderr[-500:]}
            continue
        mb, seconds = out.stdout.split()
        result[variant] = {"peak_step_mb": float(mb), "step_s": float(seconds)}
        print(variant, mb, "MB", seconds, "s", flush=True)
    path = Path("benchmarks/results/ttt_memory.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
