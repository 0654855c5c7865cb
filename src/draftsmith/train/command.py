"""`draftsmith train`: the verb (its flags are TrainConfig's fields); `trainer.Trainer` does the work.

Run: draftsmith train --store runs/demo/store --out runs/demo/train --epochs 2
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.config import add_flags, example_help, from_flags
from draftsmith.train.distributed import world_size
from draftsmith.train.resume import check_out
from draftsmith.train.settings import TrainConfig
from draftsmith.train.trainer import Trainer


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter: EAGLE-3 with training-time test, or DFlash (--family dflash)",
                       **example_help(
                           "examples:\n"
                           "  draftsmith train --store runs/demo/store --out runs/demo/train --epochs 2 --lr 5e-4\n"
                           "  draftsmith train --conversations conv.jsonl --target smollm2 --out runs/online   # online\n"
                           "  torchrun --nproc-per-node 2 -m draftsmith train --store STORE --out OUT          # DDP\n"
                           "  torchrun --nproc-per-node 8 -m draftsmith train --store STORE --out OUT --parallel fsdp\n"
                           "  draftsmith train --family dflash --mask-token-id 16 --conversations conv.jsonl --out runs/dflash\n"
                           "  draftsmith train --family dflash --mask-token-id 16 --block-size 8 --drafter-layers 2 --store STORE --out OUT\n"
                           "  draftsmith train --store STORE --follow --max-steps 20000 --out OUT  # while capture writes STORE\n"
                           "  draftsmith train --store STORE --follow --delete-consumed --max-steps 20000 --out OUT  # bounded disk\n"
                           "A killed run resumes from its last checkpoint when the same command is run again\n"
                           "(a longer --max-steps or --epochs continues it; other settings are refused:\n"
                           "--overwrite starts over)."))
    add_flags(p, TrainConfig, required=("out",),
              helps={"aux_ids": "online only: boundary aux ids, e.g. 2,15,27 (default 2,N//2,N-3 from 7 layers; below, the nearest distinct triple)"})
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    cfg = from_flags(TrainConfig, args)
    check_out(cfg, world_size())  # before the data and the target are loaded
    with Trainer(cfg) as trainer:
        result = trainer.run(progress=not args.quiet)
        if trainer.rank == 0:
            k_shown = cfg.block_size - 1 if cfg.family == "dflash" else 4
            print(f"train: drafter -> {Path(args.out) / 'drafter'} | {held_back_line(result, k_shown)}")
    return 0


def held_back_line(result, k_shown: int = 4) -> str:
    """The held-back figures of the end line: simulated tau at k_shown (4; DFlash: block size - 1), or at
    the deepest k the drafter was trained for when --ttt-steps is below 4 (a chain past it has no teacher-forced steps
    to simulate)."""
    if not result.tau:
        return "no held-back samples: simulated tau not measured"
    k = min(k_shown, max(result.tau))
    return f"simulated tau at k={k}: {result.tau[k]:.2f} | acc {' '.join(f'{a:.2f}' for a in result.acc)}"
