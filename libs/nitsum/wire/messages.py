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
                 flow-scheduler at layer boundaries), FlowPruned (flow-scheduler → gateways: retry the request)
  KV hand-off    KvLayer → KvAck (worker ↔ worker: one layer of a P/D hand-off or of a stage-1 prefix fetch,
                 its bytes in shared memory on one host, over the TCP data plane across hosts), KvFetch →
                 KvFetchReply (a worker asks another for cached blocks), KvPeer → KvPeerInfo (where a worker's
                 KV receiver listens and which host it is on)
  generic        ErrorReply (a coded failure answer to any request)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters as they travel; mirrors nitsum.engine.SamplingParams."""

    KIND: ClassVar[str] = "sampling"
    VERSION: ClassVar[int] = 1
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # issue 21 (OpenAI logits processing and logprobs); defaults mean "off", so older frames decode.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias_ids: tuple[int, ...] = ()  # logit_bias as two parallel arrays (msgpack maps want str keys)
    logit_bias_values: tuple[float, ...] = ()
    logprobs: int = -1  # -1: no logprobs; k >= 0: the sampled token's logprob and the k most likely
    guide: str = ""  # llguidance grammar of response_format json_object / json_schema ("" = free text)
    min_tokens: int = 0
    min_p: float = 0.0


@dataclass(frozen=True)
class SubmitRequest:
    """Gateway → coordinator: admit and route one request.

    `output_token_ids` is non-empty when the gateway re-submits a request whose worker was lost: the new
    worker continues from prompt + those tokens, and `max_tokens` in `sampling` counts the remaining ones.
    """

    KIND: ClassVar[str] = "submit"
    VERSION: ClassVar[int] = 1
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    tier: str
    ttft_ms: float
    tpot_ms: float
    weight: float
    arrival_unix_ms: float
    stream_subject: str
    output_token_ids: tuple[int, ...] = ()
    attempt: int = 0
    exclude_workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class SubmitReply:
    """Coordinator → gateway: where the request went, or why it was refused (HTTP status + Retry-After)."""

    KIND: ClassVar[str] = "submit_reply"
    VERSION: ClassVar[int] = 1
    request_id: str
    accepted: bool
    worker_id: str = ""
    group_id: str = ""
    status: int = 200
    retry_after_s: float = 0.0
    reason: str = ""
    # Workers that may take the request's stream over from `worker_id` (TP change, P/D hand-off): the P/D
    # decode worker and the workers of the nodes of both (a node is one process world and trust domain).
    successors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunRequest:
    """Coordinator → group leader: run this request and stream its tokens to `stream_subject`."""

    KIND: ClassVar[str] = "run"
    VERSION: ClassVar[int] = 1
    request: SubmitRequest
    # P/D: run the prefill here, then hand the request (KV + state) to this decode worker.
    decode_worker: str = ""
    # KV reuse (stage 1): before prefilling, fetch these chained prefix-block hashes from `reuse_from`.
    reuse_from: str = ""
    reuse_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class RunAck:
    KIND: ClassVar[str] = "run_ack"
    VERSION: ClassVar[int] = 1
    request_id: str
    worker_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class TokenChunk:
    """Worker → gateway on the request's stream subject.

    `index` is the position (in the request's output) of the first token in `token_ids`, so the gateway
    drops duplicates and detects gaps after a re-route. `error_code` non-empty ends the stream in error.
    """

    KIND: ClassVar[str] = "tokens"
    VERSION: ClassVar[int] = 1
    request_id: str
    worker_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str = ""
    finished: bool = False
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    error_code: str = ""
    error_message: str = ""
    # When the request asked for logprobs: one per token in `token_ids`, and `top_k` alternatives per token
    # as flat (id, logprob) arrays, token after token.
    logprobs: tuple[float, ...] = ()
    top_k: int = 0
    top_logprob_ids: tuple[int, ...] = ()
    top_logprob_values: tuple[float, ...] = ()
    # The SubmitRequest.attempt this frame answers (-1: not known, e.g. a stream adopted in a hand-off): a
    # request re-routed to the worker it left must not take that worker's late frames of the older attempt.
    attempt: int = -1


@dataclass(frozen=True)
class TokenBatch:
    """Worker → one gateway on `Subjects.gateway_frames`: the chunks of one engine step (or of the steps its
    publisher fell behind by) for every request that gateway serves, in the order they were produced. Each
    chunk keeps its own request id, index, attempt, usage and error fields, exactly as a TokenChunk alone."""

    KIND: ClassVar[str] = "token_batch"
    VERSION: ClassVar[int] = 1
    worker_id: str
    chunks: tuple[TokenChunk, ...]


@dataclass(frozen=True)
class AbortRequest:
    KIND: ClassVar[str] = "abort"
    VERSION: ClassVar[int] = 1
    request_id: str
    reason: str = "client_disconnected"
    worker_id: str = ""  # only this worker acts on it ("" = whichever runs the request)


@dataclass(frozen=True)
class WorkerStats:
    """Worker → coordinator heartbeat; the coordinator rebuilds its state from these after a restart."""

    KIND: ClassVar[str] = "worker_stats"
    VERSION: ClassVar[int] = 1
    worker_id: str
    node_id: str
    device_index: int
    device: str
    role: str
    state: str  # "starting" | "ready" | "draining" | "stopped"
    group_id: str
    tp: int
    model_name: str
    max_model_len: int
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    running_request_ids: tuple[str, ...] = ()
    cached_block_hashes: tuple[int, ...] = ()
    sent_unix_ms: float = 0.0
    step_ms_ewma: float = 0.0
    num_prefill_tokens_computed: int = 0
    num_cached_prompt_tokens: int = 0
    num_aborted: int = 0
    instance_id: str = ""  # new on every process start: a restarted worker is a new instance
    epoch: int = 0  # the last topology epoch this worker committed
    in_world: bool = False  # member of its node's process world (can take part in TP changes)
    leader: bool = True  # leads its group (only leaders take requests)
    block_size: int = 0  # tokens per KV block (the coordinator hashes prompts with it for KV reuse)
    num_kv_imported: int = 0  # requests adopted from a prefill worker (P/D)
    num_reused_blocks: int = 0  # prefix blocks fetched from other workers instead of computed (stage 1)
    num_transfer_failures: int = 0  # KV transfers that failed at this end (either side)
    node_size: int = 0  # workers of its node's world (NITSUM_NODE_SIZE; 0: a standalone worker)
    generation: int = 0  # generation of the node world it is (or was last) in; 0: the boot world or none
    # Per running_request_ids entry (same order; empty from an older worker): tokens streamed so far (the
    # stream index: a re-submitted request counts the tokens it came with), and ms between its first token
    # here and this message (-1: not yet). The coordinator's snapshot reads decode progress from these.
    running_output_tokens: tuple[int, ...] = ()
    running_first_token_age_ms: tuple[float, ...] = ()
    # Requests whose streams ended here (finished, failed, aborted; not handed off or moved) since the last
    # heartbeat, with the attempt each served: the coordinator stops counting them at once instead of a grace
    # period after a heartbeat stops listing them.
    finished_request_ids: tuple[str, ...] = ()
    finished_attempts: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerLost:
    """Coordinator → gateways: a worker stopped reporting; its requests must be re-submitted."""

    KIND: ClassVar[str] = "worker_lost"
    VERSION: ClassVar[int] = 1
    worker_id: str
    request_ids: tuple[str, ...]
    reason: str


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
class FlowSubmit:
    """Transfer agent → flow-scheduler: a flow waiting for a permit."""

    KIND: ClassVar[str] = "flow_submit"
    VERSION: ClassVar[int] = 1
    flow_id: str
    request_id: str
    unit_id: str
    stage: str  # "1" | "2" | "3" | "M"
    size_bytes: int
    src: str
    dst: str
    target_layer: int | None = None
    deadline_unix_ms: float | None = None
    request_deadlines_unix_ms: tuple[float, ...] = ()
    src_host: str = ""  # host ids of the two ends: the flow's links are the src host's uplink and the dst
    dst_host: str = ""  # host's downlink (capacities from NITSUM_FLOW_LINK_GBPS); "" = the worker ids' links


@dataclass(frozen=True)
class FlowPermit:
    """Flow-scheduler → transfer agent: the priority level (and DSCP) a flow may now send at."""

    KIND: ClassVar[str] = "flow_permit"
    VERSION: ClassVar[int] = 1
    flow_id: str
    level: int
    dscp: int
    pruned: bool = False
    reason: str = ""
    code: str = ""  # with pruned: "flow_invalid" (never retry) or "overload_pruned" (retry the request)


@dataclass(frozen=True)
class FlowCompletion:
    KIND: ClassVar[str] = "flow_done"
    VERSION: ClassVar[int] = 1
    flow_id: str
    ok: bool
    bytes_sent: int
    error: str = ""


@dataclass(frozen=True)
class FlowSubmitBatch:
    """Transfer agent → flow-scheduler: several flows of one request in one round trip."""

    KIND: ClassVar[str] = "flow_submit_batch"
    VERSION: ClassVar[int] = 1
    flows: tuple[FlowSubmit, ...]


@dataclass(frozen=True)
class FlowPermitBatch:
    KIND: ClassVar[str] = "flow_permit_batch"
    VERSION: ClassVar[int] = 1
    permits: tuple[FlowPermit, ...]


@dataclass(frozen=True)
class FlowProgress:
    """Bytes a flow still has to send (for RMLQ's MLU and the pruning check's delay estimate)."""

    KIND: ClassVar[str] = "flow_progress"
    VERSION: ClassVar[int] = 1
    flow_id: str
    remaining_bytes: int


@dataclass(frozen=True)
class LayerProgress:
    """Prefill worker → flow-scheduler, at a layer boundary of a unit (a batch): the layer it starts now,
    counted from the unit's first layer (the numbering of FlowSubmit.target_layer, so RLI = target − layer),
    the TTFT deadlines of its requests, and its flows' progress. `done`: the unit's compute has finished
    (its stage-3 flows then move on the scheduler's timer)."""

    KIND: ClassVar[str] = "layer_progress"
    VERSION: ClassVar[int] = 1
    unit_id: str
    layer: int
    request_deadlines_unix_ms: tuple[float, ...] = ()
    flows: tuple[FlowProgress, ...] = ()
    done: bool = False


@dataclass(frozen=True)
class FlowPruned:
    """Flow-scheduler → gateways / coordinator: overload pruning suppressed a request's flows. The request
    will miss its TTFT deadline where it is; `code` "overload_pruned" means: retry it (re-plan elsewhere or
    later); nothing of it is sent any more."""

    KIND: ClassVar[str] = "flow_pruned"
    VERSION: ClassVar[int] = 1
    request_id: str
    code: str
    reason: str
    flow_ids: tuple[str, ...] = ()
    retryable: bool = True


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


@dataclass(frozen=True)
class ErrorReply:
    """A coded failure answer to any request (code is a short stable identifier, message is for humans)."""

    KIND: ClassVar[str] = "error"
    VERSION: ClassVar[int] = 1
    code: str
    message: str
    retry_after_s: float = 0.0
    details: dict[str, str] = field(default_factory=dict)


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
    FlowPruned,
    KvLayer,
    KvPeer,
    KvPeerInfo,
    KvAck,
    KvFetch,
    KvFetchReply,
    ErrorReply,
)
