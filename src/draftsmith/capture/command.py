"""`draftsmith capture`: the verb, which dispatches to the in-process capture (`local`) or through vLLM (`vllm`)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.capture.local import CAPTURE_DTYPES, CAPTURE_ENGINES, CaptureSettings, capture, parse_ids, print_summary
from draftsmith.config import add_flags, check_choices, example_help, from_flags
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import check_apart, check_output

CAPTURE_FLAGS = {"tensor_parallel": "--tp"}


def add_parser(sub) -> None:
    p = sub.add_parser("capture", help="capture target hidden states into a feature store",
                       **example_help(
                           "examples:\n"
                           "  draftsmith capture --conversations runs/demo/conversations.jsonl --out runs/demo/store\n"
                           "  draftsmith capture --target ./Llama-3.1-8B --conversations conv.jsonl --out store --aux-ids 2,16,29\n"
                           "  draftsmith capture --engine vllm --target ./Llama-3.1-8B --conversations conv.jsonl --out store --tp 2\n"
                           "  draftsmith capture --print-server-args --target ./Kimi-K2.5 --hs-dir /dev/shm/hs --tp 8\n"
                           "A killed capture resumes when the same command is run again."))
    p.add_argument("--target", default="smollm2")
    p.add_argument("--conversations", type=Path, help="JSONL written by `draftsmith regenerate` (required to capture)")
    p.add_argument("--out", type=Path, help="feature store directory (required to capture)")
    p.add_argument("--aux-ids", default=None, help="boundary indices (default: 2,N//2,N-3 from 7 layers; below, the nearest distinct triple)")
    p.add_argument("--shard-tokens", type=int, default=1 << 16, help="tokens per shard file")
    add_flags(p, CaptureSettings, flags=CAPTURE_FLAGS)
    p.add_argument("--verify", action="store_true", help="only verify an existing store's shards (sha256 and "
                   "degenerate states)")
    p.add_argument("--print-server-args", action="store_true", help="print the `vllm serve` command for --endpoint")
    p.set_defaults(func=run_capture)


def capture_settings(args) -> CaptureSettings:
    """The verb's settings from its flags, its --engine and --dtype among the verb's choices."""
    s = from_flags(CaptureSettings, args)
    check_choices(("--engine", s.engine, CAPTURE_ENGINES), ("--dtype", s.dtype, CAPTURE_DTYPES))
    return s


def run_capture(args) -> int:
    s = capture_settings(args)
    if args.verify and args.out is None:
        raise DraftsmithError("--verify needs --out", got="no --out", expected="the store to verify", fix="pass --out DIR")
    if args.verify:
        from draftsmith.capture.sanity import check_store
        from draftsmith.capture.store import FeatureStore

        store = FeatureStore(args.out)
        n, samples = store.verify(), check_store(store)
        print(f"capture: {n} shards verified, {samples} samples sane in {args.out}")
        return 0
    if args.out is None and not args.print_server_args:
        raise DraftsmithError("capture needs --out", got="no --out", expected="a feature store directory",
                              fix="pass --out DIR")
    if args.shard_tokens < 1:
        raise DraftsmithError("--shard-tokens out of range", got=str(args.shard_tokens), expected="--shard-tokens >= 1",
                              fix="e.g. --shard-tokens 65536 (the default)")
    if args.out is not None:
        # a store resumes where its manifest says; any other folder of the user's is refused before the target loads
        check_output(args.out, "capture", owns=lambda folder: (folder / "manifest.json").is_file(),
                     overwrite_flag=False)
        check_apart(args.out, "capture", "--out", {"--conversations": args.conversations})
    if s.engine == "vllm" or args.print_server_args:
        from draftsmith.capture.vllm import run_engine_capture

        return run_engine_capture(s, args)
    summary = capture(args.conversations, args.out, s, target=args.target, aux_ids=parse_ids(args.aux_ids),
                      shard_tokens=args.shard_tokens)
    print_summary(summary, args.out)
    return 0
