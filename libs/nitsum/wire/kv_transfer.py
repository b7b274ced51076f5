"""KV transfer messages (worker ↔ worker): one layer of a P/D hand-off or of a stage-1 prefix fetch (KvLayer →
KvAck), a fetch of cached blocks (KvFetch → KvFetchReply), and where a worker's KV receiver listens (KvPeer →
KvPeerInfo).

Part of `nitsum.wire.messages` (import them from there; its module docstring states the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class KvLayer:
    """Worker → worker (request/reply → KvAck): one layer of a request's KV, its bytes in a shared-memory
    segment the sender owns until the ack (`segment`, `size_bytes`, `crc32`).

    `purpose` "pd": a prefill worker hands a request to its decode worker; `state` (msgpack: the request's
    state, token count, KV heads, dtype, per-layer shape) lets the receiver adopt it once every layer landed.
    `purpose` "reuse": cached prefix blocks for `block_hashes` (stage 1), imported into the prefix cache.
    """

    KIND: ClassVar[str] = "kv_layer"
    VERSION: ClassVar[int] = 1
    request_id: str
    src_worker: str
    purpose: str  # "pd" | "reuse"
    layer: int
    num_layers: int
    flow_id: str
    segment: str
    size_bytes: int
    crc32: int
    state: bytes = b""
    stream_subject: str = ""
    block_hashes: tuple[int, ...] = ()
    via: str = ""  # "": the bytes are in shared-memory `segment`; "tcp": they came over the TCP data plane
    attempt: int = -1  # "pd": the SubmitRequest.attempt the prefill served (the decode worker's frames carry it)


@dataclass(frozen=True)
class KvPeer:
    """Worker → worker (request/reply on `worker.<id>.kv` → KvPeerInfo): which host are you on, and where does
    your KV receiver listen? Asked once per peer before the first KV transfer to it."""

    KIND: ClassVar[str] = "kv_peer"
    VERSION: ClassVar[int] = 1
    src_worker: str
    src_host: str = ""


@dataclass(frozen=True)
class KvPeerInfo:
    """A worker's KV endpoint: its host id (same as the asker's: shared memory; else TCP to `addr`:`port`,
    every flow's END frame carrying `token`, the receiver's secret, told only over the authenticated bus)."""

    KIND: ClassVar[str] = "kv_peer_info"
    VERSION: ClassVar[int] = 1
    worker_id: str
    host_id: str
    addr: str = ""
    port: int = 0  # 0: no TCP receiver (then only shared memory works)
    token: int = 0
    link_gbps: float = 0.0  # its NIC's link speed as the kernel reported it at boot (0: unknown)


@dataclass(frozen=True)
class KvAck:
    KIND: ClassVar[str] = "kv_ack"
    VERSION: ClassVar[int] = 1
    request_id: str
    layer: int
    ok: bool
    reason: str = ""
    complete: bool = False  # every layer landed and the request (or the blocks) were adopted


@dataclass(frozen=True)
class KvFetch:
    """Worker → worker (request/reply → KvFetchReply): send me the cached blocks of this prefix (stage 1).

    The holder pushes them back as KvLayer messages ("reuse") and answers once they were acked."""

    KIND: ClassVar[str] = "kv_fetch"
    VERSION: ClassVar[int] = 1
    request_id: str
    dst_worker: str
    block_hashes: tuple[int, ...]
    deadline_unix_ms: float | None = None


@dataclass(frozen=True)
class KvFetchReply:
    KIND: ClassVar[str] = "kv_fetch_reply"
    VERSION: ClassVar[int] = 1
    request_id: str
    ok: bool
    num_blocks: int = 0
    reason: str = ""
