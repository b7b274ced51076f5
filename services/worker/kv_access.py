"""What the KV mover (transfer.py, kv_incoming.py) reads from and writes into a worker's cache, in the step
thread: a P/D hand-off's request and stage-1 prefix blocks in the one-cache format (every KV head). A standalone
worker or a TP1 group's leader uses its engine's own export/import; a node-world TP>1 group's leader gathers its
members' heads from their shm arenas or scatters them there (`nitsum.node.spread_kv`)."""

from __future__ import annotations

from nitsum.node import spread_kv


def spread(backend) -> bool:
    """A node-world TP>1 group's leader: its requests' KV heads are spread over its members' caches."""
    return backend.in_world and backend.group[1] > 1


def export_kv(backend, request_id: str):
    if spread(backend):
        return spread_kv.export_request(backend.runtime, request_id)
    return backend.engine.export_kv(request_id)


def import_request(backend, export) -> bool:
    if spread(backend):
        return spread_kv.import_request(backend.runtime, export)
    return backend.engine.import_request(export)


def export_cached_blocks(backend, block_hashes: list[int]):
    if spread(backend):
        return spread_kv.export_cached_blocks(backend.runtime, block_hashes)
    return backend.engine.export_cached_blocks(block_hashes)


def import_cached_blocks(backend, block_hashes: list[int], kv) -> int:
    if spread(backend):
        return spread_kv.import_cached_blocks(backend.runtime, block_hashes, kv)
    return backend.engine.import_cached_blocks(block_hashes, kv)
