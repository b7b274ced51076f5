"""A node's load, summarized once per decision for the goodput estimator (estimate.py): per tier, the queued
requests' remaining TTFT budgets in at most `MAX_BUCKETS` earliest-deadline-first buckets, their mean prompt and
output lengths, the running requests' count, context and tokens left; and the arrival streams expected."""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

from nitsum.policy.snapshot import ClusterSnapshot, NodeView

MAX_BUCKETS = 8


def quantize_tokens(n: float) -> int:
    """Round up to an eighth of an octave (the grid's values rounded up to integers), so cost-model memo keys
    repeat across snapshots. Idempotent: a quantized count stays where it is when quantized again (a grid value
    rounded up lies just above its octave point, which rounding up by the logarithm alone took to the next one)."""
    if n <= 16:
        return max(int(math.ceil(n)), 1)
    k = math.ceil(8.0 * math.log2(n))
    below = math.ceil(2.0 ** ((k - 1) / 8.0))
    return int(below) if below >= n else int(math.ceil(2.0 ** (k / 8.0)))


@dataclass(frozen=True)
class TierLoad:
    tier: str
    weight: float
    latency_sensitive: bool
    tpot_ms: float  # mean TPOT target of the tier's requests (per-request overrides averaged)
    queued: int
    buckets: tuple[tuple[float, int], ...]  # (smallest remaining TTFT budget in bucket ms, count), EDF order
    prompt_tokens: int  # mean uncached prompt tokens of queued (quantized)
    queued_out_tokens: float  # mean max_tokens of queued
    running: int
    running_ctx_tokens: int  # mean context of running (quantized)
    running_left_tokens: float  # mean tokens still to generate


@dataclass(frozen=True)
class StreamLoad:
    """One tier's expected arrivals (from the snapshot's ArrivalStats, scaled by the node's share)."""

    tier: str
    weight: float
    latency_sensitive: bool
    rate_per_ms: float
    ttft_ms: float
    tpot_ms: float
    prompt_tokens: tuple[int, ...]  # quantized equal-mass quantiles
    output_tokens: float


@dataclass(frozen=True)
class NodeLoad:
    tiers: tuple[TierLoad, ...]  # priority order
    # KV tokens of the requests running on each group (what a reconfiguration of that group must move).
    kv_tokens_by_group: tuple[tuple[str, int], ...] = ()
    streams: tuple[StreamLoad, ...] = ()  # priority order; empty when the snapshot has no arrivals

    @property
    def idle(self) -> bool:
        return all(t.queued == 0 and t.running == 0 for t in self.tiers)

    def latency_queued(self) -> int:
        return sum(t.queued for t in self.tiers if t.latency_sensitive)

    def latency_work(self) -> int:
        return sum(t.queued + t.running for t in self.tiers if t.latency_sensitive)

    def throughput_queued(self) -> int:
        return sum(t.queued for t in self.tiers if not t.latency_sensitive)

    def throughput_work(self) -> int:
        return sum(t.queued + t.running for t in self.tiers if not t.latency_sensitive)


_TIER = attrgetter("tier")
_PROMPT = attrgetter("prompt_tokens")
_CACHED = attrgetter("cached_prompt_tokens")
_MAX = attrgetter("max_tokens")
_OUT = attrgetter("output_tokens")
_TPOT = attrgetter("tpot_ms")
_DEADLINE = attrgetter("arrival_ms", "ttft_ms")


def summarize(snap: ClusterSnapshot, node: NodeView, latency_ttft_ms: float) -> NodeLoad:
    """Written with comprehensions and map() over attrgetters: this pass is most of a decision's time."""
    now = snap.now_ms
    if len(snap.nodes) == 1:
        reqs = snap.requests
        from_coordinator = 0
        share = 1.0
    else:
        # The coordinator queue is spread evenly over the nodes.
        gids = {g.group_id for g in node.groups}
        reqs = [r for r in snap.requests if r.group_id is None or r.group_id in gids]
        from_coordinator = sum(1 for r in reqs if r.group_id is None)
        share = 1.0 / len(snap.nodes)
    by_tier: dict[str, list] = {}
    for r in reqs:
        lst = by_tier.get(r.tier)
        if lst is None:
            by_tier[r.tier] = [r]
        else:
            lst.append(r)
    tiers = []
    running_lists = []
    for name, rs in by_tier.items():
        first = rs[0]
        queued = [r for r in rs if r.first_token_ms is None]
        running = [r for r in rs if r.first_token_ms is not None] if len(queued) < len(rs) else []
        nq, nr = len(queued), len(running)
        running_lists.append(running)
        q_w = float(nq)
        if from_coordinator:
            q_w -= (1.0 - share) * sum(1 for r in queued if r.group_id is None)
        budgets = [a + t - now for a, t in map(_DEADLINE, queued)]
        tiers.append(
            TierLoad(
                tier=name,
                weight=first.weight,
                latency_sensitive=first.ttft_ms <= latency_ttft_ms,
                tpot_ms=sum(map(_TPOT, rs)) / len(rs),
                queued=int(round(q_w)),
                buckets=_buckets(budgets, q_w / nq if nq else 1.0),
                prompt_tokens=quantize_tokens((sum(map(_PROMPT, queued)) - sum(map(_CACHED, queued))) / nq)
                if nq
                else 1,
                queued_out_tokens=sum(map(_MAX, queued)) / nq if nq else 0.0,
                running=nr,
                running_ctx_tokens=quantize_tokens((sum(map(_PROMPT, running)) + sum(map(_OUT, running))) / nr)
                if nr
                else 1,
                running_left_tokens=(sum(map(_MAX, running)) - sum(map(_OUT, running))) / nr if nr else 0.0,
            )
        )
    tiers.sort(key=lambda t: (not t.latency_sensitive, -t.weight, t.tier))
    kv: dict[str, int] = {}
    for rs in running_lists:
        for r in rs:
            if r.group_id is None:
                continue  # prefilled, between groups (a P/D hand-off in flight): no group holds its KV yet
            kv[r.group_id] = kv.get(r.group_id, 0) + r.prompt_tokens + r.output_tokens
    # Routing spreads arrivals over the nodes: each node expects its share of the stream.
    node_share = 1.0 / len(snap.nodes)
    streams = [
        StreamLoad(
            a.tier,
            a.weight,
            a.ttft_ms <= latency_ttft_ms,
            a.rate_per_s * node_share / 1e3,
            a.ttft_ms,
            a.tpot_ms,
            tuple(quantize_tokens(p) for p in a.prompt_tokens),
            a.output_tokens,
        )
        for a in snap.arrivals
        if a.rate_per_s > 0 and a.prompt_tokens
    ]
    streams.sort(key=lambda t: (not t.latency_sensitive, -t.weight, t.tier))
    return NodeLoad(tuple(tiers), tuple(sorted(kv.items())), tuple(streams))


def _buckets(budgets: list[float], scale: float) -> tuple[tuple[float, int], ...]:
    if not budgets:
        return ()
    budgets.sort()
    n = len(budgets)
    per = -(-n // MAX_BUCKETS)
    out = []
    for i in range(0, n, per):
        count = min(per, n - i)
        # Smallest budget in the bucket: conservative for every request in it.
        out.append((budgets[i], max(int(round(count * scale)), 1 if scale >= 1.0 else 0)))
    return tuple(out)
