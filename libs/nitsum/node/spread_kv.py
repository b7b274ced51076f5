"""A TP>1 group's KV as one cache: the full-head export a one-cache worker's KV mover ships, gathered from and
scattered into the members' caches (shm arenas), so that such a group takes part in P/D hand-offs and stage-1
prefix fetches across hosts (the worker's `KvMover`, TCP between hosts).

Each member of a TP=t group holds KV heads `migration.heads_of` of it (a slice of the heads, or one replicated
head under GQA when t exceeds the model's KV heads). The group's leader maps every other member's arena
(`handoff.group_handles`, `shm.attach_handle`) and, in its step thread (a step boundary of the group: no member
writes KV then), reads each head once (`gather_heads`) or writes each member its heads (`scatter_heads`; a
replicated head goes to every member holding it). Only on the world's shm KV path (`capable`): with private
memory there are no arenas to map.

Everything here runs in the step thread of the group's leader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from nitsum.engine import migration
from nitsum.engine.migration import KVExport
from nitsum.node import handoff
from nitsum.transfer import shm

if TYPE_CHECKING:
    from nitsum.node.runtime import NodeRuntime

Part = tuple[tuple[int, int], torch.Tensor]  # (global KV heads [start, end) a member holds, its cache)


def gather_heads(parts: Sequence[Part], num_kv_heads: int, block_ids: Sequence[int]) -> torch.Tensor:
    """Blocks `block_ids` with every KV head, on the CPU: [layers, K/V, n, block_size, num_kv_heads, head_dim].
    Each head is read once, from the first part holding it; ValueError when some head is in no part."""
    out, have = None, [False] * num_kv_heads
    for (h0, h1), cache in parts:
        wanted = [h for h in range(h0, h1) if not have[h]]
        if not wanted:
            continue  # a replica of heads read already
        if out is None:
            shape = (cache.shape[0], cache.shape[1], len(block_ids), cache.shape[3], num_kv_heads, cache.shape[5])
            out = torch.empty(shape, dtype=cache.dtype)
        blocks = migration.gather_blocks(cache, block_ids)
        for h in wanted:
            out[:, :, :, :, h] = blocks[:, :, :, :, h - h0]
            have[h] = True
    if out is None or not all(have):
        raise ValueError(f"KV heads {[h for h, ok in enumerate(have) if not ok]} are held by no member")
    return out


def scatter_heads(
    parts: Sequence[Part], kv: torch.Tensor, block_ids: Sequence[int], positions: Sequence[int] | None = None
) -> None:
    """Write full-head `kv` (as `gather_heads` gives it; only its blocks `positions` when given) into blocks
    `block_ids` of every part, each its own heads."""
    for (h0, h1), cache in parts:
        migration.scatter_blocks(cache, block_ids, kv[:, :, :, :, h0:h1], positions)


def capable(node: NodeRuntime) -> bool:
    """This worker leads a group whose members' caches its leader can map (the world's shm KV path)."""
    return node.is_leader and node.group.tp > 1 and node.kv_path == "shm" and node.members[node.rank].shm


def group_parts(node: NodeRuntime) -> list[Part]:
    """Leader: every member's (heads, cache), the leader's own cache first. HandoffError when some member's
    cache cannot be mapped (not on shared memory)."""
    if not capable(node):
        raise handoff.HandoffError(
            f"group {node.group} cannot gather its KV heads (TP {node.group.tp}, KV path {node.kv_path})"
        )
    g, num_kv_heads = node.group, node.layout.model_config.num_kv_heads
    handles = handoff.group_handles(node)
    parts: list[Part] = [(migration.heads_of(num_kv_heads, g, node.rank), node.runner.kv_cache)]
    shape = node.layout.cache_shape(g.tp)
    for position, worker in enumerate(range(g.start, g.start + g.tp)):
        if worker == node.rank:
            continue
        if not handles[position]:
            raise handoff.HandoffError(f"worker {worker}'s cache is not a shared arena")
        cache = shm.attach_handle(handles[position], shape, node.layout.dtype, node.members[worker].pid)
        parts.append((migration.heads_of(num_kv_heads, g, worker), cache))
    return parts


def export_request(node: NodeRuntime, request_id: str) -> KVExport:
    """Prefill leader: the pinned request's state and full-head KV, in `Engine.export_kv`'s format."""
    state, num_tokens, blocks = handoff.source(node, request_id)
    kv = gather_heads(group_parts(node), node.layout.model_config.num_kv_heads, blocks)
    return KVExport(state, num_tokens, (0, node.layout.model_config.num_kv_heads), kv)


def import_request(node: NodeRuntime, export: KVExport) -> bool:
    """Decode leader: adopt a full-head export (reserve blocks, write every member's heads, adopt); False when
    the pool has no room now. On any failure the reservation goes; HandoffError/ValueError say why."""
    num_kv_heads = node.layout.model_config.num_kv_heads
    if export.heads != (0, num_kv_heads):
        raise ValueError(f"the export holds KV heads {export.heads}, not all {num_kv_heads}")
    parts = group_parts(node)
    rid = export.state["id"]
    try:
        blocks, _handles = handoff.reserve(node, rid, export.num_tokens)
    except handoff.NoRoom:
        return False
    try:
        if len(blocks) != export.kv.shape[2]:
            raise ValueError(f"{len(blocks)} blocks reserved for {export.kv.shape[2]} blocks of KV")
        scatter_heads(parts, export.kv, blocks)
        handoff.adopt(node, export.state, export.num_tokens)  # it decodes from its first token on
    except BaseException:
        handoff.drop(node, rid)
        raise
    return True


def export_cached_blocks(node: NodeRuntime, block_hashes: list[int]) -> tuple[list[int], torch.Tensor]:
    """Holder leader: (hashes found, full-head KV) of the longest leading run of `block_hashes` cached here."""
    engine = node.engine
    block_ids = engine.kv.cached_prefix(block_hashes)
    if not block_ids:
        return [], torch.empty(0)
    kv = gather_heads(group_parts(node), node.layout.model_config.num_kv_heads, block_ids)
    return list(block_hashes[: len(block_ids)]), kv


def import_cached_blocks(node: NodeRuntime, block_hashes: list[int], kv: torch.Tensor) -> int:
    """Asker leader: another worker's full-head prefix blocks into this group's prefix cache (every member's
    heads); blocks cached here already are skipped. The number of blocks written."""
    assert kv.shape[2] == len(block_hashes), f"{kv.shape[2]} blocks of KV for {len(block_hashes)} hashes"
    parts = group_parts(node)
    engine = node.engine
    reserved = engine.kv.reserve_import(block_hashes)
    if not reserved:
        return 0
    scatter_heads(parts, kv, [b for _, b in reserved], [p for p, _ in reserved])
    engine.kv.finish_import([b for _, b in reserved])
    return len(reserved)
