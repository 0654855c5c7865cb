"""Distributed set-up under `torchrun --nproc-per-node N`: the process group (NCCL on GPU, gloo on CPU) and the
drafter as the step calls it (DDP: each rank holds the whole drafter; FSDP2 `fully_shard`: weights, gradients and
AdamW state sharded across ranks). One process (WORLD_SIZE unset) needs none of it.

    world, rank, device = join_process_group(pick_device("auto"))
    model = parallel_model(drafter, device, world, fsdp=False)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    """Processes of this run: torchrun's WORLD_SIZE, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join_process_group(device: torch.device) -> tuple[int, int, torch.device]:
    """(world size, rank, device) of this process; under torchrun the process group joined (once) and, on CUDA,
    the device of its LOCAL_RANK."""
    world = world_size()
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world, rank, device


def parallel_model(drafter: torch.nn.Module, device: torch.device, world: int, fsdp: bool) -> torch.nn.Module:
    """The module the step calls: the drafter itself (one process, or FSDP2, which shards its parameters in place,
    so that the optimizer then holds only this rank's shard), or the drafter wrapped in DDP."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(drafter)
        return drafter
    if world > 1:
        return torch.nn.parallel.DistributedDataParallel(
            drafter, device_ids=[device.index] if device.type == "cuda" else None)
    return drafter
