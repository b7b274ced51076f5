"""Topology messages (coordinator ↔ workers): a TP change's prepare / commit / abort → TopologyAck, a node world's
re-forming (NodeReform), stream offsets and role changes, and P/D hand-offs between two groups of one node world
(NodeHandoffOffer → NodeHandoffReady, NodeHandoffCommit → TopologyAck).

Part of `nitsum.wire.messages` (import them from there; its module docstring states the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class GroupAssignment:
    """One group of a topology: aligned devices, TP and role."""

    KIND: ClassVar[str] = "group"
    VERSION: ClassVar[int] = 1
    group_id: str
    start: int
    tp: int
    role: str
    worker_ids: tuple[str, ...]


@dataclass(frozen=True)
class TopologyPrepare:
    KIND: ClassVar[str] = "topo_prepare"
    VERSION: ClassVar[int] = 1
    node_id: str
    epoch: int
    groups: tuple[GroupAssignment, ...]
    reason: str = ""


@dataclass(frozen=True)
class TopologyCommit:
    KIND: ClassVar[str] = "topo_commit"
    VERSION: ClassVar[int] = 1
    node_id: str
    epoch: int


@dataclass(frozen=True)
class TopologyAbort:
    KIND: ClassVar[str] = "topo_abort"
    VERSION: ClassVar[int] = 1
    node_id: str
    epoch: int
    reason: str = ""


@dataclass(frozen=True)
class NodeReform:
    """Coordinator → every worker of a node (control subject): form world generation `generation` of the
    node's `size` workers, adopting your TP=1 engine. Answered with a TopologyAck of phase "reform" whose
    epoch is the generation, once the worker serves in the new world (or refused/failed, with why)."""

    KIND: ClassVar[str] = "node_reform"
    VERSION: ClassVar[int] = 1
    node_id: str
    generation: int
    size: int


@dataclass(frozen=True)
class StreamOffset:
    """Coordinator → every worker of a node (control subject, no reply): request `request_id` was re-submitted
    with `offset` tokens already streamed (they are part of its prompt now). A worker that adopts it in a TP
    change streams it from its engine's count plus this offset."""

    KIND: ClassVar[str] = "stream_offset"
    VERSION: ClassVar[int] = 1
    request_id: str
    offset: int


@dataclass(frozen=True)
class RoleChange:
    """Coordinator → one standalone worker: serve as prefill, decode or hybrid from the next step on."""

    KIND: ClassVar[str] = "role_change"
    VERSION: ClassVar[int] = 1
    worker_id: str
    role: str


@dataclass(frozen=True)
class TopologyAck:
    KIND: ClassVar[str] = "topo_ack"
    VERSION: ClassVar[int] = 1
    worker_id: str
    epoch: int
    ok: bool
    phase: str
    reason: str = ""
    duration_ms: float = 0.0


@dataclass(frozen=True)
class NodeHandoffOffer:
    """Prefill group leader → decode group leader of the same node world (`worker.<id>.handoff`): reserve blocks
    for `num_tokens` KV tokens of this request; they will be written straight into your group's caches."""

    KIND: ClassVar[str] = "node_handoff_offer"
    VERSION: ClassVar[int] = 1
    request_id: str
    src_worker: str
    num_tokens: int


@dataclass(frozen=True)
class NodeHandoffReady:
    """The decode leader's answer: the reserved blocks, its group (start, tp) and its members' arena handles."""

    KIND: ClassVar[str] = "node_handoff_ready"
    VERSION: ClassVar[int] = 1
    request_id: str
    ok: bool
    reason: str = ""
    start: int = 0
    tp: int = 1
    block_ids: tuple[int, ...] = ()
    handles: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeHandoffCommit:
    """Prefill leader → decode leader: the KV landed (`ok`), adopt the request (`state`: its engine state,
    msgpack) and stream it from output index `produced`; or (not `ok`) drop the reservation. Answered by a
    TopologyAck (phase "handoff")."""

    KIND: ClassVar[str] = "node_handoff_commit"
    VERSION: ClassVar[int] = 1
    request_id: str
    ok: bool
    state: bytes = b""
    num_tokens: int = 0
    prompt_len: int = 0
    produced: int = 0
