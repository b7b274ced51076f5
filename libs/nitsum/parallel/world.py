"""A node's process world: all D workers join one process group at boot, and every aligned group at every
allowed TP level is created once, right then (8 devices, levels 1..8: 8 + 4 + 2 + 1 = 15 groups).

A TP change *selects* one of these groups; nothing here creates or destroys a process group after boot.
`torch.distributed.new_group` must be called by every rank in the same order, so the order is fixed:
levels ascending, then starts ascending.

Generations: a process world cannot take a member back, so a node whose world lost a member is *re-formed*:
the same devices (survivors, which still hold the broken world, and restarted workers, which hold none)
build a new world, generation g > 0, at run time. torch.distributed's default process group is
process-global, so the old one (and every group built on it) is destroyed first. Each generation meets at
its own rendezvous port, `master_port + g % PORT_SPAN` (a small range above NITSUM_NODE_MASTER_PORT), so a
restarted device 0 can host it and the old generation's store socket is not in the way; the KV segment
names carry that port (`master_port` below), so they differ between consecutive generations too. A TP=1 "group" is the plain path (`TPGroup.single`, no process
group, collectives are the identity), as everywhere else in the engine.

Shared-memory collectives (`attach_channels`, after the members said which host they are on): every
pre-built group whose members share a host's /dev/shm gets a `shm_collectives.ShmChannel`, and its
collectives (the model's all-reduces, the step plan's broadcast, a transition's exchanges) go through it
instead of gloo's loopback sockets (~100x less latency; gloo keeps the point-to-point KV moves and the
world's barrier). GPUs keep NCCL, or, when ranks share a GPU (more workers than GPUs: NCCL refuses two ranks
on one device), gloo with host staging (`group.tp_backend`; collectives and KV sends copy through the host).

The world also carries the few node-level collectives a transition needs (an all-gather of msgpack
bytes, point-to-point KV moves); gloo on CPU, NCCL on CUDA. Ranks are device indices.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nitsum.config import NODE_PORT_SPAN
from nitsum.parallel import shm_collectives
from nitsum.parallel.group import TPGroup, tp_backend

log = logging.getLogger("nitsum.parallel.world")

# Generations rendezvous at master_port + generation % PORT_SPAN (ports master_port .. master_port + 15).
PORT_SPAN = NODE_PORT_SPAN


def rendezvous_port(master_port: int, generation: int) -> int:
    """Where generation `generation` of the node world whose base port is `master_port` meets."""
    assert generation >= 0, f"generation {generation} < 0"
    port = master_port + generation % PORT_SPAN
    if port > 65535:
        raise ValueError(
            f"node world generation {generation} would rendezvous at port {port} (> 65535): "
            f"NITSUM_NODE_MASTER_PORT must be at most {65535 - PORT_SPAN + 1}"
        )
    return port


def leave_process_world() -> None:
    """Destroy this process's default process group and every group built on it (a no-op without one).
    A new generation's `init_process_group` needs this first: the default group is process-global."""
    if dist.is_initialized():
        dist.destroy_process_group()
    # Groups are named from a process-global counter, which torch resets only when it destroys a default group;
    # a rendezvous that failed inside init_process_group advanced it all the same. Members that disagree on it
    # wait for each other's keys until the timeout: every generation starts from 0, as a fresh process does.
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def allowed_levels(min_tp: int, max_tp: int) -> tuple[int, ...]:
    """Powers of two from min_tp to max_tp."""
    assert min_tp >= 1 and max_tp >= min_tp, f"bad TP range [{min_tp}, {max_tp}]"
    assert min_tp & (min_tp - 1) == 0 and max_tp & (max_tp - 1) == 0, "TP levels are powers of two"
    levels = []
    tp = min_tp
    while tp <= max_tp:
        levels.append(tp)
        tp *= 2
    return tuple(levels)


class NodeWorld:
    def __init__(
        self,
        rank: int,
        size: int,
        master_addr: str,
        master_port: int,
        device: str = "cpu",
        min_tp: int = 1,
        max_tp: int | None = None,
        timeout_s: float = 60.0,
        generation: int = 0,
    ) -> None:
        assert 0 <= rank < size, f"rank {rank} outside a node of {size}"
        self.rank = rank
        self.size = size
        self.generation = generation
        self.base_port = master_port
        # This generation's rendezvous port; it also names this world's shared-memory KV segments.
        self.master_port = rendezvous_port(master_port, generation)
        self.levels = allowed_levels(min_tp, max_tp or size)
        assert self.levels[-1] <= size, f"max_tp {self.levels[-1]} exceeds the node's {size} workers"
        self.backend = tp_backend(device, size)
        if device.startswith("cuda"):
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = f"cuda:{torch.cuda.current_device()}"
        self.device = device
        self.host_staging = self.backend == "gloo" and device.startswith("cuda")
        if generation > 0:
            leave_process_world()  # the previous generation (broken by a lost member) goes first
        # (start, tp) -> process group (only for groups this rank belongs to; None at TP=1).
        self._groups: dict[tuple[int, int], Any] = {}
        self._channels: dict[tuple[int, int], shm_collectives.ShmChannel] = {}  # see `attach_channels`
        self.timeout_s = timeout_s
        self.num_groups = 0
        self._store = None
        try:
            self._store = dist.TCPStore(
                master_addr, self.master_port, size, is_master=(rank == 0), timeout=timedelta(seconds=timeout_s)
            )
            dist.init_process_group(
                backend=self.backend,
                store=self._store,
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=timeout_s),
            )
            # A transition's span (the smallest aligned group covering the workers that change,
            # kv.reshard.transition_span) may be wider than max_tp -- two TP2 groups of a max_tp=2 node
            # that both change span four workers -- and the boot exchange spans the whole world: those
            # exchanges need a communicator too, pre-built here as well (never a TP level; not counted).
            span_levels = [tp for tp in (1 << k for k in range(1, size.bit_length())) if tp not in self.levels]
            for tp in list(self.levels) + span_levels:
                for start in range(0, size - tp + 1, tp):
                    self.num_groups += tp in self.levels
                    members = list(range(start, start + tp))
                    # The world's timeout bounds every collective: a subgroup gets torch's 30-minute default
                    # otherwise, and a survivor of a dead peer would sit that long in a ring that never closes.
                    pg = (
                        dist.new_group(ranks=members, backend=self.backend, timeout=timedelta(seconds=timeout_s))
                        if tp > 1
                        else None
                    )
                    if rank in members:
                        self._groups[(start, tp)] = pg
        except BaseException:
            # A rendezvous that failed (a member never came, the port was taken) leaves no half-built world.
            self.destroy()
            raise

    def group(self, start: int, tp: int) -> TPGroup:
        """This rank's view of the pre-built group [start, start + tp)."""
        key = (start, tp)
        assert key in self._groups, f"rank {self.rank} is not in a pre-built group {key}"
        if tp == 1:
            return TPGroup.single(self.device)
        return TPGroup(
            rank=self.rank - start,
            size=tp,
            process_group=self._groups[key],
            device=self.device,
            channel=self._channels.get(key),
            host_staging=self.host_staging,
        )

    # -- shared-memory collectives ------------------------------------------------------------------
    def attach_channels(
        self, same_host: Callable[[Sequence[int]], bool], slot_bytes: int = shm_collectives.DEFAULT_SLOT_BYTES
    ) -> int:
        """Give every pre-built group of this rank whose members all share this host's memory
        (`same_host(ranks)`, which every member must answer alike: it is decided from the members' exchange) a
        shared-memory channel. Collective: every member calls it once, right after the world is built and before
        any group is used. Per group: its first member creates the segment, the group's gloo all-gather passes
        the name, the others map it, a second all-gather says whether all could, and the name is unlinked (no
        /dev/shm name outlives this call). A group where any member failed keeps gloo. Returns the channels
        made (0 on GPUs and where `shm_collectives.supported()` is false)."""
        if self.backend != "gloo" or self.host_staging or not shm_collectives.supported():
            return 0
        tag = f"p{self.master_port}"
        for start, tp in sorted(self._groups, key=lambda k: (k[1], k[0])):
            members = list(range(start, start + tp))
            if tp == 1 or self._groups[(start, tp)] is None or not same_host(members):
                continue
            channel, name, error = None, "", ""
            creator = self.rank == start
            if creator:
                name = shm_collectives.SHM_DIR + "/" + shm_collectives.create_name(tag, start, tp)
                try:
                    channel = shm_collectives.ShmChannel(
                        name, 0, tp, create=True, slot_bytes=slot_bytes, timeout_s=self.timeout_s
                    )
                except Exception as exc:  # noqa: BLE001 -- any failure here must reach the others as "no channel"
                    error, name = f"{type(exc).__name__}: {exc}", ""
            try:
                name = self.all_gather_bytes(name.encode(), start, tp)[0].decode()
                if not creator and name:
                    try:
                        channel = shm_collectives.ShmChannel(
                            name, self.rank - start, tp, create=False, slot_bytes=slot_bytes, timeout_s=self.timeout_s
                        )
                    except Exception as exc:  # noqa: BLE001 -- as above: the second exchange tells everyone
                        error = f"{type(exc).__name__}: {exc}"
                oks = self.all_gather_bytes(b"1" if channel is not None else b"0", start, tp)
            finally:
                if creator and name:
                    try:
                        os.unlink(name)
                    except FileNotFoundError:
                        pass
            if all(ok == b"1" for ok in oks):
                self._channels[(start, tp)] = channel
            else:
                if channel is not None:
                    channel.close()
                if error:
                    log.warning(
                        "group [%d, %d): gloo collectives (no shared-memory channel: %s)", start, start + tp, error
                    )
        return len(self._channels)

    def drop_channel(self, start: int, tp: int) -> None:
        """Tear a group's channel down on every member (one waiting in it raises at once), as destroying a
        gloo group closes its connections."""
        channel = self._channels.pop((start, tp), None)
        if channel is not None:
            channel.abort()

    def communicator_keys(self, keep: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """The (start, tp) of the pre-built process groups this rank holds, all but `keep` (TP=1 holds none)."""
        return [key for key, pg in self._groups.items() if pg is not None and key != keep]

    def drop_group(self, start: int, tp: int) -> None:
        """Tear one pre-built group down on this rank: its channel, then its process group (after a peer loss)."""
        self.drop_channel(start, tp)
        dist.destroy_process_group(self._groups.pop((start, tp)))

    # -- node-level collectives ---------------------------------------------------------------------
    def all_gather_bytes(self, payload: bytes, start: int, tp: int) -> list[bytes]:
        """Every member's payload, in rank order, over the pre-built group [start, start + tp) (a TP level's
        or a span's; the whole world's is always there)."""
        if tp == 1:
            return [payload]
        channel = self._channels.get((start, tp))
        if channel is not None:
            return channel.all_gather_bytes(payload)
        if (start, tp) not in self._groups and (start, tp) == (0, self.size):
            pg = None  # a world whose size is no power of two: its default group
        else:
            pg = self._groups[(start, tp)]
        dev = "cpu" if self.host_staging else self.device
        length = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(tp)]
        dist.all_gather(lengths, length, group=pg)
        sizes = [int(x.item()) for x in lengths]
        longest = max(sizes)
        data = torch.zeros(longest, dtype=torch.uint8, device=dev)
        if payload:
            data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
        parts = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(tp)]
        dist.all_gather(parts, data, group=pg)
        return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        if self.host_staging and tensor.is_cuda:
            host = tensor.cpu()
            return _Staged(dist.isend(host, dst=dst, tag=tag), host)
        return dist.isend(tensor, dst=dst, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        if self.host_staging and tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            return _Staged(dist.irecv(host, src=src, tag=tag), host, into=tensor)
        return dist.irecv(tensor, src=src, tag=tag)

    def barrier(self) -> None:
        dist.barrier()

    def destroy(self) -> None:
        """Tear this world down (its groups, the default group and, on device 0, the rendezvous server)."""
        for channel in self._channels.values():
            channel.abort()
        self._channels.clear()
        self._groups.clear()
        leave_process_world()
        self._store = None


class _Staged:
    """A gloo send or receive of a CUDA tensor through a host copy (ranks sharing a GPU): `wait` finishes the
    transfer and, for a receive, copies the host buffer into the CUDA tensor."""

    def __init__(self, work: Any, host: torch.Tensor, into: torch.Tensor | None = None) -> None:
        self._work, self._host, self._into = work, host, into

    def wait(self) -> bool:
        done = self._work.wait()
        if self._into is not None:
            self._into.copy_(self._host)
            self._into = None
        return done
