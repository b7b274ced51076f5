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
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from functools import cached_property

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
class ArrivalStats:
    """Recent arrivals of one tier, measured by the caller over a sliding window (optional input).

    The live set of requests says what is queued now, not what keeps coming: a layout that drains today's
    backlog can still fall behind the arrival stream. With these the adaptive policy also scores whether
    a candidate sustains the stream (estimate.evaluate, "stream"); without them it scores the backlog only.
    """

    tier: str
    rate_per_s: float  # arrivals per second offered to the cluster (admitted or not)
    ttft_ms: float
    tpot_ms: float
    weight: float
    prompt_tokens: tuple[int, ...]  # means of equal-mass slices of uncached prompt lengths, ascending (see measure)
    output_tokens: float  # mean max_tokens

    @staticmethod
    def measure(
        tier: str,
        window_ms: float,
        ttft_ms: float,
        tpot_ms: float,
        weight: float,
        lengths: list[tuple[int, int]],
        quantiles: int = 4,
    ) -> ArrivalStats:
        """From the (prompt tokens, max tokens) of the tier's arrivals in the last `window_ms`: the rate,
        the mean prompt length of each of `quantiles` equal-mass slices (sorted), the mean output."""
        assert window_ms > 0 and quantiles >= 1
        n = len(lengths)
        prompts = sorted(p for p, _ in lengths)
        # Each slice's mean, not its midpoint: the slices then average to the true mean prompt (a right-skewed
        # length distribution's midpoints sat ~1/3 above it for Azure code, and the policy's load estimate with them).
        mids = []
        for j in range(quantiles if n else 0):
            lo, hi = int(j * n / quantiles), max(int((j + 1) * n / quantiles), int(j * n / quantiles) + 1)
            part = prompts[lo : min(hi, n)] or prompts[-1:]
            mids.append(int(round(sum(part) / len(part))))
        mids = tuple(mids)
        out = sum(o for _, o in lengths) / n if n else 0.0
        return ArrivalStats(tier, n / window_ms * 1e3, ttft_ms, tpot_ms, weight, mids, out)


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


class ArrivalWindow:
    """Arrivals of the last `window_ms` per tier: what keeps coming, not only what is queued. One class for the
    live coordinator and the simulator, so both give the policy the same `ClusterSnapshot.arrivals`.

    `started_ms`: when measuring began (the simulator: 0; the coordinator: its boot). Rates are then counted over
    min(window, now − started) instead of the whole window, so the first seconds are not under-counted.
    None divides by the window always.

    `detect_shifts` (the simulator): track when the stream shifts (`shift_ms`, ClusterSnapshot.load_shift_ms).
    `regime_ms` > 0 (the simulator: 60 s, with detect_shifts): once the stream has been steady (no shift, see `_detect_shift`) for
    longer than the window, rates and lengths are measured over all of the steady stretch, up to `regime_ms`,
    instead of the last window only: a 5 s window of a 7 req/s stream is ±17 % noise, which put a layout at
    ρ ≈ 1 one epoch and ρ ≈ 0.75 the next. 0 (the coordinator, for now): the window only."""

    # A shift: some tier's count over the window differs from the rate since the last shift by more than
    # SHIFT_Z Poisson standard deviations AND by more than SHIFT_FRACTION of it.
    SHIFT_Z = 3.0
    SHIFT_FRACTION = 0.3

    def __init__(
        self,
        window_ms: float = 5000.0,
        started_ms: float | None = None,
        regime_ms: float = 0.0,
        detect_shifts: bool = False,
    ) -> None:
        assert window_ms > 0 and regime_ms >= 0, "window_ms must be > 0, regime_ms >= 0"
        self.window_ms = window_ms
        self.started_ms = started_ms
        self.regime_ms = regime_ms
        self._events: deque[tuple[float, str, float, float, float, int, int]] = deque()
        self._long: deque[tuple[float, str, float, float, float, int, int]] = deque()  # the last regime_ms
        # When the stream last shifted (see `_detect_shift`); the start of measuring counts as one. None: shifts
        # are not tracked (detect_shifts False: the coordinator for now), and the policy's rules that use them
        # stay off.
        self.detect_shifts = detect_shifts
        self.shift_ms: float | None = started_ms if detect_shifts else None
        self._since_ms = started_ms  # start of the current regime (None: first stats call)
        self._since_counts: dict[str, int] = {}  # arrivals per tier since the regime began

    def add(
        self,
        now_ms: float,
        tier: str,
        ttft_ms: float,
        tpot_ms: float,
        weight: float,
        prompt_tokens: int,
        max_tokens: int,
    ) -> None:
        self._events.append((now_ms, tier, ttft_ms, tpot_ms, weight, prompt_tokens, max_tokens))
        if self.regime_ms > 0 and self.detect_shifts:
            self._long.append(self._events[-1])
        self._since_counts[tier] = self._since_counts.get(tier, 0) + 1

    def _detect_shift(self, now_ms: float, span: float, counts: dict[str, int]) -> None:
        """Compare the window's counts with the regime's mean rate; a significant move starts a new regime
        (at the start of the window, where the new stream began at the latest)."""
        if self._since_ms is None:
            self._since_ms = now_ms - span
            if self.detect_shifts and self.shift_ms is None:
                self.shift_ms = self._since_ms
        if not self.detect_shifts:
            return
        age = now_ms - self._since_ms
        if age < 3 * self.window_ms or span <= 0:
            return  # the regime's own rate is not yet known better than the window's
        for tier in set(counts) | set(self._since_counts):
            expected = self._since_counts.get(tier, 0) / age * span
            got = counts.get(tier, 0)
            if abs(got - expected) > max(self.SHIFT_Z * math.sqrt(expected + 1.0), self.SHIFT_FRACTION * expected):
                # The new regime's rate is measured from here on (the window still mixes in the old one).
                self.shift_ms = now_ms - span
                self._since_ms = now_ms
                self._since_counts = {}
                return

    def stats(self, now_ms: float) -> tuple[ArrivalStats, ...]:
        while self._events and now_ms - self._events[0][0] > self.window_ms:
            self._events.popleft()
        span = self.window_ms
        if self.started_ms is not None:
            span = min(span, now_ms - self.started_ms)
            if span <= 0:
                return ()
        by_tier: dict[str, list] = {}
        for event in self._events:
            by_tier.setdefault(event[1], []).append(event)
        self._detect_shift(now_ms, span, {t: len(e) for t, e in by_tier.items()})
        if self.regime_ms > 0 and self.detect_shifts:
            while self._long and now_ms - self._long[0][0] > self.regime_ms:
                self._long.popleft()
            since = self._since_ms if self._since_ms is not None else now_ms
            steady = min(now_ms - since, self.regime_ms)
            if steady > self.window_ms:
                by_tier = {}
                for event in self._long:
                    if event[0] >= now_ms - steady:
                        by_tier.setdefault(event[1], []).append(event)
                span = steady
        return tuple(
            ArrivalStats.measure(
                tier, span, events[-1][2], events[-1][3], events[-1][4], [(e[5], e[6]) for e in events]
            )
            for tier, events in sorted(by_tier.items())
        )


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
    if isinstance(arrivals, ArrivalWindow):
        stats = arrivals.stats(now_ms)
        shift = arrivals.shift_ms
    else:
        stats = tuple(arrivals or ())
    return ClusterSnapshot(
        now_ms=now_ms, nodes=tuple(ordered), requests=tuple(requests), epoch=epoch, arrivals=stats, load_shift_ms=shift
    )
