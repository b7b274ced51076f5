"""Which workers of a node world share a host, and so which path each KV migration pair takes.

A node world's workers are usually one host's processes, but nothing guarantees it: the rendezvous address
(NITSUM_NODE_MASTER_ADDR) may be remote and docker compose runs each worker in its own container, whose
/dev/shm is private. Shared-memory one-sided writes only work between workers that map the *same* /dev/shm;
everything else must go over the transfer data plane (TCP, tagged with the stage-M DSCP).

So every worker says who it is once, at NodeRuntime construction (`exchange`: one all-gather over the whole
world, msgpack): its host id, whether it can create segments in /dev/shm, its device, the KV path it was
configured with, and where its KV receiver listens. The rest is pure (`resolve_mode`, `pair_path`,
`hosts_of`) and every worker computes the same answers from the same list.

Host id: NITSUM_HOST_ID when set (tests split one machine into "hosts" with it), else the hostname, the
kernel's boot id and the device number of the /dev/shm mount: two containers of one machine share a boot id
but not their /dev/shm tmpfs (a different st_dev), so they count as different hosts, which is what shared
memory needs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field

import msgpack

from nitsum.transfer.shm import SHM_DIR

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# Resolved modes: "shm" (one-sided: shared memory between workers of a host, TCP across hosts), "tcp"
# (one-sided, every pair over TCP: no pair can share memory, or forced), "p2p" (paired gloo send/recv).
MODES = ("shm", "tcp", "p2p")


@dataclass(frozen=True)
class Member:
    """One worker as the others see it (agreed at construction)."""

    rank: int
    host: str
    shm: bool  # it can create and map KV segments in /dev/shm
    device: str  # "cpu" or "cuda:<n>"
    kv_path: str  # as configured: "auto" | "shm" | "tcp" | "p2p"
    addr: str  # its KV receiver, for sources on other hosts
    port: int
    pid: int = 0  # its process (its KV arenas are mapped through /proc/<pid>/fd: shm.Arena)
    pidns: int = 0  # its pid namespace (inode of /proc/self/ns/pid; 0: unknown): such a path needs the same one
    tpc: bool = True  # NITSUM_TP_SHM_COLLECTIVES: a group gets a shared-memory channel only if all its members say so
    token: int = field(default=0, repr=False)  # its KV receiver's secret (kv_tcp: a hello must carry it)

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                self.rank,
                self.host,
                self.shm,
                self.device,
                self.kv_path,
                self.addr,
                self.port,
                self.pid,
                self.pidns,
                self.tpc,
                self.token,
            ],
            use_bin_type=True,
        )

    @staticmethod
    def decode(payload: bytes) -> Member:
        rank, host, shm, device, kv_path, addr, port, pid, pidns, tpc, token = msgpack.unpackb(payload, raw=False)
        return Member(
            int(rank),
            str(host),
            bool(shm),
            str(device),
            str(kv_path),
            str(addr),
            int(port),
            int(pid),
            int(pidns),
            bool(tpc),
            int(token),
        )


def maps_arenas_of(members: tuple[Member, ...], rank: int, readers: tuple[frozenset[int], ...] | None = None) -> bool:
    """Whether every worker that shares memory with `rank` can open its arenas' /proc paths (same pid
    namespace, known; and, given `readers` (from `fd_readers`), each of them found that it may), so that it can
    hand them its spare KV arena instead of a fresh named segment."""
    me = members[rank]
    peers = [m for m in members if m.rank != rank and shares_memory(me, m)]
    if not me.pidns or any(m.pidns != me.pidns for m in peers):
        return False
    return readers is None or all(rank in readers[m.rank] for m in peers)


def can_read_fds(pid: int) -> bool:
    """Whether this process may open process `pid`'s /proc/<pid>/fd entries, as `shm.attach_handle` does:
    /proc mounted with hidepid, another user id or a security module can refuse it where /dev/shm is shared."""
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for entry in entries:
        try:
            os.readlink(f"/proc/{pid}/fd/{entry}")  # the access check that opening one makes
            return True
        except FileNotFoundError:  # closed meanwhile: try the next one
            continue
        except OSError:
            return False
    return False


def fd_readers(world, members: tuple[Member, ...], rank: int) -> tuple[frozenset[int], ...]:
    """Per rank, the ranks whose /proc/<pid>/fd it can read (probed among the workers that share its memory):
    one all-gather over the whole node world, so every member decides `maps_arenas_of` from the same facts."""
    me = members[rank]
    mine = [m.rank for m in members if m.rank != rank and shares_memory(me, m) and m.pid and can_read_fds(m.pid)]
    parts = world.all_gather_bytes(msgpack.packb(mine), 0, world.size)
    return tuple(frozenset(int(r) for r in msgpack.unpackb(p)) for p in parts)


def local_host_id(override: str = "") -> str:
    """This worker's host id (see the module docstring)."""
    if override:
        return override
    try:
        with open(BOOT_ID_PATH) as handle:
            boot = handle.read().strip()
    except OSError:
        boot = "?"
    try:
        shm = f"shm{os.stat(SHM_DIR).st_dev}"
    except OSError:
        shm = "noshm"
    return f"{socket.gethostname()}/{boot}/{shm}"


def is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def advertise_addr(override: str, master_addr: str) -> str:
    """Where sources on other hosts reach this worker's KV receiver: NITSUM_KV_ADVERTISE_ADDR, else loopback
    when the node world itself meets on loopback (one machine), else the local address of the route to the
    rendezvous host (a UDP "connect" only looks the route up; no packet leaves)."""
    if override:
        return override
    if is_loopback(master_addr):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, 9))
            return probe.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # never raise before the exchange: one member raising alone would leave the others waiting
        return "127.0.0.1"  # (then `_check_reachable` names the problem on every member)


def exchange(world, me: Member) -> tuple[Member, ...]:
    """Every worker's Member, in rank order (one all-gather over the whole node world)."""
    parts = world.all_gather_bytes(me.encode(), 0, world.size)
    members = tuple(Member.decode(p) for p in parts)
    assert [m.rank for m in members] == list(range(world.size)), "the world's members answer in rank order"
    return members


def hosts_of(members: tuple[Member, ...]) -> dict[str, tuple[int, ...]]:
    """Host id -> the ranks on it, in rank order."""
    hosts: dict[str, list[int]] = {}
    for m in members:
        hosts.setdefault(m.host, []).append(m.rank)
    return {h: tuple(ranks) for h, ranks in hosts.items()}


def shares_memory(a: Member, b: Member) -> bool:
    return a.host == b.host and a.shm and b.shm


def resolve_mode(members: tuple[Member, ...]) -> str:
    """The world's KV mode from every member's configuration (ValueError when it cannot work; every
    member raises the same, as it decides from the same list): "p2p" when configured, or by "auto" when some
    cache is on a GPU (one-sided writes need host memory); otherwise one-sided: "shm" unless it was "tcp"
    or no two workers share a /dev/shm."""
    paths = {m.kv_path for m in members}
    if len(paths) > 1:
        raise ValueError(f"the node's workers disagree on the KV path: {sorted(paths)}")
    (path,) = paths
    on_gpu = [m.rank for m in members if m.device != "cpu"]
    if path == "p2p" or (path == "auto" and on_gpu):
        return "p2p"
    if on_gpu:
        raise ValueError(f"kv_path {path!r} needs CPU caches (workers {on_gpu} are on a GPU)")
    if path == "shm":
        lacking = [m.rank for m in members if not m.shm]
        if lacking:
            raise ValueError(f"kv_path 'shm' needs a writable /dev/shm (workers {lacking} have none)")
    mode = (
        path
        if path in ("tcp", "shm")
        else ("shm" if any(shares_memory(a, b) for a in members for b in members if a.rank < b.rank) else "tcp")
    )
    _check_reachable(mode, members)
    return mode


def _check_reachable(mode: str, members: tuple[Member, ...]) -> None:
    """A receiver that advertises a loopback address cannot be reached from another machine. When every
    member advertises loopback the world is one machine (host ids that differ there are containers sharing
    its network, or a test); when some advertise a routable address, a loopback one that a TCP pair would
    use is a configuration error -- found here, at boot, on every member alike, not at the first change."""
    if all(is_loopback(m.addr) for m in members):
        return
    stuck = sorted(
        {
            d.rank
            for s in members
            for d in members
            if pair_path(mode, members, s.rank, d.rank) == "tcp" and is_loopback(d.addr)
        }
    )
    if stuck:
        raise ValueError(
            f"workers {stuck} advertise a loopback address for their KV receiver, but workers on "
            "other hosts would connect to it: set NITSUM_KV_ADVERTISE_ADDR (or a routable "
            "NITSUM_NODE_MASTER_ADDR)"
        )


def pair_path(mode: str, members: tuple[Member, ...], src: int, dst: int) -> str:
    """How KV moves from worker `src` to worker `dst`: "local" (one worker), "p2p", "shm" or "tcp"."""
    assert mode in MODES, f"unknown KV mode {mode!r}"
    if src == dst:
        return "local"
    if mode == "p2p":
        return "p2p"
    if mode == "shm" and shares_memory(members[src], members[dst]):
        return "shm"
    return "tcp"
