"""How KV reaches a transition's new caches: one class per mode, behind one interface (`KvPath`).

The mode is agreed once by the whole node world (`kv_hosts.resolve_mode`); each prepare then asks
`path_for` which path makes *this* worker's new cache:
- `ShmArenaPath`: a view of the spare arena (reserved long ago): nothing to allocate, zero or reserve;
- `ShmSegmentPath`: a fresh shared-memory segment (sparse; its pages are reserved, paced, in the build
  thread), kept as an arena from now on when this worker recycles arenas;
- `TcpPath`: private memory that only this worker's KV receiver thread writes into (sources on other hosts,
  or a worker without a usable /dev/shm);
- `P2pPath` (GPU caches, or configured): the runner's own cache, filled by paired gloo/NCCL send/recv
  inside the prepare and commit steps.
The first three are one-sided (`OneSidedPath`): sources write into the new caches between their own steps
(`precopy.PreCopy`), mapping those on their host and connecting to those on another (`map_new_caches`,
`connect_remote`), and each destination on another host serves its sources (`serve_remote_sources`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nitsum.engine import migration
from nitsum.kv.reshard import ReshardPlan
from nitsum.node.build import RunnerBuild
from nitsum.node.precopy import PreCopy, copy_transfers_one_sided, plan_flows
from nitsum.transfer import shm
from nitsum.transfer.framing import TransferError
from nitsum.transfer.kv_link import KvLinks
from nitsum.transfer.kv_tcp import STAGE_M_DSCP

if TYPE_CHECKING:
    from nitsum.node.transition import Transition


class KvPath:
    """The interface: make this worker's new cache, move the prepare's full blocks, move the commit's delta."""

    name = ""
    one_sided = True

    def allocate(self, t: Transition) -> None:
        """This worker's new cache and the build of its new runner (`t.new_cache`, `t.build`)."""
        raise NotImplementedError

    def move_full_blocks(self, t: Transition, plan: ReshardPlan) -> str:
        """Prepare, after the span agreed on `plan`: move (or set up the pre-copy of) its full blocks.
        Returns a problem ("" when none) that every member of the span agrees on."""
        raise NotImplementedError

    def move_delta(self, t: Transition, delta: ReshardPlan) -> tuple[dict[str, int], str]:
        """Commit: move the delta; (bytes moved by path, the span's agreed problem or "")."""
        raise NotImplementedError


class OneSidedPath(KvPath):
    """Sources write into the new caches; destinations post nothing (see the module docstring)."""

    def move_full_blocks(self, t: Transition, plan: ReshardPlan) -> str:
        node = t.node
        dst_caches: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}
        problem = ""
        try:
            if t.source:
                dst_caches = map_new_caches(t)
        except (OSError, RuntimeError) as exc:
            problem = f"worker {node.rank}: cannot map the new KV caches: {type(exc).__name__}: {exc}"
        if not problem and t.source:
            problem = connect_remote(t)
        t.timings_ms["mapped"] = t.elapsed_ms()
        try:
            problems = t.agree(problem)
        finally:
            if t.segment is not None:
                shm.unlink(t.segment)  # every source attached it (or gave up): the name goes
        t.timings_ms["agreed"] = t.elapsed_ms()
        if problems:
            return problems
        if t.build is not None:
            t.build.start()  # after the exchanges: see RunnerBuild
            t.make_engine_ahead()
        if t.source:
            flows = plan_flows(plan.transfers, node.block_bytes, node.precopy_chunk_bytes)
            t.precopy = PreCopy(
                node.rank,
                t.my_old.workers,
                plan.transfers,
                flows,
                node.runner.kv_cache,
                t.old_heads(),
                dst_caches,
                t.links,
            )
            node.counters.planned(node, t.epoch, [(f.src_worker, f.dst_worker, f.size_bytes) for f in flows])
            t.note_preemptions()
        t.dst_caches = dst_caches
        return ""

    def move_delta(self, t: Transition, delta: ReshardPlan) -> tuple[dict[str, int], str]:
        node = t.node
        by_path, error = copy_transfers_one_sided(
            node.rank,
            delta.transfers,
            node.runner.kv_cache if t.source else None,
            t.old_heads() if t.source else None,
            t.dst_caches,
            t.links,
            node.block_bytes,
            node.precopy_chunk_bytes,
        )
        t.timings_ms["moved"] = t.elapsed_ms()
        # Every write into a new cache has landed (TCP: acked after the write) before any new group runs a
        # step; a link that failed means some did not: then every worker keeps the old topology.
        problems = t.agree(error)
        t.timings_ms["agreed"] = t.elapsed_ms()
        if problems:
            return {}, problems
        node.counters.moved(by_path)
        node.counters.planned(
            node,
            t.epoch,
            [
                (x.src_worker, x.dst_worker, node.block_bytes(x) * x.num_blocks)
                for x in delta.transfers
                if x.src_worker == node.rank
            ],
        )
        return by_path, ""


class ShmArenaPath(OneSidedPath):
    name = "shm-arena"

    def allocate(self, t: Transition) -> None:
        node = t.node
        t.arena = node.arenas.take_spare()
        assert t.arena is not None, "the arena path takes the spare arena"
        t.new_cache = t.arena.view(node.layout.cache_shape(t.my_new.tp), node.layout.dtype)
        pooled = node.pool.pooled(t.my_new)  # normally there: built at boot, or left by a change
        t.build = RunnerBuild.at_once(pooled) if pooled is not None else _deferred_build(t)


class ShmSegmentPath(OneSidedPath):
    name = "shm-segment"

    def allocate(self, t: Transition) -> None:
        # Sparse here (microseconds); the build thread reserves its pages before anything but pre-copy writes
        # into it (/dev/shm's room was checked: a full one refuses the epoch now).
        node = t.node
        segment = t.segment = shm.segment_name(node.node_tag, t.epoch, node.rank)
        shape = node.layout.cache_shape(t.my_new.tp)
        if node.arenas.recycle:  # an arena from now on (this worker's spare was gone)
            t.arena = node.arenas.named(segment)
            t.new_cache = t.arena.view(shape, node.layout.dtype)
        else:
            t.new_cache = shm.create(segment, shape, node.layout.dtype, reserve=False)
        reserve = shm.reserver(segment)
        t.build = RunnerBuild(
            lambda: node.pool.runner(t.my_new, with_cache=False), start=False, cancel=reserve.close, after=reserve
        )


class TcpPath(OneSidedPath):
    name = "tcp"

    def allocate(self, t: Transition) -> None:
        node = t.node
        t.new_cache = torch.zeros(node.layout.cache_shape(t.my_new.tp), dtype=node.layout.dtype)
        t.build = _deferred_build(t)


class P2pPath(KvPath):
    name = "p2p"
    one_sided = False

    def allocate(self, t: Transition) -> None:
        # p2p receives into the new runner's own cache, inside this very prepare step
        t.build = RunnerBuild(lambda: t.node.pool.runner(t.my_new))
        t.runner = t.adopt_runner()

    def move_full_blocks(self, t: Transition, plan: ReshardPlan) -> str:
        moved = execute(t, plan)
        t.node.counters.bytes_by_path["p2p"] += moved
        t.moved_in_prepare = moved
        return ""

    def move_delta(self, t: Transition, delta: ReshardPlan) -> tuple[dict[str, int], str]:
        moved = execute(t, delta)
        t.timings_ms["moved"] = t.timings_ms["agreed"] = t.elapsed_ms()
        t.node.counters.bytes_by_path["p2p"] += moved
        return {"p2p": moved}, ""


def path_for(node) -> KvPath:
    """The path of this worker's next new cache, from the world's mode and what this worker holds."""
    if node.kv_path == "p2p":
        return P2pPath()
    if node.kv_path == "shm" and node.members[node.rank].shm:
        return ShmArenaPath() if node.arenas.spare is not None else ShmSegmentPath()
    return TcpPath()


def _deferred_build(t: Transition) -> RunnerBuild:
    return RunnerBuild(lambda: t.node.pool.runner(t.my_new, with_cache=False), start=False)


def execute(t: Transition, plan: ReshardPlan) -> int:
    """Paired send/recv of this worker's part of `plan` over the node world (p2p)."""
    node = t.node
    new_kv = t.runner.kv_cache if t.runner is not None else None
    return migration.execute_transfers(
        node.world,
        plan.transfers,
        node.rank,
        node.runner.kv_cache if t.source else None,
        t.old_heads() if t.source else None,
        new_kv,
        t.new_heads() if t.destination else None,
    )


def map_new_caches(t: Transition) -> dict[int, tuple[torch.Tensor, tuple[int, int]]]:
    """Every new cache of the span on this host (this worker's own included), with the global heads it holds:
    by the worker's arena handle when it gave one, else by the epoch's segment name."""
    node = t.node
    caches = {}
    for g in t.born:
        for w in g.workers:
            if node.kv_path_of(node.rank, w) == "tcp":
                continue  # on another host: reached through its receiver (connect_remote)
            if w == node.rank:
                assert t.new_cache is not None, "a changed worker allocated its new cache"
                cache = t.new_cache
            elif w in t.handles:
                cache = shm.attach_handle(
                    t.handles[w], node.layout.cache_shape(g.tp), node.layout.dtype, node.members[w].pid
                )
            else:
                cache = shm.attach(
                    shm.segment_name(node.node_tag, t.epoch, w),
                    node.layout.cache_shape(g.tp),
                    node.layout.dtype,
                    allow_larger=True,
                )
            caches[w] = (cache, migration.heads_of(node.layout.model_config.num_kv_heads, g, w))
    return caches


def serve_remote_sources(t: Transition) -> None:
    """Destination: serve the sources of this epoch on other hosts (before the span's first exchange, so that
    the receiver is up by the time any of them connects)."""
    node = t.node
    sources = {w for g in t.gone for w in g.workers if node.kv_path_of(w, node.rank) == "tcp"}
    if not sources:
        return
    assert node.receiver is not None and t.new_cache is not None, "one-sided mode has a receiver"
    node.receiver.open(t.epoch, node.rank, t.new_cache, t.new_heads(), sources)
    t.receiving = True


def connect_remote(t: Transition) -> str:
    """Source: a TCP link to every new cache of the span on another host; a problem, or "". Its first
    connection is in the delta's class (STAGE_M_DSCP); pre-copy opens its permit's class at its first chunk.
    `kv_tos` gets the IP_TOS of every connection opened, now or then."""
    node = t.node
    targets = {
        w: (node.members[w].addr, node.members[w].port, node.members[w].token)
        for g in t.born
        for w in g.workers
        if node.kv_path_of(node.rank, w) == "tcp"
    }
    if not targets:
        return ""
    t.links = KvLinks(on_open=node.counters.kv_tos.append)
    try:
        t.links.connect(t.epoch, node.rank, targets, STAGE_M_DSCP)
    except TransferError as exc:
        return f"worker {node.rank}: cannot reach a new KV cache on another host: {exc}"
    return ""
