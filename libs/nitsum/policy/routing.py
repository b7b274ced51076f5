"""Routing by slack (ALGORITHMS.md §1.5): which group a request goes to.

slack(r, g) = deadline(r) − now − estimated remaining time of r on g:
- not yet prefilled: deadline = arrival + TTFT target; remaining = prefill work already waiting on g
  (as one prefill at g's TP) + r's own prefill at g's TP. Candidates: usable prefill and hybrid groups.
- prefilled (a P→D hand-off): the TPOT budget over the tokens left; remaining = those tokens at the decode
  step time g would have with r added. Candidates: usable decode and hybrid groups.

Choice, in order: a group with free KV blocks for it; a group where slack ≥ 0; a group where prefill slack
is at least COMFORT_FRACTION of the TTFT target; among those, the TP preference of the request's class (latency-sensitive: highest TP, so interactive work lands on the consolidated groups;
others: lowest TP, leaving big groups free); then the most slack per device (margin per unit of capacity);
then the lower group id. When no group has slack ≥ 0 the request goes where it is least late.
"""

from __future__ import annotations

from collections.abc import Callable

from nitsum.policy.costmodel import CostModel
from nitsum.policy.decisions import RouteDecision
from nitsum.policy.snapshot import ClusterSnapshot, GroupView, NodeView, RequestView

CostFor = Callable[[NodeView], CostModel]
COMFORT_FRACTION = 0.5  # prefill slack, as a fraction of the TTFT target, under which TP preference yields


def prefill_slack_ms(snap: ClusterSnapshot, cost: CostModel, group: GroupView, r: RequestView) -> float:
    load = snap.load_of(group.group_id)
    wait_ms = cost.prefill_time_ms(group.tp, load.prefill_tokens) if load.prefill_tokens > 0 else 0.0
    own_ms = cost.prefill_time_ms(group.tp, r.prompt_tokens, r.cached_prompt_tokens)
    return r.ttft_deadline_ms - snap.now_ms - wait_ms - own_ms


def decode_slack_ms(snap: ClusterSnapshot, cost: CostModel, group: GroupView, r: RequestView) -> float:
    load = snap.load_of(group.group_id)
    step_ms = cost.decode_step_ms(group.tp, load.num_decode + 1, load.decode_context_tokens + r.context_tokens)
    tokens_left = r.remaining_output_tokens
    return (r.tpot_ms - step_ms) * max(tokens_left, 1)


def _kv_fits(group: GroupView, r: RequestView, block_size_tokens: int) -> bool:
    if group.kv_blocks_total <= 0:  # caller does not report KV: assume it fits
        return True
    need = -(-(r.context_tokens + 1) // block_size_tokens)
    return group.kv_blocks_free >= need


def route_by_slack(
    snap: ClusterSnapshot,
    request: RequestView,
    cost_for: CostFor,
    latency_sensitive: bool,
    block_size_tokens: int = 16,
    allowed_groups: Callable[[GroupView], bool] | None = None,
) -> RouteDecision:
    decode_phase = request.prefilled
    roles = ("decode", "hybrid") if decode_phase else ("prefill", "hybrid")
    best: tuple | None = None
    best_group: GroupView | None = None
    best_slack = 0.0
    for node in snap.nodes:
        cost = cost_for(node)
        for g in node.groups:
            if not g.usable or g.role not in roles:
                continue
            if allowed_groups is not None and not allowed_groups(g):
                continue
            if decode_phase:
                slack = decode_slack_ms(snap, cost, g, request)
            else:
                slack = prefill_slack_ms(snap, cost, g, request)
            fits = _kv_fits(g, request, block_size_tokens)
            meets = slack >= 0.0
            # The TP lane preference holds only while the group has most of the budget to spare: a lax
            # target (background TTFT 10 s) otherwise let one low-TP group collect the whole cluster's
            # background work until its queue was 10 s deep.
            comfortable = slack >= COMFORT_FRACTION * request.ttft_ms if not decode_phase else meets
            tp_pref = g.tp if latency_sensitive else -g.tp
            # Sort key, larger is better. A late request ignores TP preference: least late wins.
            margin = slack / g.tp if meets else slack
            key = (fits, meets, comfortable, tp_pref if comfortable else 0, margin)
            if best is None or key > best or (key == best and g.group_id < best_group.group_id):
                best, best_group, best_slack = key, g, slack
    if best_group is None:
        phase = "decode" if decode_phase else "prefill"
        return RouteDecision(request.request_id, None, f"no usable {phase}-capable group")
    assert best is not None
    why = "meets slack" if best[1] else "least late (no group meets slack)"
    if not best[0]:
        why += "; no group has free KV for it"
    return RouteDecision(
        request.request_id, best_group.group_id, f"{why}: TP{best_group.tp} {best_group.role}", slack_ms=best_slack
    )
