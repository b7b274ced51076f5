"""Rule 5 of the goodput estimator (estimate.py's docstring): the arrivals expected within the horizon, per
tier in priority order, against a candidate's steady-state prefill and decode capacity."""

from __future__ import annotations

import math

from nitsum.policy.costmodel import CostModel
from nitsum.policy.nodeload import StreamLoad, quantize_tokens

# A future arrival meeting its SLO counts less than a request already here (it may not come; it finishes
# later within the horizon): the mean of the 0.5 + 0.5 · fraction-done credit of rule 4.
STREAM_CREDIT = 0.75


def _p_wait_within(x_ms: float, rho: float, mean_wait_ms: float) -> float:
    """P(queueing wait <= x) for utilisation rho and mean wait (estimate.py's docstring, rule 5)."""
    if x_ms < 0 or rho >= 1.0 or math.isinf(mean_wait_ms):  # (callers pass rho < 1)
        return 0.0
    if rho <= 0 or mean_wait_ms <= 0:
        return 1.0
    return 1.0 - rho * math.exp(-x_ms * rho / mean_wait_ms)


def stream_estimate(
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
    """Rule 5 of estimate.py's docstring: (score, expected misses) of the arrivals within the horizon."""
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
