"""Node-world messages: what the workers of one node world send each other over its collectives.

They never cross NATS: a topology command travels inside a control step plan (leader -> peers), the rest
are the payloads of a transition span's all-gathers. Each is a frozen dataclass with a kind tag and a schema
version, encoded by `nitsum.wire.codec` like every bus message. Pairs such as (start, tp) travel as
`tuple[int, ...]` of length 2 (the codec carries `tuple[T, ...]` only); `__post_init__` checks the length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# The one group-id function, re-exported for node-world code (defined with the policy snapshot: stdlib only).
from nitsum.policy.snapshot import group_id_of as group_id_of

COMMAND_KINDS = ("prepare", "commit", "abort", "precopy", "handles", "handoff")
ROLES = ("prefill", "decode", "hybrid")


def _pairs(name: str, value: tuple[tuple[int, ...], ...]) -> None:
    for pair in value:
        if len(pair) != 2:
            raise ValueError(f"{name}: every entry is a pair, got {pair!r}")


@dataclass(frozen=True)
class NodeCommand:
    """A topology command as it travels inside a control step plan."""

    KIND: ClassVar[str] = "node_command"
    VERSION: ClassVar[int] = 2

    kind: str
    epoch: int
    groups: tuple[tuple[int, ...], ...] = ()  # prepare: the new topology as (start, tp) pairs
    chunks: tuple[tuple[int, ...], ...] = ()  # precopy: (flow index, chunk index) items to run now
    # precopy: (flow index, DSCP of its permit's level); a flow not here goes across hosts at the lowest level's
    classes: tuple[tuple[int, ...], ...] = ()
    # prepare: each new group's role, in the order of `groups` (empty: every group hybrid), and the worker id
    # of each new group's leader (empty: unknown) -- a prefill group's leader hands its requests to a decode one
    roles: tuple[str, ...] = ()
    leaders: tuple[str, ...] = ()
    # handoff (P/D inside the node world; `groups` holds the destination group as its one pair): the request,
    # its block table in this group's pool, its table in the destination's pool, the destination members'
    # arena handles (in member order) and the KV tokens moved
    request_id: str = ""
    blocks: tuple[int, ...] = ()
    dst_blocks: tuple[int, ...] = ()
    handles: tuple[str, ...] = ()
    num_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COMMAND_KINDS:
            raise ValueError(f"unknown node command {self.kind!r}")
        if self.roles and len(self.roles) != len(self.groups):
            raise ValueError(f"roles: one per group, got {len(self.roles)} for {len(self.groups)} groups")
        if self.leaders and len(self.leaders) != len(self.groups):
            raise ValueError(f"leaders: one per group, got {len(self.leaders)} for {len(self.groups)} groups")
        for role in self.roles:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        if self.kind == "handoff" and (len(self.groups) != 1 or len(self.blocks) != len(self.dst_blocks)):
            raise ValueError("handoff: one destination group and as many destination blocks as source blocks")
        for name in ("groups", "chunks", "classes"):
            _pairs(name, getattr(self, name))
            object.__setattr__(self, name, tuple((int(a), int(b)) for a, b in getattr(self, name)))

    def encode(self) -> bytes:
        from nitsum.wire import codec

        return codec.encode(self)

    @staticmethod
    def decode(payload: bytes) -> NodeCommand:
        from nitsum.wire import codec

        return codec.decode(payload, NodeCommand)


@dataclass(frozen=True)
class KvEntry:
    """One request's KV as an old group's leader holds it (`kv.reshard.RequestKV` on the wire)."""

    KIND: ClassVar[str] = "node_kv_entry"
    VERSION: ClassVar[int] = 1

    request_id: str
    start: int
    tp: int
    num_computed_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PrepareShare:
    """Prepare's exchange: whether this worker can take the epoch, its old group's block tables (its leader
    only) and the handle of its new cache when that is a recycled arena ("" otherwise)."""

    KIND: ClassVar[str] = "node_prepare_share"
    VERSION: ClassVar[int] = 1

    ok: bool
    reason: str
    requests: tuple[KvEntry, ...] = ()
    handle: str = ""


@dataclass(frozen=True)
class CommitShare:
    """Commit's exchange: an old leader's request states (`Engine.export_states`, msgpack), the span's block
    tables, its step id, the requests preempted since prepare, and a build or pre-copy error ("" if none)."""

    KIND: ClassVar[str] = "node_commit_share"
    VERSION: ClassVar[int] = 1

    states: bytes
    requests: tuple[KvEntry, ...]
    step_id: int
    invalid: tuple[str, ...]
    error: str


@dataclass(frozen=True)
class Agreement:
    """A span's agreement round after mapping / moving: this worker's problem ("" when none)."""

    KIND: ClassVar[str] = "node_agreement"
    VERSION: ClassVar[int] = 1

    problem: str = ""


NODE_MESSAGE_TYPES: tuple[type, ...] = (NodeCommand, KvEntry, PrepareShare, CommitShare, Agreement)
