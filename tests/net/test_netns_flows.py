"""Real packets: RMLQ's DSCP classes through a rate-limited priority qdisc, against Fair Sharing.

Two namespaces joined by a veth pair shaped at 20 Mbit/s with a 3-band prio qdisc keyed on DSCP. A bulk
KV-reuse flow (2 MB) and an urgent P2D flow (3 MB) start together. The scheduler under test picks each
flow's level, hence its DSCP and TCP connection. With RMLQ the P2D flow (MLU past Q_1 → P1 → EF) has the
link first and finishes before the bulk flow; with Fair Sharing both share one class, and the larger
urgent flow finishes after the bulk one. Traffic goes only to 10.231.0.x inside the namespaces made here.
"""

from __future__ import annotations

import os

import pytest

from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.flows import FlowSpec, Stage
from nitsum.transfer import netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(90)]

_REASON = netns.unavailable_reason()
RATE_MBIT = 20.0
LINK = "veth"
BULK = FlowSpec("bulk", "r-bulk", "u-bulk", Stage.KV_REUSE, 2_000_000, "A", "B", (LINK,), target_layer=40)
# 3 MB due in 1.5 s on 20 Mbit/s: MLU = 24 Mbit / (1.5 s · 20 Mbit/s) = 0.8 ≥ Q_1.
URGENT = FlowSpec("urgent", "r-urgent", "u-urgent", Stage.P2D, 3_000_000, "A", "B", (LINK,), deadline_ms=1500.0)


def plan_for(name: str) -> list[dict[str, object]]:
    sched = make_flow_scheduler(name)
    if hasattr(sched, "set_link_bandwidth"):
        sched.set_link_bandwidth(LINK, RATE_MBIT * 1e6)  # type: ignore[attr-defined]
    sched.on_layer_boundary("u-bulk", 0, 0.0)
    for f in (BULK, URGENT):
        sched.on_arrival(f, 0.0)
    levels = sched.priorities(0.0)
    return [{"flow_id": f.flow_id, "size_bytes": f.size_bytes, "level": levels[f.flow_id], "start_ms": 0.0}
            for f in (BULK, URGENT)]


@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
def test_rmlq_urgent_p2d_finishes_first_and_fair_sharing_does_not() -> None:
    rmlq_plan, fs_plan = plan_for("rmlq"), plan_for("fs")
    assert {p["flow_id"]: p["level"] for p in rmlq_plan} == {"bulk": 8, "urgent": 1}
    assert {p["flow_id"]: p["level"] for p in fs_plan} == {"bulk": 8, "urgent": 8}
    with netns.veth_testbed(RATE_MBIT, tag=f"{os.getpid()}") as bed:
        rmlq = netns.run_plan(bed, rmlq_plan)
        fs = netns.run_plan(bed, fs_plan)
    assert rmlq["errors"] == {} and fs["errors"] == {}
    r, f = rmlq["finish_ms"], fs["finish_ms"]
    assert r["urgent"] < r["bulk"], rmlq  # type: ignore[operator]
    assert f["urgent"] > f["bulk"], fs  # type: ignore[operator]


@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
def test_testbed_namespaces_are_removed_even_when_the_body_fails() -> None:
    tag = f"{os.getpid()}x"
    with pytest.raises(RuntimeError, match="boom"):
        with netns.veth_testbed(RATE_MBIT, tag=tag):
            raise RuntimeError("boom")
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"nsm-{tag}-a" not in listed and f"nsm-{tag}-b" not in listed
