"""Goodput estimator: how much weighted goodput a candidate topology would deliver for a node's work.

Two halves:
- `summarize(snap, node, ...)` folds the node's requests (those on its groups plus its share of the
  coordinator queue) into a `NodeLoad`: per tier, the queued requests' remaining TTFT budgets (compressed
  into at most `MAX_BUCKETS` earliest-deadline-first buckets), their mean prompt and output lengths, and
  the running requests' count, context and tokens left. One pass over the requests, done once per decision.
- `evaluate(cost, groups, load, ...)` scores one candidate in O(tiers × distinct (TP, role) classes ×
  buckets) — independent of the number of requests, which is what keeps a decision under a millisecond.

The fluid model (ours; ALGORITHMS.md leaves it open):
1. Tiers are served in priority order: latency-sensitive first, then by weight.
2. Running requests need decode slots. A group of TP k offers max_decode_batch(k, tightest TPOT assigned to
   it, context) slots (hybrid groups lose a chunk of prefill tokens per step while prefill is pending).
   Latency-sensitive tiers fill the highest-TP groups first, the others the lowest-TP groups first. A
   running request without a slot is projected to miss its TPOT.
3. Queued requests are prefilled by the prefill-capable groups, pooled: with R = Σ 1/service time and L the
   shortest service time, the n-th request (EDF order) has its first token at base + max(L, n/R), where
   base is the prefill time already claimed by higher tiers. Those within their TTFT budget then need a
   decode slot; slots turn over as running requests finish within the horizon.
4. A request projected to meet both TTFT and TPOT counts weight × (0.5 + 0.5 · the fraction of its
   remaining tokens produced within the horizon): meeting the SLO counts most, finishing sooner breaks ties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

from nitsum.policy.costmodel import CostModel
from nitsum.policy.snapshot import ClusterSnapshot, NodeView

MAX_BUCKETS = 8


def quantize_tokens(n: float) -> int:
    """Round up to an eighth of an octave, so cost-model memo keys repeat across snapshots."""
    if n <= 16:
        return max(int(math.ceil(n)), 1)
    return int(math.ceil(2.0 ** (math.ceil(8.0 * math.log2(n)) / 8.0)))


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
class NodeLoad:
    tiers: tuple[TierLoad, ...]  # priority order
    # KV tokens of the requests running on each group (what a reconfiguration of that group must move).
    kv_tokens_by_group: tuple[tuple[str, int], ...] = ()

    @property
    def idle(self) -> bool:
        return all(t.queued == 0 and t.running == 0 for t in self.tiers)

    def latency_queued(self) -> int:
        return sum(t.queued for t in self.tiers if t.latency_sensitive)

    def latency_work(self) -> int:
        return sum(t.queued + t.running for t in self.tiers if t.latency_sensitive)

    def throughput_queued(self) -> int:
        return sum(t.queued for t in self.tiers if not t.latency_sensitive)


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
        tiers.append(TierLoad(
            tier=name, weight=first.weight, latency_sensitive=first.ttft_ms <= latency_ttft_ms,
            tpot_ms=sum(map(_TPOT, rs)) / len(rs),
            queued=int(round(q_w)), buckets=_buckets(budgets, q_w / nq if nq else 1.0),
            prompt_tokens=quantize_tokens((sum(map(_PROMPT, queued)) - sum(map(_CACHED, queued))) / nq) if nq else 1,
            queued_out_tokens=sum(map(_MAX, queued)) / nq if nq else 0.0,
            running=nr,
            running_ctx_tokens=quantize_tokens((sum(map(_PROMPT, running)) + sum(map(_OUT, running))) / nr) if nr else 1,
            running_left_tokens=(sum(map(_MAX, running)) - sum(map(_OUT, running))) / nr if nr else 0.0,
        ))
    tiers.sort(key=lambda t: (not t.latency_sensitive, -t.weight, t.tier))
    kv: dict[str, int] = {}
    for rs in running_lists:
        for r in rs:
            kv[r.group_id] = kv.get(r.group_id, 0) + r.prompt_tokens + r.output_tokens
    return NodeLoad(tuple(tiers), tuple(sorted(kv.items())))


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


def hybrid_chunk_tokens(cost: CostModel, tp: int, tpot_ms: float, max_chunk_tokens: int) -> int:
    """Largest power-of-two prefill chunk (≤ max_chunk_tokens, ≥ 16) whose step with one decode sequence
    takes at most 2/3 of tpot_ms, leaving the rest for the decode batch (Sarathi-style token budget)."""
    key = ("chunk", tp, round(tpot_ms, 3), max_chunk_tokens)
    hit = cost._memo.get(key)
    if hit is not None:
        return hit
    c = max_chunk_tokens
    while c > 16 and cost.step_time_ms(tp, 1, 1 + c, c) > tpot_ms * 2.0 / 3.0:
        c //= 2
    cost._memo[key] = c
    return c


@dataclass(frozen=True)
class Estimate:
    score: float  # weighted goodput estimate (see module docstring)
    latency_misses: int  # latency-sensitive requests projected to miss TTFT or TPOT
    misses: int  # all requests projected to miss


# One (tp, role, multiplicity) class of interchangeable groups in a candidate.
GroupClass = tuple[int, str, int]


def classes_of(groups) -> tuple[GroupClass, ...]:
    """Collapse a candidate's groups ((tp, role) pairs or GroupSpecs) into interchangeable classes."""
    counts: dict[tuple[int, str], int] = {}
    for g in groups:
        key = (g.tp, g.role) if hasattr(g, "tp") else (g[0], g[1])
        counts[key] = counts.get(key, 0) + 1
    return tuple((tp, role, m) for (tp, role), m in sorted(counts.items()))


def evaluate(cost: CostModel, classes: tuple[GroupClass, ...], load: NodeLoad, horizon_ms: float,
             chunk_tokens: int) -> Estimate:
    n = len(classes)
    tps = [c[0] for c in classes]
    roles = [c[1] for c in classes]
    mult = [c[2] for c in classes]
    used = [0] * n  # decode slots taken (over all groups of the class)
    cap = [math.inf] * n  # tightest TPOT assigned to the class
    busy_ms = [0.0] * n  # prefill time claimed per group of the class
    ctx_sum = [0] * n  # KV tokens of the decode slots taken
    entries: list[tuple[int, float, float, float]] = []  # (class, count·weight, tokens left, start offset ms)
    pending_prefill = any(t.queued for t in load.tiers)
    # Hybrid groups size their prefill chunks so that decode steps still meet the tightest TPOT around.
    tightest_tpot = min((t.tpot_ms for t in load.tiers), default=math.inf)
    score = 0.0
    misses = 0
    latency_misses = 0
    order_hi = sorted(range(n), key=lambda i: (-tps[i], i))
    order_lo = sorted(range(n), key=lambda i: (tps[i], i))

    def chunk(i: int) -> int:
        """Prefill tokens a hybrid group mixes into each decode step (0: none pending, or not hybrid)."""
        if roles[i] != "hybrid" or not pending_prefill:
            return 0
        return hybrid_chunk_tokens(cost, tps[i], min(cap[i], tightest_tpot), chunk_tokens)

    def slots(i: int, tpot: float, ctx: int) -> int:
        extra = 0 if roles[i] != "hybrid" or not pending_prefill else hybrid_chunk_tokens(
            cost, tps[i], min(tpot, tightest_tpot), chunk_tokens)
        return mult[i] * cost.max_decode_batch(tps[i], tpot, ctx, extra)

    def place(t: TierLoad, count: int, ctx: int, order: list[int]) -> list[tuple[int, int]]:
        """Give `count` requests of tier t decode slots; returns [(class, taken)]."""
        out = []
        for i in order:
            if count <= 0:
                break
            if roles[i] == "prefill":
                continue
            tpot = min(cap[i], t.tpot_ms)
            free = slots(i, tpot, ctx) - used[i]
            take = min(count, free)
            if take > 0:
                used[i] += take
                ctx_sum[i] += take * ctx
                cap[i] = tpot
                out.append((i, take))
                count -= take
        return out

    for t in load.tiers:
        order = order_hi if t.latency_sensitive else order_lo
        # 1. running requests keep decoding.
        placed = place(t, t.running, t.running_ctx_tokens, order)
        got = sum(k for _, k in placed)
        for i, k in placed:
            entries.append((i, k * t.weight, t.running_left_tokens, 0.0))
        lost = t.running - got
        # 2. queued requests: pooled prefill, EDF.
        if t.queued:
            rate = 0.0
            base_acc = 0.0
            shortest = math.inf
            service = [0.0] * n
            for i in order:
                if roles[i] == "decode":
                    continue
                s = cost.prefill_time_ms(tps[i], t.prompt_tokens)
                if roles[i] == "hybrid" and used[i] > 0:
                    # Chunked prefill shares steps with this class's decode batch.
                    per_group = max(used[i] // mult[i], 1)
                    c = max(chunk(i), 1)
                    steps = -(-t.prompt_tokens // c)
                    s = steps * cost.step_time_ms(tps[i], per_group, per_group + c,
                                                  per_group * t.running_ctx_tokens + c)
                service[i] = s
                r_i = mult[i] / s
                rate += r_i
                base_acc += r_i * busy_ms[i]
                shortest = min(shortest, s)
            met = 0
            if rate > 0:
                base = base_acc / rate
                cum = 0
                for budget, count in t.buckets:
                    if budget >= base + shortest:
                        ok = int((budget - base) * rate) - cum
                        met += min(max(ok, 0), count)
                    cum += count
                # Every queued request takes prefill time, late or not; the pool drains together.
                drain_ms = t.queued / rate
                for i in range(n):
                    if service[i] > 0:
                        busy_ms[i] += drain_ms
                offset = base + max(shortest, t.queued / rate / 2.0)
            else:
                offset = 0.0
            # 3. the ones in time need a decode slot; running work turning over frees slots.
            ctx = quantize_tokens(t.prompt_tokens + t.queued_out_tokens / 2.0)
            if met:
                placed = place(t, met, ctx, order)
                got_q = sum(k for _, k in placed)
                for i, k in placed:
                    entries.append((i, k * t.weight, t.queued_out_tokens, offset))
                # Slots freed by finishing running requests (at most as many as run now) serve the
                # rest in time, but they finish past the horizon: half credit.
                turnover = min(met - got_q, got)
                score += turnover * t.weight * 0.5
                lost += t.queued - got_q - turnover
            else:
                lost += t.queued
        misses += lost
        if t.latency_sensitive:
            latency_misses += lost
    # 4. credit, with the step time each class ends up with.
    step = [0.0] * n
    for i in range(n):
        if used[i]:
            b = max(used[i] // mult[i], 1)
            extra = chunk(i)
            ctx = quantize_tokens(ctx_sum[i] / mult[i])
            step[i] = cost.step_time_ms(tps[i], b, b + extra, ctx + extra)
    for i, w, left, offset in entries:
        tokens = max(horizon_ms - offset, 0.0) / step[i] if step[i] > 0 else 0.0
        frac = 1.0 if left <= 0 else min(1.0, tokens / left)
        score += w * (0.5 + 0.5 * frac)
    return Estimate(score, latency_misses, misses)
