"""Every message exchanged between nitsum services, one frozen dataclass each.

Each class has a unique `KIND` tag and a `VERSION`; the codec writes both and refuses unknown kinds,
newer versions and fields of the wrong type. Fields use plain types only (str, int, float, bool, bytes,
tuples of those, dicts of str to those, and `X | None`) so that msgpack round-trips them exactly.

Channels (see subjects.py):
  request path   SubmitRequest → SubmitReply (gateway ↔ coordinator), RunRequest → RunAck (coordinator ↔ worker),
                 TokenChunk (worker → gateway, one subject per request), TokenBatch (worker → gateway: one frame
                 per step for all its requests), AbortRequest (anyone → workers)
  membership     WorkerStats (worker → coordinator, heartbeat), WorkerLost (coordinator → gateways)
  topology       TopologyPrepare / TopologyCommit / TopologyAbort → TopologyAck (coordinator ↔ workers),
                 NodeReform → TopologyAck (a node world re-formed after it lost a member), StreamOffset,
                 NodeHandoffOffer → NodeHandoffReady and NodeHandoffCommit → TopologyAck (P/D between two
                 groups of one node world: prefill leader ↔ decode leader, on worker.<id>.handoff)
  flows          FlowSubmit / FlowPermit / FlowCompletion (transfer agents ↔ flow-scheduler), FlowSubmitBatch →
                 FlowPermitBatch (one round trip for every flow of a request), LayerProgress (prefill worker →
                 flow-scheduler at layer boundaries), PrefillAdmission (prefill worker → flow-scheduler: a batch
                 arrived, or left its prefill), FlowPruned (flow-scheduler → gateways, and to a worker whose
                 request it pruned before its prefill: retry the request)
  KV hand-off    KvLayer → KvAck (worker ↔ worker: one layer of a P/D hand-off or of a stage-1 prefix fetch,
                 its bytes in shared memory on one host, over the TCP data plane across hosts), KvFetch →
                 KvFetchReply (a worker asks another for cached blocks), KvPeer → KvPeerInfo (where a worker's
                 KV receiver listens and which host it is on)
  generic        ErrorReply (a coded failure answer to any request)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

# The messages by family, each in its module; this one is the public one (import them from here) and lists
# them all for the codec (MESSAGE_TYPES).
from nitsum.wire.flows import (
    FlowCompletion,
    FlowPermit,
    FlowPermitBatch,
    FlowProgress,
    FlowPruned,
    FlowSubmit,
    FlowSubmitBatch,
    LayerProgress,
    PrefillAdmission,
)
from nitsum.wire.kv_transfer import (
    KvAck,
    KvFetch,
    KvFetchReply,
    KvLayer,
    KvPeer,
    KvPeerInfo,
)
from nitsum.wire.membership import (
    WorkerLost,
    WorkerStats,
)
from nitsum.wire.request_path import (
    AbortRequest,
    RunAck,
    RunRequest,
    SamplingSpec,
    SubmitReply,
    SubmitRequest,
    TokenBatch,
    TokenChunk,
)
from nitsum.wire.topology import (
    GroupAssignment,
    NodeHandoffCommit,
    NodeHandoffOffer,
    NodeHandoffReady,
    NodeReform,
    RoleChange,
    StreamOffset,
    TopologyAbort,
    TopologyAck,
    TopologyCommit,
    TopologyPrepare,
)


@dataclass(frozen=True)
class ErrorReply:
    """A coded failure answer to any request (code is a short stable identifier, message is for humans)."""

    KIND: ClassVar[str] = "error"
    VERSION: ClassVar[int] = 1
    code: str
    message: str
    retry_after_s: float = 0.0
    details: dict[str, str] = field(default_factory=dict)


MESSAGE_TYPES: tuple[type, ...] = (
    SamplingSpec,
    SubmitRequest,
    SubmitReply,
    RunRequest,
    RunAck,
    TokenChunk,
    TokenBatch,
    AbortRequest,
    WorkerStats,
    WorkerLost,
    GroupAssignment,
    TopologyPrepare,
    TopologyCommit,
    TopologyAbort,
    NodeReform,
    StreamOffset,
    NodeHandoffOffer,
    NodeHandoffReady,
    NodeHandoffCommit,
    RoleChange,
    TopologyAck,
    FlowSubmit,
    FlowPermit,
    FlowCompletion,
    FlowSubmitBatch,
    FlowPermitBatch,
    FlowProgress,
    LayerProgress,
    PrefillAdmission,
    FlowPruned,
    KvLayer,
    KvPeer,
    KvPeerInfo,
    KvAck,
    KvFetch,
    KvFetchReply,
    ErrorReply,
)
