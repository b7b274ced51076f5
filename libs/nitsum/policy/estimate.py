"""Goodput estimator: how much weighted goodput a candidate topology would deliver for a node's work.

Two halves:
- `summarize(snap, node, ...)` folds the node's requests (those on its groups plus its share of the
  coordinator queue) into a `NodeLoad`: per tier, the queued requests' remaining TTFT budgets (compressed
  into at most `MAX_BUCKETS` earliest-deadline-first buckets), their mean prompt and output lengths, and
  the running requests' count, context and tokens left. One pass over the requests, done once per decision.
- `evaluate(cost, groups, load, ...)` scores one candidate in O(tiers × distinct (TP, role) classes ×
  buckets) — independent of the number of requests, which is what keeps a decision under a millisecond.

The fluid model (ours; ALGORITHMS.md leaves it open):
1. Decode slots go to tiers in priority order (latency-sensitive first, then by weight), the running
   requests of every tier first (they hold their slots: no preemption); prefill runs in one TTFT-deadline
   order across the tiers, as the engine (engine/tiered.py) and the simulator schedule it.
2. Running requests need decode slots. A group of TP k offers max_decode_batch(k, tightest TPOT assigned to
   it, context) slots (hybrid groups lose a chunk of prefill tokens per step while prefill is pending).
   Latency-sensitive tiers fill the highest-TP groups first, the others the lowest-TP groups first. A
   running request without a slot is projected to miss its TPOT.
3. Queued requests are prefilled by the prefill-capable groups, pooled: with R = Σ 1/service time and L the
   shortest service time, a request has its first token at T + max(L, 1/R), T the pool time taken by the
   requests of any tier ahead of it in EDF order (`edf_prefill`). A hybrid group's service time is its
   chunks beside its decodes, priced as the simulator's step (`hybrid_prefill_ms`). Those within their TTFT budget then need a
   decode slot; slots turn over as running requests finish within the horizon.
4. A request projected to meet both TTFT and TPOT counts weight × (0.5 + 0.5 · the fraction of its
   remaining tokens produced within the horizon): meeting the SLO counts most, finishing sooner breaks ties.
5. Stream (only when the snapshot carries `arrivals`): the requests expected to arrive within the horizon,
   per tier in the same priority order, against the candidate's steady-state capacity. When the streams
   together overload the pool (Σ u ≥ 1), EDF with shedding serves every tier the same fraction 1 / Σ u near
   its deadline instead (a background request near its deadline overtakes a fresh interactive one). A tier's stream uses
   u = rate · mean pooled prefill time of the pool (averaged over its prompt-length quantiles); higher tiers
   have taken U already, so a fraction min(1, (1 − U) / u) of it is served at all. Its queueing delay is the
   M/D/1 wait ρ/(2(1 − ρ)) · mean service at ρ = U + u (unbounded at ρ ≥ 1: the queue grows without end);
   a quantile meets TTFT with the probability that the wait (an atom 1 − ρ at zero, an exponential tail of
   that mean) leaves room for its fastest prefill within the TTFT target. Those need decode
   slots in steady state (Little: rate · output tokens · step time) from what higher streams left. Each one
   projected to meet its SLO counts weight · STREAM_CREDIT. Without this term a layout that is slightly
   overloaded (static TP8 for Llama-3-70B at 20 req/s of Azure conv) looks as good as one that keeps up,
   until its backlog is already hopeless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

from nitsum.policy.costmodel import CostModel
from nitsum.policy.snapshot import ClusterSnapshot, NodeView

MAX_BUCKETS = 8
# A future arrival meeting its SLO counts less than a request already here (it may not come; it finishes
# later within the horizon): the mean of the 0.5 + 0.5 · fraction-done credit of rule 4.
STREAM_CREDIT = 0.75


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


# Smallest prefill chunk a hybrid step carries while prefill is pending: decodes come first, but prefill
# never stalls completely. The simulator's hybrid groups use the same rule (ClusterConfig.min_chunk_tokens).
MIN_CHUNK_TOKENS = 32


def hybrid_chunk_tokens(
    cost: CostModel,
    tp: int,
    tpot_ms: float,
    max_chunk_tokens: int,
    batch: int = 0,
    context_tokens: int = 0,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
) -> int:
    """Sarathi-style SLO-aware token budget: the prefill chunk a hybrid step carries beside `batch` decodes
    (attending to `context_tokens` in all): max_chunk_tokens halved until the step fits tpot_ms, but never
    below min_chunk_tokens. With no decode batch (batch 0) there is no TPOT to protect: the full chunk."""
    if batch <= 0 or math.isinf(tpot_ms):
        return max_chunk_tokens
    key = ("chunk", tp, round(tpot_ms, 3), max_chunk_tokens, batch, context_tokens, min_chunk_tokens)
    hit = cost._memo.get(key)
    if hit is not None:
        return hit
    c = max_chunk_tokens
    floor = min(min_chunk_tokens, max_chunk_tokens)
    while c > floor and cost.step_time_ms(tp, batch + 1, batch + c, context_tokens + c) > tpot_ms:
        c = max(c // 2, floor)
    if len(cost._memo) < 65536:
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
    """Collapse a candidate's groups ((tp, role) pairs or Groups) into interchangeable classes."""
    counts: dict[tuple[int, str], int] = {}
    for g in groups:
        key = (g.tp, g.role) if hasattr(g, "tp") else (g[0], g[1])
        counts[key] = counts.get(key, 0) + 1
    return tuple((tp, role, m) for (tp, role), m in sorted(counts.items()))


def evaluate(
    cost: CostModel,
    classes: tuple[GroupClass, ...],
    load: NodeLoad,
    horizon_ms: float,
    chunk_tokens: int,
    prefill_batch_tokens: int = 0,
    admit_levels: tuple[int, ...] = (),
) -> Estimate:
    """Score one candidate (module docstring). `prefill_batch_tokens` > 0: prefill-role groups run batches of
    that many tokens, so a new request first waits, on average, half such a step (head-of-line delay).
    `admit_levels`: the TP levels admission tries for a best-case TTFT (the node's levels that fit; empty:
    the candidate's): an arriving prompt no level prefills within its target is refused and takes no time."""
    n = len(classes)
    tps = [c[0] for c in classes]
    roles = [c[1] for c in classes]
    mult = [c[2] for c in classes]
    used = [0] * n  # decode slots taken (over all groups of the class)
    cap = [math.inf] * n  # tightest TPOT assigned to the class
    ctx_sum = [0] * n  # KV tokens of the decode slots taken
    entries: list[tuple[int, float, float, float]] = []  # (class, count·weight, tokens left, start offset ms)
    pending_prefill = any(t.queued for t in load.tiers)
    # Hybrid groups size each step's prefill chunk so that the step still meets the tightest TPOT among the
    # decodes it carries (hybrid_chunk_tokens, the simulator's rule too).
    score = 0.0
    misses = 0
    latency_misses = 0
    order_hi = sorted(range(n), key=lambda i: (-tps[i], i))
    order_lo = sorted(range(n), key=lambda i: (tps[i], i))

    def chunk(i: int, pending: bool = False) -> int:
        """Prefill tokens a hybrid group mixes into each decode step (0: none pending, or not hybrid).
        `pending`: as if prefill were pending (the arrival stream brings it even when none is queued now)."""
        if roles[i] != "hybrid" or not (pending_prefill or pending):
            return 0
        b = used[i] // mult[i]
        return hybrid_chunk_tokens(
            cost, tps[i], cap[i], chunk_tokens, b, quantize_tokens(ctx_sum[i] / mult[i]) if b else 0
        )

    prefill_groups = sum(mult[i] for i in range(n) if roles[i] == "prefill")
    backlog_tokens = sum(t.queued * t.prompt_tokens for t in load.tiers) / max(prefill_groups, 1)

    def hol(i: int, p: int) -> float:
        """A prefill group's batch holds what waits when it starts: a new prompt of p tokens first waits, on
        average, half a step of the queue's share per group and itself, at most a full batch (before: always
        half a full batch, which on the measured CPU table is seconds even when one request is queued)."""
        if roles[i] != "prefill" or prefill_batch_tokens <= 0:
            return 0.0
        tokens = quantize_tokens(min(prefill_batch_tokens, max(p, backlog_tokens)))
        return cost.step_time_ms(tps[i], 1, tokens, tokens) / 2.0

    def prefill_ms(i: int, p: int, pending: bool = False) -> float:
        """One prompt of p tokens on a group of class i, stepped as the simulator's groups step it."""
        if roles[i] != "hybrid":
            return cost.prefill_time_ms(tps[i], p)
        b = max(used[i] // mult[i], 1) if used[i] else 0
        if b == 0:
            return cost.prefill_time_ms(tps[i], p, chunk_tokens=chunk_tokens)  # no decodes: full chunks
        ctx = quantize_tokens(ctx_sum[i] / mult[i])
        return hybrid_prefill_ms(cost, tps[i], p, max(chunk(i, pending), 1), b, ctx)

    def pool(p: int) -> tuple[float, float]:
        """(prompts of p tokens per ms the prefill-capable groups complete together, the fastest one's ms)."""
        rate, shortest = 0.0, math.inf
        for i in range(n):
            if roles[i] != "decode":
                s = prefill_ms(i, p)
                rate += mult[i] / s
                shortest = min(shortest, s + hol(i, p))
        return rate, shortest

    def slots(i: int, tpot: float, ctx: int) -> int:
        # Decodes come first: a hybrid step keeps only the minimum chunk beside a full decode batch.
        extra = MIN_CHUNK_TOKENS if roles[i] == "hybrid" and pending_prefill else 0
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

    # 1. running requests keep decoding: they hold their slots (no preemption), whatever their tier.
    got_running: dict[str, int] = {}
    for t in load.tiers:
        placed = place(t, t.running, t.running_ctx_tokens, order_hi if t.latency_sensitive else order_lo)
        got_running[t.tier] = sum(k for _, k in placed)
        for i, k in placed:
            entries.append((i, k * t.weight, t.running_left_tokens, 0.0))
    # 2. queued requests: pooled prefill in one earliest-TTFT-deadline order across the tiers, as the engine
    # (engine/tiered.py) and the simulator schedule it.
    prefill = edf_prefill(load.tiers, pool)
    for t in load.tiers:
        order = order_hi if t.latency_sensitive else order_lo
        got = got_running[t.tier]
        lost = t.running - got
        met, offset = prefill.get(t.tier, (0, 0.0))
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
    # 5. the arrival stream over the horizon, against steady-state capacity.
    if load.streams:
        s_score, s_misses = _stream(
            cost,
            load.streams,
            tps,
            roles,
            mult,
            used,
            slots,
            order_hi,
            order_lo,
            horizon_ms,
            prefill_ms,
            hol,
            admit_levels or tuple(sorted(set(tps))),
        )
        score += s_score
        misses += s_misses
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


def _p_wait_within(x_ms: float, rho: float, mean_wait_ms: float) -> float:
    """P(queueing wait <= x) for utilisation rho and mean wait (module docstring, rule 5)."""
    if x_ms < 0 or rho >= 1.0 or math.isinf(mean_wait_ms):  # (callers pass rho < 1)
        return 0.0
    if rho <= 0 or mean_wait_ms <= 0:
        return 1.0
    return 1.0 - rho * math.exp(-x_ms * rho / mean_wait_ms)


def _stream(
    cost: CostModel,
    streams: tuple[StreamLoad, ...],
    tps: list[int],
    roles: list[str],
    mult: list[int],
    used: list[int],
    slots,
    order_hi: list[int],
    order_lo: list[int],
    horizon_ms: float,
    prefill_ms,
    hol,
    admit_levels: tuple[int, ...] = (),
) -> tuple[float, int]:
    """Rule 5 of the module docstring: (score, expected misses) of the arrivals within the horizon."""
    n = len(tps)
    pools = []
    for st in streams:
        # admission.admit refuses what no level prefills within the target even with nothing queued
        admitted = [min(cost.prefill_time_ms(k, p) for k in admit_levels) <= st.ttft_ms for p in st.prompt_tokens]
        pools.append(_stream_pool(st, tps, roles, mult, used, slots, prefill_ms, hol, admitted))
    total = sum(st.rate_per_ms * pool[0] for st, pool in zip(streams, pools, strict=True))
    # Overloaded (the streams together need more prefill time than the pool has): prefill runs in TTFT-deadline
    # order across the tiers (engine/tiered.py, the simulator), and shedding drops what can no longer meet its
    # target, so every tier is served near its deadline in the same proportion 1 / ρ: background requests near
    # their deadline overtake fresh interactive ones. Below saturation the tighter targets come first.
    edf_overload = total >= 1.0
    util = 0.0  # prefill-pool time fraction taken by higher-priority streams
    slots_taken = [0.0] * n  # steady-state decode slots taken by higher-priority streams
    score = 0.0
    misses = 0.0
    for st, (mean_service, split, group_ms) in zip(streams, pools, strict=True):
        order = order_hi if st.latency_sensitive else order_lo
        expected = st.rate_per_ms * horizon_ms
        u = st.rate_per_ms * mean_service
        if u <= 0 or math.isinf(u) or not any(split):
            misses += expected
            continue
        if edf_overload:
            served, rho, wait = 1.0 / total, 1.0 - 1e-9, None
        else:
            served = min(1.0, max(1.0 - util, 0.0) / u)
            rho = util + u
            if rho < 1.0:
                # Routing sends each request to one group when it arrives (the coordinator and the simulator
                # alike: no shared queue), so every group is its own queue at the pool's utilisation: a
                # request waits on the scale of its group's prefill time, not of the pool's completion interval.
                wait = rho / (2.0 * (1.0 - rho))
            else:
                # Overloaded: the pool serves the fraction `served` at capacity, and admission and shedding keep
                # the queue of what is admitted at most about a TTFT target deep (the rest is refused), so the
                # served part waits about half a target. Scoring it 0 (an unbounded queue) made every
                # overloaded layout look the same, the one with twice the capacity included.
                rho, wait = 1.0 - 1e-9, None
        # The waiting time's distribution, not only its mean: an atom 1 − ρ at zero and an exponential tail
        # of the same mean (P(W > x) = ρ·exp(−x·ρ / E[W])). With the mean alone every quantile flipped from
        # "in time" to "late" at once as ρ crossed a threshold: the cliff that made near-saturated layouts
        # look alternately hopeless and fine from one epoch to the next.
        in_time = _in_time(st.ttft_ms, rho, wait, split, group_ms)
        util = min(util + u, 1.0)
        # Decode, steady state (Little): the served-in-time part keeps rate · output tokens · step slots busy.
        # A full class steps at about the TPOT target (max_decode_batch sizes it so), hence tokens/ms per
        # slot = 1 / TPOT: conservative when the class is not full.
        demand = st.rate_per_ms * served * in_time * st.output_tokens  # tokens/ms
        left = demand
        ctx = quantize_tokens(sum(st.prompt_tokens) / len(st.prompt_tokens) + st.output_tokens / 2.0)
        for i in order:
            if left <= 0:
                break
            if roles[i] == "prefill":
                continue
            free = max(slots(i, st.tpot_ms, ctx) - slots_taken[i], 0.0)
            take = min(free / st.tpot_ms, left)
            slots_taken[i] += take * st.tpot_ms
            left -= take
        decoded = 1.0 if demand <= 0 else 1.0 - left / demand
        good = expected * served * in_time * decoded
        score += st.weight * good * STREAM_CREDIT
        misses += expected - good
    return score, int(round(misses))


def _stream_pool(st: StreamLoad, tps, roles, mult, used, slots, prefill_ms, hol, admitted: list[bool]):
    """(mean pooled prefill time per arriving request of the stream, per prompt quantile [(share, ms)] over the
    prefill classes: the fraction of the quantile's requests a class takes (its completion rate's share) and
    its prefill time, head-of-line delay included; and per class its mean prefill time). A quantile admission
    refuses (`admitted` False) takes no prefill time and has no share anywhere (all of it misses)."""
    inv_rates = []  # mean time between completions of the pool, per prompt quantile
    split = []
    service = [0.0] * len(tps)
    n_ok = max(sum(admitted), 1)
    for p, ok in zip(st.prompt_tokens, admitted, strict=True):
        if not ok:
            inv_rates.append(0.0)
            split.append([])
            continue
        rate = 0.0
        parts = []
        for i in range(len(tps)):
            if roles[i] == "decode":
                continue
            # The stream brings prefill work whether or not any is queued now: the chunk a hybrid step carries
            # beside its decodes (pending=True; with none, an idle queue priced a prompt at one token per step).
            s = prefill_ms(i, p, True)
            r_i = mult[i] / s
            if roles[i] == "hybrid":
                # A hybrid group decodes what it prefills: in steady state it can take on no more requests
                # than its decode slots turn over (Llama-3-70B TP2 on H100 holds ~8 k KV tokens).
                turnover = slots(i, st.tpot_ms, quantize_tokens(p + st.output_tokens / 2.0)) / max(
                    st.output_tokens * st.tpot_ms, 1.0
                )
                r_i = min(r_i, turnover)
            rate += r_i
            parts.append((i, r_i, s + hol(i, p)))
            service[i] += s / n_ok
        inv_rates.append(1.0 / rate if rate > 0 else math.inf)
        split.append([(i, r_i / rate, ms) for i, r_i, ms in parts] if rate > 0 else [])
    return sum(inv_rates) / len(inv_rates), split, service


def _in_time(ttft_ms: float, rho: float, wait: float | None, split, group_ms: list[float]) -> float:
    """Fraction of a stream's requests with their first token within ttft_ms: per prompt quantile, over the
    classes in proportion to what each completes, the chance that its queue's wait leaves room for its
    prefill. `wait`: the mean wait in units of the class's mean prefill time; None: overloaded (admission and
    shedding keep the admitted queue about a TTFT target deep, so the served part waits about half a target)."""
    total = 0.0
    for parts in split:
        for i, share, ms in parts:
            # Shedding drops a queued request once it cannot meet its target, so what is served waited at most
            # about a target, half of one on average, at any utilisation: near ρ = 1 the M/D/1 mean alone made
            # a layout look far worse just below saturation than just above it (a flip at 79 s of a steady
            # background window, measured).
            mean_wait = ttft_ms / 2.0 if wait is None else min(wait * group_ms[i], ttft_ms / 2.0)
            total += share * _p_wait_within(ttft_ms - ms, rho, mean_wait)
    return total / len(split) if split else 0.0


def hybrid_prefill_ms(cost: CostModel, tp: int, prompt: int, chunk: int, batch: int, decode_ctx: int) -> float:
    """A prompt prefilled in `chunk`-token pieces beside `batch` decodes (attending to `decode_ctx` tokens),
    as the simulator's hybrid step prices it: the prefilling sequence counts in the batch, and each chunk also
    attends to the prompt prefilled so far (on average half of it)."""
    steps = -(-prompt // chunk)
    ctx = decode_ctx + quantize_tokens(prompt / 2.0 + chunk / 2.0)
    return steps * cost.step_time_ms(tp, batch + 1, batch + chunk, ctx)


def edf_prefill(tiers, pool) -> dict[str, tuple[int, float]]:
    """Queued requests of every tier prefilled by the pool in one earliest-TTFT-deadline order (the engine's
    and the simulator's order): per tier (requests whose first token is projected within their budget, mean
    offset ms of their first tokens). `pool(prompt_tokens)` -> (completions per ms, fastest prefill ms).
    Late requests still take their prefill time (they are first in EDF order: their deadline has passed)."""
    items = []
    pools = {}
    for k, t in enumerate(tiers):
        if t.queued:
            pools[t.tier] = pool(t.prompt_tokens)
            items.extend((budget, k, count, t.tier) for budget, count in t.buckets)
    items.sort(key=lambda x: (x[0], x[1]))
    clock = 0.0  # pool time consumed by the requests ahead in EDF order
    met: dict[str, int] = {}
    span: dict[str, list[float]] = {}
    for budget, _, count, tier in items:
        rate, shortest = pools[tier]
        if rate <= 0:
            continue
        if budget >= shortest:
            # The k-th request from here has its first token at clock + k / rate (the pool's fluid drain).
            met[tier] = met.get(tier, 0) + min(max(int((budget - clock) * rate), 0), count)
        span.setdefault(tier, [clock, clock])
        clock += count / rate
        span[tier][1] = clock
    out = {}
    for tier, (first, last) in span.items():
        out[tier] = (met.get(tier, 0), first + max(pools[tier][1], (last - first) / 2.0))
    return out
