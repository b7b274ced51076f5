"""Goodput estimator: how much weighted goodput a candidate topology would deliver for a node's work.

Two halves:
- `summarize(snap, node, ...)` (nodeload.py) folds the node's requests (those on its groups plus its share of the
  coordinator queue) into a `NodeLoad`: per tier, the queued requests' remaining TTFT budgets (compressed
  into at most `MAX_BUCKETS` earliest-deadline-first buckets), their mean prompt and output lengths, and
  the running requests' count, context and tokens left. One pass over the requests, done once per decision.
- `evaluate(cost, groups, load, ...)` scores one candidate in O(tiers × distinct (TP, role) classes ×
  buckets) — independent of the number of requests, which is what keeps a decision under a millisecond.

The fluid model (ours; ALGORITHMS.md leaves it open):
1. Decode slots go to tiers in priority order (latency-sensitive first, then by weight), the running
   requests of every tier first (they hold their slots: no preemption); prefill runs in one TTFT-deadline
   order across the tiers, as the engine (engine/tiered.py) and the simulator schedule it.
2. Running requests need decode slots. A group of TP k offers max_decode_batch(k, TPOT, context) slots at a
   TPOT (hybrid groups lose a chunk of prefill tokens per step while prefill is pending). Latency-sensitive
   tiers fill the highest-TP groups first, the others the lowest-TP groups first, each up to the slots at
   its own TPOT (routing checks a decode's own slack); the running requests that find no room still decode
   (they are in a batch now) on the classes they can reach, and a request meets its TPOT only if its class's
   whole batch fits the slots its TPOT allows (rule 17, decodeload.py).
3. Queued requests are prefilled by the prefill-capable groups, pooled: with R = Σ 1/service time and L the
   shortest service time, a request has its first token at T + max(L, 1/R), T the pool time taken by the
   requests of any tier ahead of it in EDF order (`edf_prefill`). A hybrid group's service time is its
   chunks beside its decodes, priced as the simulator's step (`hybrid_prefill_ms`). Those within their TTFT budget then need a
   decode slot; slots turn over as running requests finish within the horizon.
4. A request projected to meet both TTFT and TPOT counts weight × (0.5 + 0.5 · the fraction of its
   remaining tokens produced within the horizon): meeting the SLO counts most, finishing sooner breaks ties.
5. Stream (stream.py; only when the snapshot carries `arrivals`): the requests expected to arrive within the horizon,
   per tier in the same priority order, against the candidate's steady-state capacity. When the streams
   together overload the pool (Σ u ≥ 1), EDF with shedding serves every tier the same fraction 1 / Σ u near
   its deadline instead (a background request near its deadline overtakes a fresh interactive one). A tier's stream uses
   u = rate · mean pooled prefill time of the pool (averaged over its prompt-length quantiles); higher tiers
   have taken U already, so a fraction min(1, (1 − U) / u) of it is served at all. Its queueing delay is the
   M/D/1 wait ρ/(2(1 − ρ)) · mean service at ρ = U + u (unbounded at ρ ≥ 1: the queue grows without end);
   a quantile meets TTFT with the probability that the wait (an atom 1 − ρ at zero, an exponential tail of
   that mean) leaves room for its fastest prefill within the TTFT target. A prefill group's prompts are
   priced in the batch the arrivals make it run (rule 18, stream.prefill_batch). What is prefilled in time
   decodes in steady state on the classes its tier prefers, overflowing (never refused) past their room at its
   TPOT; it meets its TPOT as often as its class's batch, Poisson with Little's mean, fits its TPOT (rule 17,
   decodeload.DecodeLoad); on a hybrid class those steps carry the minimum prefill chunk, since the streams keep
   its prefill pending whatever is queued now (rule 21). Each one projected to meet its SLO counts weight ·
   STREAM_CREDIT (`Estimate.stream` names this part of the score). Without this term a layout that is slightly overloaded (static TP8 for
   Llama-3-70B at 20 req/s of Azure conv) looks as good as one that keeps up, until its backlog is already
   hopeless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nitsum.policy.costmodel import CostModel
from nitsum.policy.nodeload import MAX_BUCKETS, NodeLoad, StreamLoad, TierLoad, quantize_tokens, summarize
from nitsum.policy.stream import STREAM_CREDIT, stream_estimate

__all__ = [
    "MAX_BUCKETS",
    "MIN_CHUNK_TOKENS",
    "STREAM_CREDIT",
    "Estimate",
    "GroupClass",
    "NodeLoad",
    "StreamLoad",
    "TierLoad",
    "classes_of",
    "edf_prefill",
    "evaluate",
    "hybrid_chunk_tokens",
    "hybrid_prefill_ms",
    "quantize_tokens",
    "summarize",
]


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
    stream: float = 0.0  # the part of `score` the arrival stream brings (rule 5): it recurs every horizon


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
    detail: list | None = None,
) -> Estimate:
    """Score one candidate (module docstring). `prefill_batch_tokens` > 0: prefill-role groups run batches of
    that many tokens, so a new request first waits, on average, half such a step (head-of-line delay).
    `admit_levels`: the TP levels admission tries for a best-case TTFT (the node's levels that fit; empty:
    the candidate's): an arriving prompt no level prefills within its target is refused and takes no time.
    `detail`: a list that gets the stream's terms per tier (stream.StreamTerms), for studies of the estimate."""
    n = len(classes)
    tps = [c[0] for c in classes]
    roles = [c[1] for c in classes]
    mult = [c[2] for c in classes]
    used = [0] * n  # decode slots taken (over all groups of the class)
    cap = [math.inf] * n  # tightest TPOT assigned to the class
    ctx_sum = [0] * n  # KV tokens of the decode slots taken
    entries: list[tuple[int, int, TierLoad, float, float]] = []  # (class, count, tier, tokens left, offset ms)
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
    queued = sum(t.queued for t in load.tiers)
    backlog_prompt = sum(t.queued * t.prompt_tokens for t in load.tiers) / queued if queued else 0.0

    def hol(i: int, p: int) -> float:
        """A prefill group's batch holds what waits when it starts: a new prompt of p tokens first waits, on
        average, half a step of the queue's share per group and itself, at most a full batch (before: always
        half a full batch, which on the measured CPU table is seconds even when one request is queued)."""
        if roles[i] != "prefill" or prefill_batch_tokens <= 0:
            return 0.0
        tokens = quantize_tokens(min(prefill_batch_tokens, max(p, backlog_tokens)))
        # the batch's prompts as the simulator steps them: one sequence each (rule 18), not one long sequence
        # (on the measured CPU table 8,192 tokens as one sequence take 8.5 s, as eight 1 k prompts 2.5 s)
        seqs = max(round(tokens / max(backlog_prompt, p, 1)), 1)
        return cost.step_time_ms(tps[i], seqs, tokens, tokens) / 2.0

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

    def place(t: TierLoad, count: int, ctx: int, order: list[int], overflow: bool) -> list[tuple[int, int]]:
        """Give `count` requests of tier t decode slots within the room at their own TPOT; with `overflow` the
        rest join the batches of the classes they can reach anyway, in proportion to their groups (rule 17:
        routing never refuses a decode, it slows the batch). Returns [(class, taken)]."""
        out = []
        reach = [i for i in order if roles[i] != "prefill"]
        for i in reach:
            if count <= 0:
                break
            # Routing checks a decode's own slack only (its TPOT), not that of the decodes already there.
            take = min(count, slots(i, t.tpot_ms, ctx) - used[i])
            if take > 0:
                used[i] += take
                ctx_sum[i] += take * ctx
                cap[i] = min(cap[i], t.tpot_ms)
                out.append((i, take))
                count -= take
        groups = sum(mult[i] for i in reach)
        left = count if overflow else 0
        for j, i in enumerate(reach):
            if left <= 0:
                break
            take = left if j == len(reach) - 1 else min(-(-count * mult[i] // groups), left)
            used[i] += take
            ctx_sum[i] += take * ctx
            cap[i] = min(cap[i], t.tpot_ms)
            out.append((i, take))
            left -= take
        return out

    # 1. running requests keep decoding (no preemption), whatever their tier: all of them are in a batch now.
    got_running: dict[str, int] = {}
    for t in load.tiers:
        placed = place(t, t.running, t.running_ctx_tokens, order_hi if t.latency_sensitive else order_lo, True)
        got_running[t.tier] = got = sum(k for _, k in placed)
        misses += t.running - got  # (none, unless the candidate has no decode-capable group)
        latency_misses += t.running - got if t.latency_sensitive else 0
        for i, k in placed:
            entries.append((i, k, t, t.running_left_tokens, 0.0))
    # 2. queued requests: pooled prefill in one earliest-TTFT-deadline order across the tiers, as the engine
    # (engine/tiered.py) and the simulator schedule it.
    prefill = edf_prefill(load.tiers, pool)
    for t in load.tiers:
        lost = 0
        met, offset = prefill.get(t.tier, (0, 0.0))
        # 3. the ones in time need a decode slot; running work turning over frees slots (they join over the
        # horizon as running ones finish, so they do not overflow the batches running now).
        ctx = quantize_tokens(t.prompt_tokens + t.queued_out_tokens / 2.0)
        if met:
            placed = place(t, met, ctx, order_hi if t.latency_sensitive else order_lo, False)
            got_q = sum(k for _, k in placed)
            for i, k in placed:
                entries.append((i, k, t, t.queued_out_tokens, offset))
            # Slots freed by finishing running requests (at most as many as run now) serve the
            # rest in time, but they finish past the horizon: half credit.
            turnover = min(met - got_q, got_running[t.tier])
            score += turnover * t.weight * 0.5
            lost += t.queued - got_q - turnover
        else:
            lost += t.queued
        misses += lost
        if t.latency_sensitive:
            latency_misses += lost
    # 5. the arrival stream over the horizon, against steady-state capacity.
    if load.streams:
        # Rule 21: the streams keep a hybrid group's prefill pending (as _stream_pool prices its prompts), so
        # its decode steps and slots carry at least the minimum chunk, whatever is queued now.
        s_extras = [MIN_CHUNK_TOKENS if roles[i] == "hybrid" else 0 for i in range(n)]
        s_score, s_misses = stream_estimate(
            cost,
            load.streams,
            tps,
            roles,
            mult,
            lambda i, tpot, ctx: mult[i] * cost.max_decode_batch(tps[i], tpot, ctx, s_extras[i]),
            s_extras,
            order_hi,
            order_lo,
            horizon_ms,
            prefill_ms,
            admit_levels or tuple(sorted(set(tps))),
            prefill_batch_tokens,
            detail,
        )
        score += s_score
        misses += s_misses
    else:
        s_score = 0.0
    # 4. credit, with the step time each class ends up with.
    step = [0.0] * n
    for i in range(n):
        if used[i]:
            b = max(used[i] // mult[i], 1)
            extra = chunk(i)
            ctx = quantize_tokens(ctx_sum[i] / mult[i])
            step[i] = cost.step_time_ms(tps[i], b, b + extra, ctx + extra)
    for i, k, t, left, offset in entries:
        # Rule 17: a tier meets its TPOT on a class only if the class's whole batch fits its TPOT.
        if used[i] > slots(i, t.tpot_ms, quantize_tokens(ctx_sum[i] / used[i])):
            misses += k
            latency_misses += k if t.latency_sensitive else 0
            continue
        tokens = max(horizon_ms - offset, 0.0) / step[i] if step[i] > 0 else 0.0
        frac = 1.0 if left <= 0 else min(1.0, tokens / left)
        score += k * t.weight * (0.5 + 0.5 * frac)
    return Estimate(score, latency_misses, misses, s_score)


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
