"""What `kernels.one_product_per_sum` does to the compiled training step's backward graph, counted on the CPU.

Compiles `ttt_unroll` (bf16 autocast, as the Trainer runs on GPUs) for a small drafter with the weight-gradient pass
on, and counts in each post-grad graph the matrix products (`mm`, `addmm`) before and after the pass, and the
products it merged away. No timing: what the pass saves in time needs a GPU (docs/gpu.md, session 34's paragraph
on the pass).

    python benchmarks/weight_gradient_graph.py --steps 7 --out benchmarks/results/weight_gradient_graph_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftsmith.model import kernels# noqa: E402
from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter, compile_for_training, ttt_forward  # noqa: E402
from draftsmith.model.vocab import build_draft_vocab  # noqa: E402


def products(graph: torch.fx.Graph) -> int:
    targets = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in targets)


def compiled_step_inputs(cfg: DrafterConfig, tokens: int) -> tuple[Eagle3Drafter, tuple]:
    """A seeded drafter of `cfg` compiled by `compile_for_training` (the FX graph cache off: a hit would skip the
    pass), and one row of `tokens` random inputs for `ttt_forward` (aux, ids, loss mask, last hidden, target head)."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    vocab = build_draft_vocab(torch.arange(cfg.vocab_size, 0, -1), cfg.draft_vocab_size)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    torch._inductor.config.fx_graph_cache = False
    compile_for_training(drafter)
    T, Ht = tokens, cfg.target_hidden_size
    batch = (torch.randn(1, T, 3 * Ht), torch.randint(0, cfg.vocab_size, (1, T)), torch.ones(1, T, dtype=torch.long),
             torch.randn(1, T, Ht), torch.randn(cfg.vocab_size, Ht))
    return drafter, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7, help="TTT steps")
    ap.add_argument("--tokens", type=int, default=64, help="sequence length (one row)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=224)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    graphs = []
    original = kernels.one_product_per_sum

    def counted(graph, max_rows=None):
        before = products(graph)
        merged = original(graph, max_rows)
        graphs.append({"products_before": before, "products_after": products(graph), "merged": merged})
        return merged

    kernels.one_product_per_sum = counted  # the pass calls it through the module
    kernels.WEIGHT_GRADIENT_PASS = True
    cfg = DrafterConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_heads=4, num_kv_heads=2,
                        head_dim=args.hidden // 4, vocab_size=96, draft_vocab_size=48, target_hidden_size=40,
                        target_num_layers=8, aux_layer_ids=(2, 4, 5))
    drafter, batch = compiled_step_inputs(cfg, args.tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ttt_forward(drafter, *batch, steps=args.steps)
    out.loss.backward()
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "date": str(datetime.date.today()),
              "torch": torch.__version__, "steps": args.steps, "tokens": args.tokens, "hidden": args.hidden,
              "intermediate": args.intermediate, "graphs": graphs}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
