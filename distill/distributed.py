"""Process-group plumbing for `torchrun`: one process per device (or per CPU slice) with DDP.

`torchrun --nproc_per_node N` sets RANK, WORLD_SIZE and LOCAL_RANK; without them everything runs in
one process and these helpers are no-ops. CPU processes talk over gloo, GPUs over NCCL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from edgefinfer.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' -> the local GPU when CUDA is present, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if name != "cpu":
        raise UserError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device("cpu")


def init(device_name: str = "auto") -> tuple[DistInfo, torch.device]:
    """Join the torchrun process group if there is one; returns who we are and our device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    info = DistInfo(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    device = pick_device(device_name, info.local_rank)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return info, device


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def mean_over_ranks(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Average a tensor over processes (for logging: every rank gets the same numbers)."""
    if not info.distributed:
        return values
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values / info.world


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True on every rank if it is true on any (so all ranks stop at the same step)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()
