"""Routing by slack, admission (429/503 + Retry-After) and shedding order (background first)."""

import pytest

from nitsum.policy.base import PolicyConfig
from nitsum.policy.costmodel import model_spec
from nitsum.policy.registry import make_policy
from nitsum.policy.snapshot import ClusterSnapshot, GroupView, NodeView, RequestView

NOW = 50_000.0
GROUPS = (
    GroupView("big", (0, 1, 2, 3), 4, "hybrid"),
    GroupView("small-a", (4, 5), 2, "hybrid"),
    GroupView("small-b", (6, 7), 2, "hybrid"),
)


def node(groups=GROUPS):
    return NodeView("n0", 8, 2, 8, groups, "h100")


def inter(rid, age=0.0, prompt=1000, **kw):
    return RequestView(rid, "interactive", 200.0, 25.0, 10.0, NOW - age, prompt, 100, **kw)


def bg(rid, age=0.0, prompt=1000, **kw):
    return RequestView(rid, "background", 10_000.0, 100.0, 1.0, NOW - age, prompt, 100, **kw)


def pol(spec="adaptive", **kw):
    return make_policy(spec, PolicyConfig(model=model_spec("llama-3-70b"), **kw))


def snap(requests=(), groups=GROUPS):
    return ClusterSnapshot(NOW, (node(groups),), tuple(requests))


@pytest.mark.parametrize("spec", ["adaptive", "static-hybrid:4/2"])
def test_interactive_goes_to_high_tp_and_background_to_low_tp(spec):
    p = pol(spec)
    s = snap()
    assert p.route(s, inter("i")).group_id == "big"
    # Both TP2 groups are equally empty: the lower id wins the tie.
    assert p.route(s, bg("b")).group_id == "small-a"


def test_background_avoids_the_busier_small_group():
    waiting = [bg(f"w{i}", group_id="small-a") for i in range(3)]
    assert pol().route(snap(waiting), bg("b")).group_id == "small-b"


def test_routing_honours_slack_over_tp_preference():
    # 'big' has 2 interactive prefills queued: a third would miss its TTFT there (3 × ~74 ms > 200 ms).
    # TP2 needs ~130 ms: late for the preferred group, in time on a small one, so slack wins.
    queued = [inter(f"q{i}", group_id="big") for i in range(2)]
    d = pol().route(snap(queued), inter("i"))
    assert d.group_id == "small-a"
    assert d.slack_ms > 0 and d.reason.startswith("meets slack")


def test_routing_when_nothing_meets_slack_picks_least_late():
    d = pol().route(snap(), inter("late", age=190.0))
    assert d.group_id == "big" and d.slack_ms < 0
    assert d.reason.startswith("least late")


def test_prefilled_request_routes_to_a_decode_capable_group():
    groups = (
        GroupView("p", (0, 1, 2, 3), 4, "prefill"),
        GroupView("d1", (4, 5), 2, "decode"),
        GroupView("d2", (6, 7), 2, "decode"),
    )
    r = bg("b", first_token_ms=NOW - 1.0, output_tokens=1)
    assert pol("disagg").route(snap(groups=groups), r).group_id == "d1"
    assert pol("disagg").route(snap(groups=groups), bg("b2")).group_id == "p"


def test_route_without_usable_group_keeps_it_queued():
    groups = tuple(GroupView(g.group_id, g.devices, g.tp, g.role, draining=True) for g in GROUPS)
    d = pol().route(snap(groups=groups), inter("i"))
    assert d.group_id is None and "no usable" in d.reason


def test_admit_ok():
    d = pol().admit(snap(), inter("i"))
    assert (d.admit, d.status, d.retry_after_s) == (True, 200, 0.0)


def test_admit_503_without_healthy_group():
    groups = tuple(GroupView(g.group_id, g.devices, g.tp, g.role, healthy=False) for g in GROUPS)
    d = pol(epoch_ms=2000.0).admit(snap(groups=groups), inter("i"))
    assert (d.admit, d.status, d.retry_after_s) == (False, 503, 2.0)


def test_admit_429_when_tier_queue_is_full_with_retry_after():
    queued = [bg(f"q{i}") for i in range(3)]
    p = pol(queue_bounds=(("interactive", 10), ("background", 3)))
    d = p.admit(snap(queued), bg("b"))
    assert (d.admit, d.status) == (False, 429)
    assert 1.0 <= d.retry_after_s <= 60.0
    assert "background queue full" in d.reason
    assert p.admit(snap(queued), inter("i")).admit  # the other tier's bound is not reached


def test_admit_429_when_slo_is_unattainable_anywhere():
    # A 20k-token prompt cannot be prefilled within 200 ms on any TP level of an H100 node.
    d = pol().admit(snap(), inter("huge", prompt=20_000))
    assert (d.admit, d.status) == (False, 429)
    assert "unattainable" in d.reason


def test_shed_hopeless_background_before_interactive():
    reqs = [
        inter("i-late", age=199.0),  # 1 ms left: hopeless
        inter("i-ok"),
        bg("b-late", age=9_999.0),  # hopeless
        bg("b-later", age=9_990.0),  # hopeless, 9 ms later deadline
        bg("b-ok"),
        bg("b-running", age=20_000.0, first_token_ms=NOW - 5.0, output_tokens=3),  # never shed: already running
    ]
    assert pol().shed(snap(reqs)) == ["b-late", "b-later", "i-late"]


def test_shed_beyond_queue_bound_drops_newest_background_first():
    reqs = [bg(f"b{i}", age=10.0 - i) for i in range(4)] + [inter(f"i{i}", age=3.0 - i) for i in range(3)]
    p = pol(queue_bounds=(("interactive", 2), ("background", 2)))
    assert p.shed(snap(reqs)) == ["b2", "b3", "i2"]


def _overloaded_groups():
    """Every group holds background prompts (10 s TTFT) that take > 10 s to prefill, plus two interactive ones."""
    out = []
    for g in GROUPS:
        out += [bg(f"{g.group_id}-b{i}", age=float(i), prompt=4000, group_id=g.group_id) for i in range(400)]
        out += [inter(f"{g.group_id}-i{i}", prompt=200, group_id=g.group_id) for i in range(2)]
    return out


def test_overload_refuses_background_at_once_and_admits_interactive():
    s = snap(_overloaded_groups())
    p = pol()
    refused = p.admit(s, bg("new-b", prompt=4000))
    assert not refused.admit and refused.status == 429 and refused.reason.startswith("overloaded")
    assert 1.0 <= refused.retry_after_s <= 60.0
    # The same load: an interactive request waits only behind the prompts with earlier TTFT deadlines (EDF).
    assert p.admit(s, inter("new-i", prompt=200)).admit


def test_shedding_on_groups_drops_the_background_that_cannot_start_in_time_first():
    requests = _overloaded_groups()
    victims = pol().shed(snap(requests))
    assert victims, "an overloaded group must shed"
    tiers = [next(r.tier for r in requests if r.request_id == v) for v in victims]
    assert set(tiers) == {"background"}  # the interactive ones are ahead under EDF: they start in time
    # The oldest background prompts (earliest deadlines) are ahead of the rest and are kept.
    assert not any(v.endswith("-b399") for v in victims)
    assert all(any(v.startswith(g.group_id) for v in victims) for g in GROUPS)


def test_a_request_past_its_first_token_is_never_shed():
    requests = [dataclasses_replace(r, first_token_ms=NOW - 1.0) for r in _overloaded_groups()]
    assert pol().shed(snap(requests)) == []


def dataclasses_replace(r, **kw):
    import dataclasses

    return dataclasses.replace(r, **kw)


def test_prompts_ahead_count_only_for_the_work_the_group_cannot_have_done_since_they_came():
    one = (GROUPS[0],)
    fresh = [inter(f"q{i}", prompt=1000, group_id="big") for i in range(6)]
    refused = pol().admit(snap(fresh, one), inter("new", prompt=1000))
    assert not refused.admit and refused.reason.startswith("overloaded")
    # The same queue as heard, but it came 2 s ago: its prefills are most likely done (heard a heartbeat late).
    stale = [inter(f"q{i}", age=2000.0, prompt=1000, group_id="big") for i in range(6)]
    assert pol().admit(snap(stale, one), inter("new", prompt=1000)).admit
