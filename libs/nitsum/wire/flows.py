"""Flow messages (transfer agents ↔ flow-scheduler): submits, permits and completions of flows, one round trip per
request (FlowSubmitBatch → FlowPermitBatch), layer progress, and pruned requests (FlowPruned → gateways).

Part of `nitsum.wire.messages` (import them from there; its module docstring states the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


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
    # The two hosts' NIC speeds as their workers read them at boot (Gb/s; 0: unknown): the capacity of a host's
    # links where NITSUM_FLOW_LINK_GBPS does not name it
    src_link_gbps: float = 0.0
    dst_link_gbps: float = 0.0


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
class PrefillAdmission:
    """Prefill worker → flow-scheduler (on `flow.progress`, beside LayerProgress): a batch arrived, so the
    overload check covers it before it sends anything (paper §4.4.2; docs/SIMULATOR.md rule 33). `request_ids`
    were admitted now, each with its TTFT deadline and the worker's estimate of the compute its prefill takes
    (its prompt at the worker's measured prefill rate; 0 before the worker has measured one); `left` are
    requests admitted earlier whose prefill is over (first token out, ended or aborted): they are no longer
    pending. A pending request the check prunes gets a FlowPruned on its worker's permit subject."""

    KIND: ClassVar[str] = "prefill_admission"
    VERSION: ClassVar[int] = 1
    worker_id: str
    request_ids: tuple[str, ...] = ()
    ttft_deadlines_unix_ms: tuple[float, ...] = ()
    compute_ms: tuple[float, ...] = ()
    left: tuple[str, ...] = ()
    instance: str = ""  # the worker process (a restarted worker's earlier admissions are gone with it)
    # the worker's fixed cost of a turn, beside `compute_ms` (each request's cost per token): counted once in the
    # walk of the worker's queue, not once per request (the requests queued together share their turns)
    turn_ms: float = 0.0


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
