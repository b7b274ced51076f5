"""This worker's KV data plane as the whole node world agreed it at boot: the members' hosts and receivers,
the mode, a path per (source, destination) pair, and this worker's KV receiver.

Chosen once, by the whole world: who shares a host (and so a /dev/shm), where each KV receiver listens, and
the mode (one-sided "shm"/"tcp", or paired "p2p"); then a path per pair (`kv_hosts`). A setting that cannot
work raises on every member after the exchange, not on one before it.
"""

from __future__ import annotations

import logging
import os
import threading

from nitsum.node import kv_hosts
from nitsum.parallel import shm_collectives as shm_collectives_lib
from nitsum.parallel.world import NodeWorld
from nitsum.transfer import shm
from nitsum.transfer.kv_receiver import KvReceiver
from nitsum.transfer.kv_tcp import THREAD_PREFIX, open_kv_sockets

log = logging.getLogger("nitsum.node.kv_plane")


class KvPlane:
    def __init__(
        self,
        world: NodeWorld,
        kv_path: str,
        host_id: str,
        advertise: str,
        master_addr: str,
        fault_epoch: int,
        fault_chunk_epochs: tuple[int, ...],
        shm_collectives: bool,
    ) -> None:
        self.rank = world.rank
        self.shm_possible = world.device == "cpu" and shm.available()
        addr = kv_hosts.advertise_addr(advertise, master_addr)
        self.receiver: KvReceiver | None = None
        if world.device == "cpu" and kv_path != "p2p":
            self.receiver = KvReceiver(
                "127.0.0.1" if kv_hosts.is_loopback(addr) else "", fault_epoch, fault_chunk_epochs
            )
        me = kv_hosts.Member(
            world.rank,
            kv_hosts.local_host_id(host_id),
            self.shm_possible,
            world.device,
            kv_path,
            addr,
            self.receiver.port if self.receiver is not None else 0,
            os.getpid(),
            shm_collectives_lib.pid_namespace(),
            shm_collectives,
            self.receiver.token if self.receiver is not None else 0,
        )
        try:
            self.members = kv_hosts.exchange(world, me)
            self.mode = kv_hosts.resolve_mode(self.members)
            # Groups of one host: their collectives through shared memory (NITSUM_TP_SHM_COLLECTIVES, which
            # every member of a group must have on: decided from the exchange, so all members agree).
            self.shm_channels = world.attach_channels(self.shares_host)
            # Whose /proc/<pid>/fd each worker may open (a spare arena is handed over by that path).
            self._readers = kv_hosts.fd_readers(world, self.members, self.rank) if self.mode == "shm" else None
        except BaseException:
            self.close_receiver()
            raise
        if self.mode == "p2p":
            self.close_receiver()

    def recycles_arenas(self) -> bool:
        """Whether this worker's KV arenas can be handed to the workers sharing its memory (by /proc/<pid>/fd)."""
        same_namespace = self.mode == "shm" and self.shm_possible and kv_hosts.maps_arenas_of(self.members, self.rank)
        recycle = same_namespace and kv_hosts.maps_arenas_of(self.members, self.rank, self._readers)
        if same_namespace and not recycle:
            log.warning(
                "worker %d: a worker that shares this host's memory cannot open this one's /proc/%d/fd "
                "(hidepid, another user id or a security module): its TP changes make fresh KV segments",
                self.rank,
                os.getpid(),
            )
        return recycle

    def shares_host(self, ranks) -> bool:
        """Every member of these ranks shares the first one's /dev/shm and has shared-memory collectives on."""
        first = self.members[ranks[0]]
        return all(kv_hosts.shares_memory(first, self.members[r]) and self.members[r].tpc for r in ranks)

    def path_of(self, src: int, dst: int) -> str:
        """How KV moves from worker `src` to worker `dst`: "local", "shm", "tcp" or "p2p"."""
        return kv_hosts.pair_path(self.mode, self.members, src, dst)

    def open_now(self) -> tuple[int, int]:
        """(TCP KV sockets this process holds open, KV receiver threads alive): (0, 0) between transitions."""
        mine = self.members[self.rank].port
        sockets = open_kv_sockets(mine, (m.port for m in self.members if m.rank != self.rank)) if mine else 0
        threads = sum(1 for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))
        return sockets, threads

    def close_receiver(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()
