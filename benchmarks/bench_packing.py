"""Useful tokens/s of the real Trainer, packed (rows of fixed length, document masks) vs unpacked (one
conversation per row, padded to the micro-batch's longest), on conversation lengths drawn from a histogram
of real data.

Useful tokens are the conversations' own tokens (no padding); supervised tokens, the assistant tokens among
them, are reported too. Both modes run the same Trainer steps on the same drawn lengths with random
features of the drafter's shapes (the step's cost depends on shapes, not values): warm-up steps excluded
(the first also compiles with --compile), the timed steps queued as `draftsmith train`'s loop queues them (the
next step launched before this one's record is read), a step's time the loop's period. `--warm-shapes` runs one
step of each micro-batch shape first, so that the unpacked mode's recompiles fall outside the timed steps.

1. A histogram from real data (a feature store's sample lengths, or a conversations JSONL tokenized with the
   target's chat template), lengths scaled so that the longest is --scale-max:
       python benchmarks/bench_packing.py histogram --store runs/demo/store --scale-max 4096 \
           --out benchmarks/results/length_histogram_demo.json
2. The measurement (tiny drafter on CPU; Llama-3.1-8B drafter shapes with --device cuda):
       python benchmarks/bench_packing.py run --histogram benchmarks/results/length_histogram_demo.json \
           --device cuda --compile --out benchmarks/results/packing_gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftsmith.train.features import Batch, feature_dtype, pack_rows  # noqa: E402
from draftsmith.capture.store import Sample  # noqa: E402
from gpu_train import (SyntheticSource, llama8b_drafter, llama8b_target_config, pipelined_steps,  # noqa: E402
                       synced_steps, trace_steps)


# --- the histogram ------------------------------------------------------------------------------------

def lengths_of(args) -> tuple[list[int], str]:
    """Token lengths of real samples: a store's, or a conversations file's under the target's chat template."""
    if args.store:
        from draftsmith.capture.store import FeatureStore

        store = FeatureStore(Path(args.store))
        return [store.sample_length(k) for k in range(len(store))], f"feature store {args.store}"
    from draftsmith.capture.local import tokenized_conversations
    from draftsmith.target import resolve_target
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
    samples = tokenized_conversations(Path(args.conversations), tokenizer, args.max_length)
    return [len(s.input_ids) for _, s in samples], f"{args.conversations} tokenized for {args.target}"


def build_histogram(args) -> None:
    lengths, source = lengths_of(args)
    if not lengths:
        raise SystemExit(f"no samples in {source}")
    scale = args.scale_max / max(lengths) if args.scale_max else 1.0
    scaled = [max(1, round(n * scale)) for n in lengths]
    width = args.bin_width
    counts: dict[int, int] = {}
    for n in scaled:
        counts[(n - 1) // width] = counts.get((n - 1) // width, 0) + 1
    bins = [{"lo": b * width + 1, "hi": (b + 1) * width, "count": c} for b, c in sorted(counts.items())]
    out = {"what": "conversation token lengths, real data", "source": source, "date": str(datetime.date.today()),
           "num_samples": len(lengths), "max_length_raw": max(lengths), "mean_length_raw": sum(lengths) / len(lengths),
           "scale": scale, "scale_max": args.scale_max, "bin_width": width, "bins": bins}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"histogram: {len(lengths)} samples from {source}, max {max(lengths)} -> {max(scaled)}, "
          f"{len(bins)} bins -> {args.out}")


def load_histogram(path: Path, scale_max: int = 0) -> dict:
    """A histogram with `bins` (lo, hi, count), from this script's format or the `counts` format of
    scripts/conversation_stats.py (bin start -> count, `bin_tokens` wide); scale_max > 0 scales the lengths so
    that the longest bin ends there."""
    h = json.loads(Path(path).read_text())
    if "bins" not in h:
        width = h["bin_tokens"]
        h = dict(h, bins=[{"lo": int(lo) + 1, "hi": int(lo) + width, "count": c} for lo, c in
                          sorted(h["counts"].items(), key=lambda kv: int(kv[0]))])
    if scale_max:
        scale = scale_max / max(b["hi"] for b in h["bins"])
        h = dict(h, scale=h.get("scale", 1.0) * scale, bins=[
            {"lo": max(1, round(b["lo"] * scale)), "hi": max(1, round(b["hi"] * scale)), "count": b["count"]}
            for b in h["bins"]])
    return h


def draw_lengths(histogram: dict, n: int, seed: int) -> list[int]:
    """n lengths: a bin by its count, then a length uniform within it."""
    g = torch.Generator().manual_seed(seed)
    bins = histogram["bins"]
    counts = torch.tensor([b["count"] for b in bins], dtype=torch.float64)
    picks = torch.multinomial(counts, n, replacement=True, generator=g).tolist()
    return [int(torch.randint(bins[i]["lo"], bins[i]["hi"] + 1, (1,), generator=g)) for i in picks]


# --- the measurement ----------------------------------------------------------------------------------

class LengthSource:
    """Random features for samples of given lengths (FeatureSource protocol), seeded per sample so both modes
    see the same sample k. The first eighth of each sample (at least one token) is an unsupervised prompt."""

    def __init__(self, lengths: list[int], target_config, aux_ids: tuple[int, int, int], device: torch.device):
        from draftsmith.target import describe_target

        self.target_spec = describe_target(target_config.to_dict())
        self.target_name, self.aux_ids, self.lengths = "synthetic", aux_ids, lengths
        self.V, self.H = self.target_spec.vocab_size, self.target_spec.hidden_size
        self.device = device
        g = torch.Generator().manual_seed(0)
        self._head = (torch.randn(self.V, self.H, generator=g) * 0.02).to(feature_dtype(device))

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, k: int, device: torch.device) -> Sample:
        n, dtype = self.lengths[k], feature_dtype(device)
        g = torch.Generator(device=device).manual_seed(1000 + k)
        ids = torch.randint(0, self.V, (n,), device=device, generator=g)
        # The mask is made where the sample is: a copy from pageable host memory would wait for the device,
        # which stalls the queue of a loop that launches a step ahead (the store packs in pinned memory).
        return Sample(ids, self.loss_mask(k, device),
                      torch.randn(n, 3 * self.H, device=device, generator=g, dtype=dtype),
                      torch.randn(n, self.H, device=device, generator=g, dtype=dtype), ids.roll(-1))

    def loss_mask(self, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
        mask = torch.ones(self.lengths[k], dtype=torch.long, device=device)
        mask[:max(1, self.lengths[k] // 8)] = 0
        return mask

    def batch(self, indices: list[int], device: torch.device) -> Batch:
        samples = [self.sample(k, device) for k in indices]
        T = max(len(s.input_ids) for s in samples)

        def padded(name: str) -> torch.Tensor:
            rows = [getattr(s, name) for s in samples]
            return torch.stack([torch.nn.functional.pad(r, (0, 0) * (r.dim() - 1) + (0, T - len(r))) for r in rows])

        return Batch(padded("input_ids"), padded("loss_mask"), padded("aux"), padded("last"), padded("target_argmax"))

    def packed_batch(self, rows, row_tokens: int, device: torch.device) -> Batch:
        return pack_rows(rows, row_tokens, lambda k: self.sample(k, device), device, feature_dtype(device))

    # The frozen target tensors as gpu_train's synthetic source makes them (from the same attributes _head, V, H).
    target_head = SyntheticSource.target_head
    embed_tokens = SyntheticSource.embed_tokens
    token_counts = SyntheticSource.token_counts


def shapes(device: str):
    """(target config, aux ids, draft vocab): Llama-3.1-8B on CUDA, a tiny Llama on CPU."""
    from transformers import LlamaConfig

    if device == "cuda":
        return llama8b_target_config(), llama8b_drafter().aux_layer_ids, llama8b_drafter().draft_vocab_size
    return (LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192,
                        architectures=["LlamaForCausalLM"]), (2, 4, 5), 256)


def measure(args, lengths: list[int], pack: bool) -> dict:
    from draftsmith.train.settings import TrainConfig
    from draftsmith.train.trainer import Trainer

    device = torch.device(args.device)
    target, aux_ids, draft_vocab = shapes(device.type)
    trace_n = args.trace_steps if pack and device.type == "cuda" else 0
    out = Path(tempfile.mkdtemp(prefix="bench_packing_"))
    cfg = TrainConfig(out=str(out), store="<synthetic>", recipe="plain", draft_vocab_size=draft_vocab, batch_tokens=args.batch_tokens,
                      row_tokens=args.row_tokens, pack=pack, ttt_steps=args.ttt_steps, warmup_ratio=0.0,
                      max_steps=args.warmup + args.steps + trace_n, eval_fraction=0.0, compile=args.compile, device=str(device),
                      cuda_graphs=pack and args.cuda_graphs)  # one shape: packed rows only
    trainer = Trainer(cfg, data=LengthSource(lengths, target, aux_ids, device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm_shapes = shape_warmup(trainer) if args.warm_shapes else []
    records = synced_steps(trainer, args.warmup)  # the first compiles
    records += pipelined_steps(trainer, trainer.total_steps - trainer.step - trace_n)
    trace = trace_steps(trainer, trace_n) if trace_n else None
    shutil.rmtree(out, ignore_errors=True)
    timed = records[args.warmup:]
    seconds = sum(r["ms"] for r in timed) / 1000
    return {"pack": pack, "micro_batch_shapes": sorted({tuple(r["shape"]) for r in records}),
            "timing": "pipelined as draftsmith train's loop: step n+1 queued before step n is read",
            "shape_warmup": warm_shapes,
            "first_step_s": warm_shapes[0]["s"] if warm_shapes else records[0]["ms"] / 1000,
            "timed_steps": len(timed), "seconds": seconds,
            "useful_tokens_per_s": sum(r["real_tokens"] for r in timed) / seconds,
            "supervised_tokens_per_s": sum(r["supervised_tokens"] for r in timed) / seconds,
            "slot_tokens_per_s": sum(r["tokens"] for r in timed) / seconds,
            "padding_share": 1 - sum(r["real_tokens"] for r in timed) / sum(r["tokens"] for r in timed),
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
            "losses": [round(r["loss"], 5) for r in records], "trace": trace}


def shape_warmup(trainer) -> list[dict]:
    """One step of each micro-batch shape the timed steps will meet, before they run (unpacked rows take one shape
    per micro-batch length, and each new one compiles with --compile): the timed steps then measure the steady
    state a long run reaches, and each shape's first step (compile included) is reported on its own. The steps'
    updates stay in the model (the timing does not depend on its values)."""
    first: dict[tuple, int] = {}
    for step in range(trainer.total_steps):
        mb = trainer.micro_batches_for(step)[0]
        shape = ((len(mb), trainer.row_tokens) if trainer.cfg.pack else
                 (len(mb), max(trainer.data.lengths[k] for k in mb)))
        first.setdefault(shape, step)
    out = []
    for shape, step in first.items():
        trainer.step = step
        t0 = time.perf_counter()
        trainer.train_step()
        out.append({"shape": list(shape), "s": round(time.perf_counter() - t0, 2)})
    trainer.step = 0
    return out


def run(args) -> None:
    """Packed first, then unpacked; the JSON is written after each mode, so a caller that stops this process
    (a time limit: unpacked compiled steps recompile per new length) still finds the packed figure."""
    histogram = load_histogram(Path(args.histogram))
    lengths = [min(n, args.row_tokens or args.batch_tokens) for n in draw_lengths(histogram, args.samples, args.seed)]
    result = {"what": "useful (non-padding) tokens/s of Trainer.train_step, packed vs unpacked",
              "command": " ".join(sys.argv), "date": str(datetime.date.today()), "device": device_name(args.device),
              "torch": torch.__version__, "histogram": args.histogram, "histogram_source": histogram.get("source"),
              "samples": args.samples, "seed": args.seed, "mean_length": sum(lengths) / len(lengths),
              "batch_tokens": args.batch_tokens, "row_tokens": args.row_tokens or args.batch_tokens,
              "ttt_steps": args.ttt_steps, "compile": args.compile, "cuda_graphs_packed": args.cuda_graphs,
              "dense_document_mask": args.dense_document_mask,
              "warmup_steps": args.warmup,
              "packed": None, "unpacked": None, "packed_over_unpacked": None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in [m.strip() for m in args.modes.split(",") if m.strip()]:
        m = result[name] = measure(args, lengths, pack=name == "packed")
        if result["packed"] and result["unpacked"]:
            result["packed_over_unpacked"] = (result["packed"]["useful_tokens_per_s"]
                                              / result["unpacked"]["useful_tokens_per_s"])
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"{name:>8}: {m['useful_tokens_per_s']:,.0f} useful tok/s "
              f"({m['supervised_tokens_per_s']:,.0f} supervised), padding {m['padding_share']:.0%}, "
              f"shapes {m['micro_batch_shapes']}, first step {m['first_step_s']:.1f} s", flush=True)
    if result["packed_over_unpacked"] is not None:
        print(f"packed / unpacked: {result['packed_over_unpacked']:.2f}x -> {args.out}")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("histogram", help="length histogram JSON from real data")
    h.add_argument("--store", help="feature store directory")
    h.add_argument("--conversations", help="conversations JSONL (with --target)")
    h.add_argument("--target", default="smollm2")
    h.add_argument("--max-length", type=int, default=2048)
    h.add_argument("--scale-max", type=int, default=4096, help="scale lengths so that the longest is this (0: keep)")
    h.add_argument("--bin-width", type=int, default=64)
    h.add_argument("--out", required=True)
    r = sub.add_parser("run", help="packed vs unpacked useful tokens/s on lengths drawn from a histogram")
    r.add_argument("--histogram", required=True)
    r.add_argument("--device", default="cpu")
    r.add_argument("--samples", type=int, default=256)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-tokens", type=int, default=4096)
    r.add_argument("--row-tokens", type=int, default=None)
    r.add_argument("--ttt-steps", type=int, default=7)
    r.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--compile", action="store_true")
    r.add_argument("--cuda-graphs", action="store_true",
                   help="packed mode: replay the compiled step as CUDA graphs (needs --compile; unpacked never does)")
    r.add_argument("--modes", default="packed,unpacked", help="which modes, in this order (comma list)")
    r.add_argument("--trace-steps", type=int, default=0,
                   help="packed mode, CUDA: profile this many steps after the timed ones (GPU busy and idle time, "
                        "kernel time by kind)")
    r.add_argument("--warm-shapes", action="store_true",
                   help="first run one step of every micro-batch shape of the timed steps (each compiles with "
                        "--compile), so the timed steps measure the steady state; their times are reported apart")
    r.add_argument("--dense-document-mask", action="store_true",
                   help="eager CPU: packed rows attend under the dense (T x T) document mask, as before document "
                        "spans (kernels.per_document), for the A/B")
    r.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "run" and args.dense_document_mask:
        import draftsmith.model.eagle3
        from draftsmith.model.kernels import document_mask

        draftsmith.model.eagle3.document_spans = document_mask  # ttt_unroll's eager CPU mask, swapped for the A/B
    if args.cmd == "histogram":
        if bool(args.store) == bool(args.conversations):
            ap.error("histogram needs --store or --conversations")
        build_histogram(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
