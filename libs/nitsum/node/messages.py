"""What the node runtime answers: `TransitionAck` (the worker shell turns it into the wire's TopologyAck).
The node-world messages themselves are `nitsum.wire.node` (re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass

from nitsum.kv.reshard import RequestKV
from nitsum.topology import Group
from nitsum.wire.node import COMMAND_KINDS, KvEntry, NodeCommand

KV_PATHS = ("auto", "shm", "tcp", "p2p")

__all__ = ["COMMAND_KINDS", "KV_PATHS", "NodeCommand", "TransitionAck"]


@dataclass(frozen=True)
class TransitionAck:
    """Mirrors the wire's TopologyAck (the worker shell adds its id)."""

    epoch: int
    ok: bool
    phase: str  # "prepare" | "commit" | "abort" | "precopy"
    reason: str = ""
    duration_ms: float = 0.0
    bytes_moved: int = 0  # KV bytes this worker sent to other workers
    pending: bool = False  # prepare: accepted, pre-copy running between steps; the final ack follows
    bytes_by_path: tuple[tuple[str, int], ...] = ()  # bytes_moved by path ("shm", "tcp", "p2p"): metrics


def kv_entry(r: RequestKV) -> KvEntry:
    return KvEntry(r.request_id, r.group.start, r.group.tp, r.num_computed_tokens, tuple(r.block_ids))


def request_kv(e: KvEntry) -> RequestKV:
    return RequestKV(e.request_id, Group(e.start, e.tp), e.num_computed_tokens, e.block_ids)
