"""Process-group setup: one data-plane group (NCCL on distinct GPUs, else gloo) and one gloo group
for the small control messages that decide every step."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Groups:
    """``data``: token traffic; ``cpu``: control plane (gloo, CPU tensors).

    ``comm_device`` is where data-plane tensors must live: the GPU under NCCL, the CPU under gloo
    (several ranks sharing one GPU fall back to gloo, staging through host memory).
    """

    data: dist.ProcessGroup
    cpu: dist.ProcessGroup
    comm_device: torch.device


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_groups(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    local_world_size: int,
    timeout: timedelta,
) -> Groups:
    """Joins the job. NCCL only when every rank of a node has a GPU of its own."""
    use_nccl = device.type == "cuda" and local_world_size <= torch.cuda.device_count()
    backend = "nccl" if use_nccl else "gloo"
    kwargs = {"device_id": device} if use_nccl else {}
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,
    )
    data = dist.group.WORLD
    cpu = dist.new_group(backend="gloo", timeout=timeout) if use_nccl else data
    return Groups(data=data, cpu=cpu, comm_device=device if use_nccl else torch.device("cpu"))


def shutdown_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
