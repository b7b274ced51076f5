"""KV reshard planner: which KV bytes move where when a node's groups merge or split (standard library only).

A node has D workers (devices). A *topology* partitions them into aligned groups; worker `w` at position
`p = w - start` of a TP=k group holds KV heads `kv_head_range(H_kv, k, p)` of every block of every request
its group serves (replicated when k exceeds the KV-head count, exactly as the loader cuts k/v weights).

When the topology changes, every request of a changed group moves to one new group (`place_requests`);
each destination worker then needs, for each KV head it will hold, those heads' slice of every block the
request has computed. `plan_prepare` lists those moves as `Transfer`s (source worker, destination worker,
layers, head range, source blocks -> destination blocks), choosing the destination blocks from a fresh
pool per new group (a TP change changes the per-rank head count, so a new group always starts with a new
KV tensor). Only *full* blocks move at prepare: they are immutable while the old group keeps decoding.
`plan_commit` then lists the delta at the step boundary: the blocks written since (normally the last
partial block), whole tables of requests that arrived since, and drops requests that finished.

Everything here is a deterministic function of its arguments, so every worker of a node computes the same
plan from the same snapshots without a coordinator shipping it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nitsum.kv.block_pool import BlockPool
from nitsum.topology import Group, Topology


def changed_groups(old: Topology, new: Topology) -> tuple[tuple[Group, ...], tuple[Group, ...]]:
    """(old groups that stop existing, new groups that start existing); unchanged groups keep serving.

    Groups compare by `span` only: a group whose role alone changes keeps its KV, requests and runner."""
    assert old.num_workers == new.num_workers, "a transition keeps the node's workers"
    kept = {g.span for g in old.groups} & {g.span for g in new.groups}
    return (tuple(g for g in old.groups if g.span not in kept), tuple(g for g in new.groups if g.span not in kept))


def transition_span(old: Topology, new: Topology) -> Group | None:
    """Smallest aligned group covering every worker whose group changes (None: nothing changes).

    Every worker inside the span takes part in the transition's collectives; workers outside never notice.
    """
    gone, born = changed_groups(old, new)
    workers = [w for g in gone + born for w in g.workers]
    if not workers:
        return None
    lo, hi = min(workers), max(workers)
    size = 1
    while lo // size != hi // size:
        size *= 2
    return Group(lo - lo % size, size)


def component_of(old: Topology, new: Topology, worker: int) -> Group | None:
    """The part of a change `worker` belongs to: the largest changed group (old or new) that holds it, or None
    when its group does not change. Aligned groups either nest or are disjoint, so every changed group that
    overlaps it lies inside it, and no unchanged group does: the changes inside one component touch no other
    component's workers, KV or requests. 2xTP2 -> 4xTP1 is two components (two independent splits); a merge or
    a split of one group is one."""
    gone, born = changed_groups(old, new)
    holding = [g for g in gone + born if worker in g.workers]
    return max(holding, key=lambda g: g.tp) if holding else None


def local_target(old: Topology, new: Topology, worker: int) -> Topology:
    """`new` inside `worker`'s component and `old` everywhere else: the change as that worker's component sees
    it. Its span is the component itself, so each component exchanges within its own group, at its own step
    boundary, and never waits for another's (ALGORITHMS.md §1.4 per part). `old` when `worker` is unchanged."""
    component = component_of(old, new, worker)
    if component is None:
        return old
    inside = [g for g in new.groups if g.start in component.workers]
    outside = [g for g in old.groups if g.start not in component.workers]
    return Topology(tuple(inside + outside))


def kv_head_range(num_kv_heads: int, tp: int, position: int) -> tuple[int, int]:
    """Global KV heads [start, end) held by the worker at `position` of a TP=`tp` group."""
    assert 0 <= position < tp, f"position {position} outside TP={tp}"
    if num_kv_heads >= tp:
        assert num_kv_heads % tp == 0, f"{num_kv_heads} KV heads do not split {tp} ways"
        per = num_kv_heads // tp
        return position * per, (position + 1) * per
    assert tp % num_kv_heads == 0, f"TP={tp} does not replicate {num_kv_heads} KV heads evenly"
    head = position * num_kv_heads // tp
    return head, head + 1


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    block_size: int

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class RequestKV:
    """What an old group's leader reports about one request: its KV tokens and where they are."""

    request_id: str
    group: Group  # the old group serving it
    num_computed_tokens: int  # KV of tokens [0, num_computed_tokens) is in the cache
    block_ids: tuple[int, ...]  # its block table in the old group's pool (may cover more tokens)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(self.block_ids))


@dataclass(frozen=True)
class Placement:
    request_id: str
    src_group: Group
    dst_group: Group
    dst_block_ids: tuple[int, ...]  # its table in the new group's pool, covering the moved tokens
    num_moved_tokens: int  # KV tokens the new group holds for it (0 with `recompute`)
    recompute: bool = False  # no room in the new pool: it re-queues and recomputes (last resort)


@dataclass(frozen=True)
class Transfer:
    """Heads [head_start, head_end) of layers [layer_start, layer_end) of blocks src_block_ids[i] of
    `src_worker`'s cache go to dst_block_ids[i] of `dst_worker`'s new cache (src == dst: a local copy)."""

    src_worker: int
    dst_worker: int
    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


@dataclass(frozen=True)
class ReshardPlan:
    old: Topology
    new: Topology
    placements: tuple[Placement, ...]
    transfers: tuple[Transfer, ...]
    # Blocks already moved per request (prepare: its full blocks) -- the delta starts after them.
    num_moved_blocks: Mapping[str, int]
    # Each placed request's old block table as planned, to tell at commit whether it still holds.
    src_tables: Mapping[str, tuple[int, ...]]

    def placement(self, request_id: str) -> Placement:
        for p in self.placements:
            if p.request_id == request_id:
                return p
        raise KeyError(request_id)

    def transfers_of(self, worker: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if worker in (t.src_worker, t.dst_worker))


def place_requests(
    requests: Sequence[RequestKV], old: Topology, new: Topology, sticky: Mapping[str, Group] | None = None
) -> dict[str, Group]:
    """New group of every request of a changed old group.

    A request goes to a new group that shares workers with its old one (its KV is already partly there);
    among several (a split), the one with the fewest KV tokens placed so far, ties to the lowest start.
    `sticky` placements (from prepare) are kept.
    """
    gone, born = changed_groups(old, new)
    gone_spans = {g.span for g in gone}
    load = {g: 0 for g in born}
    placed: dict[str, Group] = {}
    for r in requests:
        if r.group.span not in gone_spans:
            continue
        if sticky and r.request_id in sticky:
            dst = sticky[r.request_id]
        else:
            candidates = [g for g in born if set(g.workers) & set(r.group.workers)]
            assert candidates, f"old group {r.group} overlaps no new group"
            dst = min(candidates, key=lambda g: (load[g], g.start))
        placed[r.request_id] = dst
        load[dst] += max(1, r.num_computed_tokens)
    return placed


def _sources_for(dst_worker: int, dst: Group, src: Group, geo: KVGeometry) -> list[tuple[int, int, int]]:
    """(source worker, head_start, head_end) runs covering the heads `dst_worker` will hold.

    A head held by several source workers (replication) comes from the destination itself when it holds
    it, else from source position (dst position mod number of holders) to spread the load.
    """
    h0, h1 = kv_head_range(geo.num_kv_heads, dst.tp, dst_worker - dst.start)
    runs: list[tuple[int, int, int]] = []
    for head in range(h0, h1):
        holders = [
            w
            for w in src.workers
            if kv_head_range(geo.num_kv_heads, src.tp, w - src.start)[0]
            <= head
            < kv_head_range(geo.num_kv_heads, src.tp, w - src.start)[1]
        ]
        if dst_worker in holders:
            source = dst_worker
        else:
            source = holders[(dst_worker - dst.start) % len(holders)]
        if runs and runs[-1][0] == source and runs[-1][2] == head:
            runs[-1] = (source, runs[-1][1], head + 1)
        else:
            runs.append((source, head, head + 1))
    return runs


def _transfers(
    moves: Sequence[tuple[Group, Group, Sequence[int], Sequence[int]]], geo: KVGeometry
) -> tuple[Transfer, ...]:
    """Merge per-request block moves (src group, dst group, src blocks, dst blocks) into one transfer per
    (source worker, destination worker, head run), blocks in request order."""
    merged: dict[tuple[int, int, int, int], tuple[list[int], list[int]]] = {}
    for src, dst, src_blocks, dst_blocks in moves:
        if not src_blocks:
            continue
        for dst_worker in dst.workers:
            for source, h0, h1 in _sources_for(dst_worker, dst, src, geo):
                lists = merged.setdefault((source, dst_worker, h0, h1), ([], []))
                lists[0].extend(src_blocks)
                lists[1].extend(dst_blocks)
    return tuple(
        Transfer(s, d, 0, geo.num_layers, h0, h1, tuple(a), tuple(b))
        for (s, d, h0, h1), (a, b) in sorted(merged.items())
    )


def handoff_transfers(
    src: Group, dst: Group, src_blocks: Sequence[int], dst_blocks: Sequence[int], geo: KVGeometry
) -> tuple[Transfer, ...]:
    """One request's KV from group `src` to another group `dst` of the same node (a P/D hand-off): the same
    per-worker head runs a TP change moves, for these blocks only."""
    assert len(src_blocks) == len(dst_blocks), "one destination block per source block"
    return _transfers([(src, dst, src_blocks, dst_blocks)], geo)


def plan_prepare(
    old: Topology,
    new: Topology,
    requests: Sequence[RequestKV],
    geo: KVGeometry,
    num_blocks_of: Mapping[int, int],
) -> ReshardPlan:
    """Placements of every request of a changed group and the pre-copy of their *full* blocks.

    `num_blocks_of[tp]` is the size of a new TP=tp group's KV pool. Blocks shared by several requests of
    one old group (a prefix-cache hit) are moved once and shared in the new pool too. A request whose table
    does not fit is placed with `recompute` (no KV moves; it is re-queued and recomputed there).
    """
    return _plan(old, new, requests, geo, num_blocks_of, previous=None, full_blocks_only=True)


def plan_commit(
    prepared: ReshardPlan,
    requests: Sequence[RequestKV],
    geo: KVGeometry,
    num_blocks_of: Mapping[int, int],
) -> ReshardPlan:
    """The delta at the step boundary: blocks written since prepare (and whole tables of requests that
    arrived since) move; requests that finished since release their pre-copied blocks.

    Returns the final placements (every request that continues, with its whole new table) and the delta
    transfers only.
    """
    return _plan(prepared.old, prepared.new, requests, geo, num_blocks_of, previous=prepared, full_blocks_only=False)


def _plan(
    old: Topology,
    new: Topology,
    requests: Sequence[RequestKV],
    geo: KVGeometry,
    num_blocks_of: Mapping[int, int],
    previous: ReshardPlan | None,
    full_blocks_only: bool,
) -> ReshardPlan:
    ids = [r.request_id for r in requests]
    assert len(set(ids)) == len(ids), "a request is reported by two groups"
    _, born = changed_groups(old, new)
    pools = {g: BlockPool(num_blocks_of[g.tp]) for g in born}
    # Pre-copied tables that stay valid: the request continues and its old table still starts the same.
    kept: dict[str, tuple[Placement, int]] = {}
    if previous is not None:
        now = {r.request_id: r for r in requests}
        for p in previous.placements:
            r = now.get(p.request_id)
            n_moved = previous.num_moved_blocks.get(p.request_id, 0)
            if p.recompute or r is None or r.group.span != p.src_group.span:
                continue
            before = previous.src_tables.get(p.request_id, ())
            if r.block_ids[:n_moved] != before[:n_moved] or r.num_computed_tokens < n_moved * geo.block_size:
                continue  # preempted and recomputed elsewhere since: move it afresh
            kept[p.request_id] = (p, n_moved)
        # Rebuild the new pools as prepare left them, then release what no longer continues.
        for p in previous.placements:
            if p.dst_block_ids:
                pools[p.dst_group].touch(p.dst_block_ids)
        for p in previous.placements:
            if p.request_id in kept:
                n_moved = kept[p.request_id][1]
                extra = p.dst_block_ids[n_moved:]
                if extra:
                    pools[p.dst_group].free(reversed(extra))
            elif p.dst_block_ids:
                pools[p.dst_group].free(reversed(p.dst_block_ids))

    sticky = {rid: p.dst_group for rid, (p, _) in kept.items()}
    destinations = place_requests(requests, old, new, sticky)
    placements: list[Placement] = []
    moves: list[tuple[Group, Group, list[int], list[int]]] = []
    num_moved: dict[str, int] = {}
    shared: dict[tuple[Group, int], int] = {}  # (old group, old block) -> new block, full blocks only
    src_tables: dict[str, tuple[int, ...]] = {}
    for r in requests:
        dst = destinations.get(r.request_id)
        if dst is None:
            continue  # its group is unchanged
        pool = pools[dst]
        n_tokens = r.num_computed_tokens
        n_full = n_tokens // geo.block_size
        n_target = n_full if full_blocks_only else geo.blocks_for(n_tokens)
        assert len(r.block_ids) >= n_target, f"{r.request_id}: table shorter than its computed tokens"
        prior, n_prior = kept.get(r.request_id, (None, 0))
        table = list(prior.dst_block_ids[:n_prior]) if prior else []
        need = [i for i in range(n_prior, n_target)]
        fresh = [i for i in need if not (i < n_full and (r.group, r.block_ids[i]) in shared)]
        if len(fresh) > pool.num_free:
            if table:
                pool.free(reversed(table))
            placements.append(Placement(r.request_id, r.group, dst, (), 0, recompute=True))
            num_moved[r.request_id] = 0
            src_tables[r.request_id] = r.block_ids
            continue
        src_blocks: list[int] = []
        dst_blocks: list[int] = []
        for i in need:
            key = (r.group, r.block_ids[i])
            if i < n_full and key in shared:
                block = shared[key]
                pool.touch([block])
            else:
                [block] = pool.allocate(1)  # type: ignore[misc]
                src_blocks.append(r.block_ids[i])
                dst_blocks.append(block)
                if i < n_full:
                    shared[key] = block
            table.append(block)
        for i, block in zip(range(n_prior), table):
            shared.setdefault((r.group, r.block_ids[i]), block)
        moves.append((r.group, dst, src_blocks, dst_blocks))
        moved_tokens = min(n_tokens, len(table) * geo.block_size)
        placements.append(Placement(r.request_id, r.group, dst, tuple(table), moved_tokens))
        num_moved[r.request_id] = n_full if full_blocks_only else len(table)
        src_tables[r.request_id] = r.block_ids
    return ReshardPlan(old, new, tuple(placements), _transfers(moves, geo), num_moved, src_tables)


def count_moved_bytes(plan: ReshardPlan, geo: KVGeometry, head_dim: int, itemsize: int) -> int:
    """Bytes that cross between *different* workers (local copies excluded): K and V, every layer."""
    per_head_block = 2 * geo.block_size * head_dim * itemsize
    return sum(
        t.num_blocks * (t.layer_end - t.layer_start) * (t.head_end - t.head_start) * per_head_block
        for t in plan.transfers
        if t.src_worker != t.dst_worker
    )
