"""Rule 17 of the goodput estimator (estimate.py, stream.py): the decode work the arrival streams put on each
decode-capable class of a candidate, in steady state, and how often a tier's TPOT holds there.

A group steps all of its decodes together (the simulator's continuous batching and the engine's alike: no
per-tier step), so its step time is set by the whole batch it carries, and routing never refuses a decode: a P/D
hand-off goes to the decode group where its own slack is largest (or the least late one), and a hybrid group
decodes what it prefilled. Hence:
- a class decodes at most `decode_rate` tokens per ms with every step within T: its groups' largest batch whose
  step fits T (max_decode_batch), over that batch's step time, as the step table prices it;
- a tier fills the classes it prefers (latency tiers the highest TP, the others the lowest) up to their capacity
  at its *own* TPOT: routing checks a decode's own slack, not that of the decodes already there, so background
  fills a TP1 group to its 100 ms batch whatever interactive decodes share it;
- what a tier cannot place within that room is not refused: it overflows onto the classes it can reach, in
  proportion to their groups (routing spreads it by slack), and raises their step time;
- a group's batch is the number of sequences decoding on it: with Poisson arrivals and no queue in front of
  decode that is an M/G/∞ occupancy, Poisson with the mean L that Little's law gives (L = tokens per ms per
  group × the step time at batch L, a fixed point), whatever the output lengths. A tier meets its TPOT there as
  often as that batch is at most the largest batch its TPOT allows: P(N ≤ B_T), N ~ Poisson(L). (Conservative:
  a request's TPOT is the mean over its life, which varies less than one step's batch.) No fixed point (the
  demand exceeds what any batch decodes): the batch grows without end and every tier on the class misses.
Before, a tier's demand beyond its room was simply not decoded, and the interactive decodes kept their 25 ms steps
beside the background placed after them: three TP1 decode groups on the measured CPU table looked able to hold
~9 interactive decodes at 25 ms *and* the background beside them at 100 ms, so five or six prefill groups, which
deliver more background than the decode side holds, looked best; in the simulator their decode groups then step
at > 100 ms and every tier on them misses.
"""

from __future__ import annotations

import math

from nitsum.policy.costmodel import CostModel
from nitsum.policy.nodeload import quantize_tokens

MAX_STEADY_BATCH = 4096.0  # a steady batch beyond this is taken as no fixed point (CostModel's batch limit)


def decode_rate(cost: CostModel, tp: int, groups: int, tpot_ms: float, ctx: int, extra_tokens: int = 0) -> float:
    """Tokens per ms `groups` groups of TP tp decode with every step within tpot_ms, for sequences of ctx tokens of
    context each (and `extra_tokens` of prefill chunk beside them): the largest such batch over its step time.
    0 when one sequence already misses."""
    b = cost.max_decode_batch(tp, tpot_ms, ctx, extra_tokens)
    if b <= 0:
        return 0.0
    return groups * b / cost.step_time_ms(tp, b, b + extra_tokens, b * ctx + extra_tokens)


def steady_batch(cost: CostModel, tp: int, tokens_per_ms: float, ctx: int, extra_tokens: int = 0) -> float:
    """Mean decode batch of one group that gets `tokens_per_ms` of decode work (Little: L = rate · S(L), S the
    step time at batch L, linear between whole batches); inf when no batch keeps up."""
    if tokens_per_ms <= 0:
        return 0.0

    def step(b: float) -> float:
        lo = max(int(b), 1)
        s_lo = cost.step_time_ms(tp, lo, lo + extra_tokens, lo * ctx + extra_tokens)
        if b <= lo:
            return s_lo
        s_hi = cost.step_time_ms(tp, lo + 1, lo + 1 + extra_tokens, (lo + 1) * ctx + extra_tokens)
        return s_lo + (b - lo) * (s_hi - s_lo)

    batch = 0.0
    for _ in range(200):
        nxt = tokens_per_ms * step(batch)
        if nxt > MAX_STEADY_BATCH:
            return math.inf
        if abs(nxt - batch) < 1e-3:
            return nxt
        batch = nxt
    return math.inf  # still growing: no fixed point within reach


def poisson_cdf(k: int, mean: float) -> float:
    """P(N <= k) for N ~ Poisson(mean)."""
    if k < 0 or math.isinf(mean):
        return 0.0
    if mean <= 0:
        return 1.0
    if mean > 100.0:  # normal approximation with continuity correction
        return 0.5 * math.erfc(-(k + 0.5 - mean) / math.sqrt(2.0 * mean))
    term = math.exp(-mean)
    total = term
    for j in range(1, k + 1):
        term *= mean / j
        total += term
        if term < 1e-12 * total and j > mean:
            break
    return min(total, 1.0)


class DecodeLoad:
    """The streams' decode work on a candidate's classes (module docstring)."""

    def __init__(self, cost: CostModel, tps: list[int], mult: list[int], extras: list[int]) -> None:
        self.cost, self.tps, self.mult, self.extras = cost, tps, mult, extras
        n = len(tps)
        self.load = [0.0] * n  # tokens/ms placed on the class (all its groups)
        self.ctx = [1] * n  # load-weighted mean context per sequence of what is placed
        self._ctx_w = [0.0] * n

    def capacity(self, i: int, tpot_ms: float, ctx: int) -> float:
        """Tokens per ms class i decodes with every step within tpot_ms."""
        return decode_rate(self.cost, self.tps[i], self.mult[i], tpot_ms, ctx, self.extras[i])

    def place(self, reach: list[int], demand: float, tpot_ms: float, ctx: int) -> list[tuple[int, float]]:
        """Put `demand` tokens/ms of a tier (TPOT tpot_ms, context ctx per sequence) on the classes `reach`, in
        that order, within their room at its TPOT; the rest overflows onto them in proportion to their groups."""
        out: list[tuple[int, float]] = []
        left = demand
        for i in reach:
            if left <= 0:
                break
            take = min(max(self.capacity(i, tpot_ms, ctx) - self.load[i], 0.0), left)
            if take > 0:
                self._add(i, take, ctx)
                out.append((i, take))
                left -= take
        if left > 1e-12 and reach:
            groups = sum(self.mult[i] for i in reach)
            for i in reach:
                part = left * self.mult[i] / groups
                self._add(i, part, ctx)
                out.append((i, part))
        return out

    def met_fraction(self, i: int, tpot_ms: float) -> float:
        """How often a decode of TPOT tpot_ms on class i steps within it: P(batch <= the batch tpot_ms allows)."""
        tp, ctx, extra = self.tps[i], self.ctx[i], self.extras[i]
        allowed = self.cost.max_decode_batch(tp, tpot_ms, ctx, extra)
        if allowed <= 0:
            return 0.0
        return poisson_cdf(allowed, steady_batch(self.cost, tp, self.load[i] / self.mult[i], ctx, extra))

    def _add(self, i: int, tokens: float, ctx: int) -> None:
        self.load[i] += tokens
        self._ctx_w[i] += tokens * ctx
        self.ctx[i] = quantize_tokens(self._ctx_w[i] / self.load[i])
