"""Read-only inputs of every policy decision: a snapshot of the cluster at one instant.

The coordinator (live) and the simulator build a `ClusterSnapshot` from what they know and hand it,
unchanged, to a `Policy` (see `decisions.py`). Nothing here reads a clock: `now_ms` travels inside the
snapshot, so a decision is a pure function of its snapshot (and of the policy's frozen config).

Units: every time is in milliseconds on the caller's clock (any epoch, as long as it is the same one for
`now_ms`, `arrival_ms` and `first_token_ms`); token counts are tokens; KV capacity is in blocks.

Conventions callers must keep:
- `RequestView.group_id is None` means the request waits at the coordinator (not yet routed);
  otherwise it is queued or running on that group.
- `RequestView.first_token_ms is None` means prefill has not produced a token yet.
- `GroupView.devices` is the aligned, contiguous device range of the group: `devices[0] % tp == 0`.
- `GroupView.group_id` is chosen by the caller and unique within the snapshot; `group_id_of()` is the
  spelling every caller uses (the policy never parses it).
The arrival stream (`ArrivalStats`, `ArrivalWindow`) is arrivals.py's, re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from nitsum.policy.arrivals import ArrivalStats, ArrivalWindow
from nitsum.topology import ROLES

DEVICE_KINDS: tuple[str, ...] = ("cpu", "h100", "h200", "a100")


@dataclass(frozen=True)
class RequestView:
    """One request as the policy sees it (targets already resolved from its tier + per-request overrides)."""

    request_id: str
    tier: str
    ttft_ms: float  # TTFT target
    tpot_ms: float  # TPOT target
    weight: float  # tier weight (goodput accounting)
    arrival_ms: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0  # generated so far
    first_token_ms: float | None = None  # None: prefill not finished
    group_id: str | None = None  # None: queued at the coordinator
    cached_prompt_tokens: int = 0  # prefix-cache hits: prefill skips these

    @property
    def ttft_deadline_ms(self) -> float:
        return self.arrival_ms + self.ttft_ms

    @property
    def prefilled(self) -> bool:
        return self.first_token_ms is not None

    @property
    def uncached_prompt_tokens(self) -> int:
        return max(self.prompt_tokens - self.cached_prompt_tokens, 0)

    @property
    def remaining_output_tokens(self) -> int:
        return max(self.max_tokens - self.output_tokens, 0)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def finish_deadline_ms(self) -> float:
        """Latest finish time that still meets TPOT, given when the first token came (or must come).

        TPOT = (finish − first token) / (output tokens − 1), so the budget after the first token is
        tpot_ms · (max_tokens − 1).
        """
        first = self.first_token_ms if self.first_token_ms is not None else self.ttft_deadline_ms
        return first + self.tpot_ms * max(self.max_tokens - 1, 0)


@dataclass(frozen=True)
class GroupView:
    """One live TP group (its lowest-ranked device leads it)."""

    group_id: str
    devices: tuple[int, ...]  # aligned, contiguous
    tp: int
    role: str  # "prefill" | "decode" | "hybrid"
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    healthy: bool = True
    draining: bool = False

    def __post_init__(self) -> None:
        assert self.role in ROLES, f"unknown role {self.role!r}"
        assert len(self.devices) == self.tp, f"group {self.group_id}: {len(self.devices)} devices for TP{self.tp}"
        assert self.devices and self.devices[0] % self.tp == 0, f"group {self.group_id} is not aligned"

    @property
    def start(self) -> int:
        return self.devices[0]

    @property
    def usable(self) -> bool:
        """May receive new work."""
        return self.healthy and not self.draining


@dataclass(frozen=True)
class NodeView:
    """One NVLink domain (or one CPU host): its devices and the groups they form now."""

    node_id: str
    num_devices: int
    min_tp: int
    max_tp: int
    groups: tuple[GroupView, ...]
    device_kind: str = "cpu"  # "cpu" | "h100" | "h200" | "a100"
    last_reconfig_ms: float | None = None  # when the current topology went live (dwell time); None: at boot

    def allowed_tp_levels(self) -> tuple[int, ...]:
        """Powers of two from min_tp to max_tp."""
        levels = []
        k = 1
        while k <= self.max_tp:
            if k >= self.min_tp:
                levels.append(k)
            k *= 2
        return tuple(levels)


@dataclass(frozen=True)
class ClusterSnapshot:
    now_ms: float
    nodes: tuple[NodeView, ...]
    requests: tuple[RequestView, ...] = ()
    epoch: int = 0
    arrivals: tuple[ArrivalStats, ...] = ()  # per tier; empty: the caller does not measure arrivals
    # When the arrival stream last shifted (ArrivalWindow.shift_ms: a tier's rate moved beyond noise); None:
    # not measured, or no shift since measuring began. The adaptive policy prices a change against the
    # phase it expects to remain, and allows one change per shift (topology.py).
    load_shift_ms: float | None = None
    # Whether the stream had stopped when that shift was detected (ArrivalWindow.shift_stopped).
    load_shift_stopped: bool = False

    # Indexes below are built on first use (cached_property writes the instance __dict__ directly, which a
    # frozen dataclass allows); they are derived data, not fields, so equality and hashing ignore them.

    @cached_property
    def groups_by_id(self) -> dict[str, tuple[NodeView, GroupView]]:
        return {g.group_id: (n, g) for n in self.nodes for g in n.groups}

    @cached_property
    def requests_by_group(self) -> dict[str | None, tuple[RequestView, ...]]:
        """Requests per group id; key None holds the ones queued at the coordinator."""
        out: dict[str | None, list[RequestView]] = {}
        for r in self.requests:
            out.setdefault(r.group_id, []).append(r)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def group_loads(self) -> dict[str, GroupLoad]:
        """Per group id: prefill work waiting on it and the decode batch it carries (from `requests`)."""
        acc: dict[str, list[int]] = {}
        for r in self.requests:
            if r.group_id is None:
                continue
            a = acc.get(r.group_id)
            if a is None:
                a = acc[r.group_id] = [0, 0, 0, 0]
            if r.first_token_ms is None:
                a[0] += 1
                a[1] += r.prompt_tokens - r.cached_prompt_tokens
            else:
                a[2] += 1
                a[3] += r.prompt_tokens + r.output_tokens
        return {gid: GroupLoad(a[0], a[1], a[2], a[3]) for gid, a in acc.items()}

    @cached_property
    def queued_by_tier(self) -> dict[str, int]:
        """Requests not yet prefilled (at the coordinator or waiting on a group), per tier."""
        out: dict[str, int] = {}
        for r in self.requests:
            if r.first_token_ms is None:
                out[r.tier] = out.get(r.tier, 0) + 1
        return out

    def load_of(self, group_id: str) -> GroupLoad:
        return self.group_loads.get(group_id, _NO_LOAD)

    def node(self, node_id: str) -> NodeView:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node {node_id!r} in snapshot")

    def group(self, group_id: str) -> GroupView:
        return self.groups_by_id[group_id][1]

    def node_requests(self, node: NodeView) -> tuple[RequestView, ...]:
        """Requests running/queued on this node's groups plus, if it is the only node, the coordinator queue.

        With several nodes the coordinator queue is shared: each node sees it as demand it may be asked to
        serve, divided evenly (the caller of the estimator applies the share).
        """
        by_group = self.requests_by_group
        out: list[RequestView] = []
        for g in node.groups:
            out.extend(by_group.get(g.group_id, ()))
        out.extend(by_group.get(None, ()))
        return tuple(out)


@dataclass(frozen=True)
class GroupLoad:
    """What one group has to do, summed from the snapshot's requests."""

    num_prefill: int = 0  # requests routed there and not yet prefilled
    prefill_tokens: int = 0  # their uncached prompt tokens
    num_decode: int = 0  # requests past their first token
    decode_context_tokens: int = 0  # KV tokens those requests attend to


_NO_LOAD = GroupLoad()


def group_id_of(node_id: str, start: int, tp: int) -> str:
    """The id of a node's TP group [start, start + tp), e.g. 'n0-g4-tp2': the one group-id function. A worker
    reports it in WorkerStats.group_id, the coordinator assigns it in GroupAssignment.group_id, the simulator
    names its groups with it (all call this function; `nitsum.wire.node` re-exports it for the node world)."""
    return f"{node_id}-g{start}-tp{tp}"


def assemble_snapshot(
    now_ms: float,
    nodes: list[NodeView] | tuple[NodeView, ...],
    requests: list[RequestView] | tuple[RequestView, ...] = (),
    *,
    arrivals: ArrivalWindow | tuple[ArrivalStats, ...] | None = None,
    epoch: int = 0,
    load_shift_ms: float | None = None,
) -> ClusterSnapshot:
    """The one way a caller builds the policy's snapshot (the simulator and the live coordinator):
    nodes ordered by id, each node's groups by first device, arrivals measured from a window (or given)."""
    ordered = []
    for n in sorted(nodes, key=lambda n: n.node_id):
        groups = tuple(sorted(n.groups, key=lambda g: g.start))
        ordered.append(n if groups == n.groups else replace(n, groups=groups))
    shift = load_shift_ms
    stopped = False
    if isinstance(arrivals, ArrivalWindow):
        stats = arrivals.stats(now_ms)
        shift = arrivals.shift_ms
        stopped = bool(arrivals.shift_stopped)
    else:
        stats = tuple(arrivals or ())
    return ClusterSnapshot(
        now_ms=now_ms,
        nodes=tuple(ordered),
        requests=tuple(requests),
        epoch=epoch,
        arrivals=stats,
        load_shift_ms=shift,
        load_shift_stopped=stopped,
    )
