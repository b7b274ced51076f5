"""Rule 5 of the goodput estimator (estimate.py's docstring): the arrivals expected within the horizon, per
tier in priority order, against a candidate's steady-state prefill and decode capacity."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nitsum.policy.costmodel import CostModel
from nitsum.policy.decodeload import DecodeLoad
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
    slots,
    extras: list[int],
    order_hi: list[int],
    order_lo: list[int],
    horizon_ms: float,
    prefill_ms,
    admit_levels: tuple[int, ...] = (),
    prefill_batch_tokens: int = 0,
    detail: list | None = None,
) -> tuple[float, int]:
    """Rule 5 of estimate.py's docstring: (score, expected misses) of the arrivals within the horizon.
    `detail`: a list that gets, per stream, its terms (`StreamTerms`), for studies of the estimate."""
    n = len(tps)
    # admission.admit refuses what no level prefills within the target even with nothing queued
    oks = [
        [min(cost.prefill_time_ms(k, p) for k in admit_levels) <= st.ttft_ms for p in st.prompt_tokens]
        for st in streams
    ]
    admits = [[p for p, ok in zip(st.prompt_tokens, o, strict=True) if ok] for st, o in zip(streams, oks, strict=True)]
    # Rule 18: what a prefill group's batch costs per prompt, at the batch the stream's arrivals make it run.
    groups = sum(mult[i] for i in range(n) if roles[i] == "prefill")
    arriving = sum(st.rate_per_ms * len(a) / len(st.prompt_tokens) for st, a in zip(streams, admits, strict=True))
    tokens = sum(st.rate_per_ms * sum(a) / len(st.prompt_tokens) for st, a in zip(streams, admits, strict=True))
    batches = [
        prefill_batch(cost, tps[i], arriving / groups, round(tokens / arriving), prefill_batch_tokens)
        if roles[i] == "prefill" and arriving > 0 and prefill_batch_tokens > 0
        else None
        for i in range(n)
    ]
    pools = [
        _stream_pool(st, tps, roles, mult, slots, prefill_ms, ok, batches) for st, ok in zip(streams, oks, strict=True)
    ]
    admits = [a or list(st.prompt_tokens) for st, a in zip(streams, admits, strict=True)]
    total = sum(st.rate_per_ms * pool[0] for st, pool in zip(streams, pools, strict=True))
    # Overloaded (the streams together need more prefill time than the pool has): prefill runs in TTFT-deadline
    # order across the tiers (engine/tiered.py, the simulator), and shedding drops what can no longer meet its
    # target, so every tier is served near its deadline in the same proportion 1 / ρ: background requests near
    # their deadline overtake fresh interactive ones. Below saturation the tighter targets come first.
    edf_overload = total >= 1.0
    util = 0.0  # prefill-pool time fraction taken by higher-priority streams
    dec = DecodeLoad(cost, tps, mult, extras)
    score = 0.0
    misses = 0.0
    placed = []  # per stream: (expected, good before decode, decode placements), for the second pass
    for st, (mean_service, split, group_ms), prompts in zip(streams, pools, admits, strict=True):
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
        # Decode, steady state (Little): what is prefilled in time keeps rate · output tokens of decode work
        # per ms on the decode-capable groups (rule 17, DecodeLoad).
        demand = st.rate_per_ms * served * in_time * st.output_tokens  # tokens/ms
        # (the prompts admission lets in: Azure code's longest quartile is refused, and its context never decodes)
        ctx = quantize_tokens(sum(prompts) / len(prompts) + st.output_tokens / 2.0)
        reach = [i for i in order if roles[i] != "prefill"]
        parts = dec.place(reach, demand, st.tpot_ms, ctx)
        placed.append((st, expected, expected * served * in_time, parts, served, in_time))
    # Second pass: a tier's decodes meet its TPOT on a class as often as the class's batch, with everything
    # placed there (the overflow of the tiers after it included), stays within the batch its TPOT allows.
    for st, expected, good, parts, served, in_time in placed:
        demand = sum(t for _, t in parts)
        ok = sum(t * dec.met_fraction(i, st.tpot_ms) for i, t in parts) if demand > 0 else 0.0
        tpot_met = 1.0 if demand <= 0 else ok / demand
        good *= tpot_met
        score += st.weight * good * STREAM_CREDIT
        misses += expected - good
        if detail is not None:
            detail.append(StreamTerms(st.tier, expected, served, in_time, tpot_met, st.weight * good * STREAM_CREDIT))
    return score, int(round(misses))


@dataclass(frozen=True)
class StreamTerms:
    """One stream's factors in the estimate: arrivals within the horizon, the fraction the pool serves at all,
    the fraction of those with the first token in time, the fraction of those meeting TPOT, and the score."""

    tier: str
    expected: float
    served: float
    ttft_met: float
    tpot_met: float
    score: float


@dataclass(frozen=True)
class PrefillBatch:
    """Rule 18: a prefill group's steady batch under its share of the arrival streams."""

    k: float  # prompts per step
    prompt: int  # mean prompt tokens of the arrivals
    step_ms: float  # S(k)
    busy: float  # fraction of time stepping (λ·S(k)/k, at most 1)

    def service_ms(self, prompt: int) -> float:
        """Group time a prompt takes in such a batch: its share of the step's tokens."""
        return prompt / self.prompt * self.step_ms / self.k

    def first_token_ms(self, prompt: int) -> float:
        """When a new prompt has its first token: it waits out the step in progress (busy with probability `busy`,
        half a step left on average), then runs in a batch of k with the others (its own tokens, not the mean's)."""
        return (
            self.busy * self.step_ms / 2.0
            + self.step_ms
            + (prompt - self.prompt) * self.step_ms / (self.k * self.prompt)
        )


def prefill_batch(cost: CostModel, tp: int, rate_per_ms: float, prompt: int, batch_tokens: int) -> PrefillBatch:
    """Rule 18 of the goodput estimator: the batch a prefill group's arrivals make it run. The simulator's prefill
    group (and the engine's) starts each step with every prompt waiting, up to `batch_tokens`, so the queue is
    empty when a step starts and the next batch holds what arrives during it: λ·S(k) prompts, or the next single
    arrival when none did (probability e^(−λ·S(k))). The steady batch is the fixed point of that mean,
    k = λ·S(k) + e^(−λ·S(k)), between 1 and batch_tokens / prompt (S linear between whole batches). A prompt then
    takes its share of the batch's tokens of group time, and has its first token when its batch ends. On a
    roofline a batch costs about the sum of its prompts (whatever k); on the measured CPU table two 900-token
    prompts take 657 ms against 185 ms for one, so a TP1 prefill group that single prompts would keep 81 % busy
    runs away to full 8,192-token batches of ~2.2 s, as the simulator's do (7.4 prompts, 2.45 s per step at
    10.3 req/s). Before, a prefill group's prompt took its single-prompt time, and the stream waited rule 16's
    half step of the queue there at that instant."""
    prompt = max(prompt, 1)
    top = max(batch_tokens // prompt, 1) if batch_tokens > 0 else 1

    def step(k: float) -> float:
        lo = min(int(k), top)
        s_lo = cost.step_time_ms(tp, lo, lo * prompt, lo * prompt)
        if lo >= top or k <= lo:
            return s_lo
        return s_lo + (k - lo) * (cost.step_time_ms(tp, lo + 1, (lo + 1) * prompt, (lo + 1) * prompt) - s_lo)

    k = 1.0
    for _ in range(32 if rate_per_ms > 0 else 0):
        x = rate_per_ms * step(k)
        nxt = min(max(x + math.exp(-x), 1.0), float(top))
        done = abs(nxt - k) < 0.01
        k = nxt
        if done:
            break
    s_k = step(k)
    return PrefillBatch(k, prompt, s_k, min(rate_per_ms * s_k / k, 1.0))


def _stream_pool(st: StreamLoad, tps, roles, mult, slots, prefill_ms, admitted: list[bool], batches):
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
            batch = batches[i]
            if batch is not None:
                s = batch.service_ms(p)
            r_i = mult[i] / s
            if roles[i] == "hybrid":
                # A hybrid group decodes what it prefills: in steady state it can take on no more requests
                # than its decode slots turn over (Llama-3-70B TP2 on H100 holds ~8 k KV tokens).
                turnover = slots(i, st.tpot_ms, quantize_tokens(p + st.output_tokens / 2.0)) / max(
                    st.output_tokens * st.tpot_ms, 1.0
                )
                r_i = min(r_i, turnover)
            rate += r_i
            # a prefill group's first token: the step in progress, then its batch (rule 18; the backlog's
            # requests, in estimate.evaluate, keep rule 16's head-of-line delay of the queue there now)
            parts.append((i, r_i, batch.first_token_ms(p) if batch is not None else s))
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
