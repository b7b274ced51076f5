"""A tensor-parallel group: rank, size and the three collectives the model and the engine use.

TP=1 is the plain path: `TPGroup.single()` has no process group and every collective is the identity.
TP>1 joins torch.distributed from explicit arguments (no fixed port, no env-var magic): gloo on CPU,
NCCL on CUDA when every rank has a GPU of its own. NCCL refuses two ranks on one device, so ranks that share a
GPU (more ranks than visible GPUs: the one-GPU test machine) use gloo with host staging: each collective copies
its CUDA tensor to the host, runs gloo's CPU collective and copies the result back (slow, but every TP code path
then runs on the GPU's tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    process_group: Any = None  # torch ProcessGroup, None when size == 1
    device: str = "cpu"
    # Shared-memory collectives (`shm_collectives.ShmChannel`) when every member is on this host (CPU node
    # worlds): they replace the process group's collectives; None: the process group's.
    channel: Any = field(default=None, compare=False, repr=False)
    # gloo over CUDA tensors (ranks sharing a GPU): collectives go through host copies (`tp_backend`).
    host_staging: bool = False

    @staticmethod
    def single(device: str = "cpu") -> TPGroup:
        return TPGroup(rank=0, size=1, process_group=None, device=device)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""
        if self.size > 1:
            if self.channel is not None:
                return self.channel.all_reduce(tensor)
            if self.host_staging:
                host = tensor.cpu()
                dist.all_reduce(host, group=self.process_group)
                return tensor.copy_(host)
            dist.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` (rank order)."""
        if self.size == 1:
            return tensor
        if self.channel is not None:
            return self.channel.all_gather(tensor, dim=dim)
        source = tensor.cpu() if self.host_staging else tensor.contiguous()
        parts = [torch.empty_like(source) for _ in range(self.size)]
        dist.all_gather(parts, source.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim).to(tensor.device)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Leader sends `payload`; every rank returns it. Length first, then the bytes (uint8 tensor)."""
        if self.size == 1:
            assert payload is not None, "TP=1 broadcast needs a payload"
            return payload
        if self.channel is not None:
            return self.channel.broadcast_bytes(payload)
        device = "cpu" if self.host_staging else self.device
        length = torch.zeros(1, dtype=torch.int64, device=device)
        if self.rank == 0:
            assert payload is not None, "the leader must provide the payload"
            length[0] = len(payload)
        dist.broadcast(length, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        n = int(length.item())
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(n, dtype=torch.uint8, device=device)
        dist.broadcast(data, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return payload if self.rank == 0 else bytes(data.cpu().numpy().tobytes())

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def tp_backend(device: str, world_size: int) -> str:
    """gloo on CPU; on CUDA NCCL when every rank can have a GPU of its own, else gloo (host-staged)."""
    if not device.startswith("cuda"):
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


def init_tp_group(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    device: str = "cpu",
    timeout_s: float = 60.0,
) -> TPGroup:
    """Join (or, for world_size 1, skip) a process group; gloo on CPU, NCCL on CUDA (`tp_backend`)."""
    assert 0 <= rank < world_size, f"rank {rank} outside world of {world_size}"
    if world_size == 1:
        return TPGroup.single(device)
    backend = tp_backend(device, world_size)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TPGroup(
        rank=rank,
        size=world_size,
        process_group=dist.group.WORLD,
        device=device,
        host_staging=backend == "gloo" and device.startswith("cuda"),
    )
