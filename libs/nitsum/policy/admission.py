"""Admission and shedding (ALGORITHMS.md §1.5): refuse only what cannot be served.

admit():
1. no healthy, non-draining group anywhere            -> 503, Retry-After = one policy epoch
2. the request's tier queue is at its bound            -> 429, Retry-After = time to drain that queue
3. its SLO cannot be met at any allowed TP, even with  -> 429 (reason says "unattainable"), no retry hint
   an empty queue (best-case prefill > TTFT budget, or
   the fastest decode step > TPOT target)
4. overloaded: on every group that could prefill it,   -> 429 (reason says "overloaded"), Retry-After = the
   the prompts ahead of it (not yet prefilled, with an     wait ahead of it on its best group (1-60 s)
   earlier TTFT deadline: the engines' EDF order) take
   until past its TTFT deadline: it could not even start
otherwise admit.

The wait ahead (`remaining_wait_ms`) is a lower bound: those prompts as one batched prefill step at the group's
TP, no decode steps between, less the time since the first of them arrived (the group may have worked on them
all along; the snapshot hears of finished prefills a heartbeat late). Under EDF a background request (TTFT 10 s) waits behind every interactive one queued
before its deadline, an interactive one only behind the few with earlier deadlines: overload refuses, and
sheds, background first.

shed(): queued (not yet prefilled) requests that are hopeless — the prompts ahead of one on its group (EDF, as
above) take until past its TTFT deadline; at the coordinator, or anywhere: even at the front of the queue on the
best TP level it would miss its TTFT deadline — plus the newest requests beyond a tier's queue bound. Order: lowest tier weight first
(background before interactive), then SHED_ORDER, then earliest deadline, then id.
"""

from __future__ import annotations

from collections.abc import Callable

from nitsum.policy.costmodel import CostModel
from nitsum.policy.decisions import AdmissionDecision
from nitsum.policy.estimate import quantize_tokens
from nitsum.policy.snapshot import ClusterSnapshot, NodeView, RequestView
from nitsum.policy.tiers import SHED_ORDER

CostFor = Callable[[NodeView], CostModel]


def best_case_ttft_ms(node: NodeView, cost: CostModel, r: RequestView) -> float:
    """Fastest possible prefill of r on this node: any allowed TP level, nothing queued ahead."""
    return (
        min(
            cost.prefill_time_ms(k, r.prompt_tokens, r.cached_prompt_tokens)
            for k in node.allowed_tp_levels()
            if cost.fits(k)
        )
        if _any_fits(node, cost)
        else float("inf")
    )


def best_case_tpot_ms(node: NodeView, cost: CostModel, r: RequestView) -> float:
    return (
        min(cost.decode_step_ms(k, 1, r.context_tokens) for k in node.allowed_tp_levels() if cost.fits(k))
        if _any_fits(node, cost)
        else float("inf")
    )


def _any_fits(node: NodeView, cost: CostModel) -> bool:
    return any(cost.fits(k) for k in node.allowed_tp_levels())


def hopeless(snap: ClusterSnapshot, cost_for: CostFor, r: RequestView) -> bool:
    """True when no node could produce r's first token before its TTFT deadline, even with no queue."""
    return _hopeless(snap.now_ms, _usable_nodes(snap, cost_for), r)


def _usable_nodes(snap: ClusterSnapshot, cost_for: CostFor) -> list[tuple[NodeView, CostModel, int | None]]:
    out = []
    for n in snap.nodes:
        if _usable(n):
            cost = cost_for(n)
            out.append((n, cost, _top_level(n, cost)))
    return out


def _hopeless(now_ms: float, nodes: list[tuple[NodeView, CostModel, int | None]], r: RequestView) -> bool:
    if r.first_token_ms is not None:
        return False
    left_ms = r.arrival_ms + r.ttft_ms - now_ms
    uncached = r.prompt_tokens - r.cached_prompt_tokens
    for n, cost, top in nodes:
        # Cheap sufficient test first: prefill time only grows with tokens, so if the prompt rounded up to a
        # memo-friendly size fits at the top level, r is not hopeless (no exact cost-model call needed).
        if top is not None and cost.prefill_time_ms(top, quantize_tokens(uncached)) <= left_ms:
            return False
        if best_case_ttft_ms(n, cost, r) <= left_ms:
            return False
    return True


def edf_wait_ms(cost: CostModel, tp: int, ahead: int, ahead_tokens: int) -> float:
    """Lower bound of the time `ahead` prompts of `ahead_tokens` uncached tokens in all take to prefill: one
    batched step at TP `tp` (prefill steps attend to their own tokens only)."""
    return cost.step_time_ms(tp, ahead, ahead_tokens, ahead_tokens) if ahead_tokens > 0 else 0.0


def _ahead_on(snap: ClusterSnapshot, group_id: str, r: RequestView) -> tuple[int, int, float]:
    """(prompts, uncached tokens, earliest arrival) queued on a group before r in EDF order (deadline, then
    arrival)."""
    n = tokens = 0
    first = snap.now_ms
    key = (r.ttft_deadline_ms, r.arrival_ms)
    for q in snap.requests_by_group.get(group_id, ()):
        if q.first_token_ms is None and q.request_id != r.request_id and (q.ttft_deadline_ms, q.arrival_ms) <= key:
            n += 1
            tokens += q.uncached_prompt_tokens
            first = min(first, q.arrival_ms)
    return n, tokens, first


def remaining_wait_ms(
    cost: CostModel, tp: int, ahead: int, tokens: int, first_arrival_ms: float, now_ms: float
) -> float:
    """Lower bound of the prefill work still ahead now: the group cannot have spent more than `now - first
    arrival` on those prompts, whatever the snapshot says (it hears of finished prefills a heartbeat late)."""
    return max(edf_wait_ms(cost, tp, ahead, tokens) - max(now_ms - first_arrival_ms, 0.0), 0.0)


def overload_wait_ms(snap: ClusterSnapshot, nodes: list[NodeView], cost_for: CostFor, r: RequestView) -> float | None:
    """None when some group could still prefill r by its deadline (EDF); otherwise the least wait ahead of it."""
    left_ms = r.ttft_deadline_ms - snap.now_ms
    least: float | None = None
    for n in nodes:
        cost = cost_for(n)
        for g in n.groups:
            if not g.usable or g.role == "decode" or not cost.fits(g.tp):
                continue
            load = snap.load_of(g.group_id)
            # Cheap sufficient test first: with every queued prompt ahead of it, it still starts in time.
            if edf_wait_ms(cost, g.tp, load.num_prefill, load.prefill_tokens) <= left_ms:
                return None
            wait = remaining_wait_ms(cost, g.tp, *_ahead_on(snap, g.group_id, r), snap.now_ms)
            if wait <= left_ms:
                return None
            least = wait if least is None else min(least, wait)
    return least


def _top_level(node: NodeView, cost: CostModel) -> int | None:
    """Highest allowed TP level whose weights fit (memoized in the cost model)."""
    key = ("top", node.min_tp, node.max_tp)
    if key not in cost._memo:
        cost._memo[key] = max((k for k in node.allowed_tp_levels() if cost.fits(k)), default=None)
    return cost._memo[key]


def _usable(node: NodeView) -> bool:
    return any(g.usable for g in node.groups)


def admit(
    snap: ClusterSnapshot,
    r: RequestView,
    cost_for: CostFor,
    queue_bounds: dict[str, int],
    epoch_ms: float,
) -> AdmissionDecision:
    rid = r.request_id
    nodes = [n for n in snap.nodes if _usable(n)]
    if not nodes:
        return AdmissionDecision(rid, False, 503, epoch_ms / 1e3, "no healthy group to serve it")
    bound = queue_bounds.get(r.tier)
    queued = snap.queued_by_tier.get(r.tier, 0)
    if bound is not None and queued >= bound:
        retry_s = _drain_time_s(snap, nodes, cost_for, r, queued)
        return AdmissionDecision(rid, False, 429, retry_s, f"{r.tier} queue full ({queued} >= {bound})")
    ttft_ms = min(best_case_ttft_ms(n, cost_for(n), r) for n in nodes)
    if ttft_ms > r.ttft_ms:
        return AdmissionDecision(
            rid, False, 429, 0.0, f"SLO unattainable: best-case TTFT {ttft_ms:.1f} ms > target {r.ttft_ms:.1f} ms"
        )
    tpot_ms = min(best_case_tpot_ms(n, cost_for(n), r) for n in nodes)
    if tpot_ms > r.tpot_ms:
        return AdmissionDecision(
            rid, False, 429, 0.0, f"SLO unattainable: best-case TPOT {tpot_ms:.1f} ms > target {r.tpot_ms:.1f} ms"
        )
    wait_ms = overload_wait_ms(snap, nodes, cost_for, r)
    if wait_ms is not None:
        return AdmissionDecision(
            rid,
            False,
            429,
            min(max(wait_ms / 1e3, 1.0), 60.0),
            f"overloaded: {wait_ms:.0f} ms of prefill ahead of it on every group, TTFT target {r.ttft_ms:.0f} ms",
        )
    return AdmissionDecision(rid, True, 200, 0.0, "admitted")


def _drain_time_s(
    snap: ClusterSnapshot, nodes: list[NodeView], cost_for: CostFor, r: RequestView, queued: int
) -> float:
    """Rough time for the whole cluster to prefill `queued` prompts like r's; clipped to [1, 60] s."""
    rate_per_ms = 0.0
    for n in nodes:
        cost = cost_for(n)
        for g in n.groups:
            if g.usable and g.role != "decode":
                rate_per_ms += 1.0 / max(cost.prefill_time_ms(g.tp, r.prompt_tokens, r.cached_prompt_tokens), 1e-3)
    if rate_per_ms <= 0:
        return 1.0
    return min(max(queued / rate_per_ms / 1e3, 1.0), 60.0)


def shed(snap: ClusterSnapshot, cost_for: CostFor, queue_bounds: dict[str, int]) -> list[str]:
    """Request ids to drop now (see module docstring for the order)."""
    victims: list[RequestView] = []
    victim_ids: set[str] = set()
    queued_by_tier: dict[str, list[RequestView]] = {}
    nodes = _usable_nodes(snap, cost_for)
    now_ms = snap.now_ms
    late = _late_on_groups(snap, cost_for)
    for r in snap.requests:
        if r.first_token_ms is not None:
            continue
        queued_by_tier.setdefault(r.tier, []).append(r)
        if r.request_id in late or _hopeless(now_ms, nodes, r):
            victims.append(r)
            victim_ids.add(r.request_id)
    for tier, rs in queued_by_tier.items():
        bound = queue_bounds.get(tier)
        alive = [r for r in rs if r.request_id not in victim_ids]
        if bound is not None and len(alive) > bound:
            # Keep the oldest `bound`; shed the newest beyond it.
            alive.sort(key=lambda r: (r.arrival_ms, r.request_id))
            for r in alive[bound:]:
                victims.append(r)
                victim_ids.add(r.request_id)
    order = {t: i for i, t in enumerate(SHED_ORDER)}
    # Lower weight first (background before interactive); SHED_ORDER breaks ties between named tiers.
    victims.sort(key=lambda r: (r.weight, order.get(r.tier, len(order)), r.ttft_deadline_ms, r.request_id))
    return [r.request_id for r in victims]


def _late_on_groups(snap: ClusterSnapshot, cost_for: CostFor) -> set[str]:
    """Requests queued on a group that cannot start before their TTFT deadline behind the prompts ahead (EDF)."""
    late: set[str] = set()
    for node in snap.nodes:
        cost = cost_for(node)
        for g in node.groups:
            if not cost.fits(g.tp):
                continue
            queued = [q for q in snap.requests_by_group.get(g.group_id, ()) if q.first_token_ms is None]
            if len(queued) < 2:
                continue
            queued.sort(key=lambda q: (q.ttft_deadline_ms, q.arrival_ms))
            ahead = tokens = 0
            first = snap.now_ms
            for q in queued:
                wait = remaining_wait_ms(cost, g.tp, ahead, tokens, first, snap.now_ms)
                if snap.now_ms + wait > q.ttft_deadline_ms:
                    late.add(q.request_id)  # shed: the ones after it no longer wait for it
                    continue
                ahead += 1
                tokens += q.uncached_prompt_tokens
                first = min(first, q.arrival_ms)
    return late
