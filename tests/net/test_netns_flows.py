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
    return [
        {"flow_id": f.flow_id, "size_bytes": f.size_bytes, "level": levels[f.flow_id], "start_ms": 0.0}
        for f in (BULK, URGENT)
    ]


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


# The replay (what `nitsum bench flows` measures): one loose background request with a big P2D transfer, then a
# tight interactive one. Its scheduler must see every flow: when it did not (the replay never called
# on_arrival), every scheduler sent at the lowest level and all gave the same TTFTs.
REPLAY_REQUESTS = [
    {
        "id": "bg",
        "tier": "background",
        "arrival_ms": 0.0,
        "reuse_bytes": 20_000,
        "p2d_bytes": 1_500_000,
        "compute_ms": 20.0,
        "slo_ms": 20_000.0,
    },
    {
        "id": "ia",
        "tier": "interactive",
        "arrival_ms": 150.0,
        "reuse_bytes": 10_000,
        "p2d_bytes": 250_000,
        "compute_ms": 20.0,
        "slo_ms": 400.0,
    },
]


@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
def test_replay_rmlq_serves_the_tight_request_ahead_of_the_loose_transfer_and_fair_sharing_does_not() -> None:
    # Thresholds spread over this link's MLU range (Q_i = 2^-i * 2: 1, 0.5, 0.25, ...): the background P2D
    # (12 Mbit over ~20 s: MLU ~0.03) is deferred, the interactive one (2 Mbit over ~0.3 s: MLU ~0.3) is not.
    def load(name: str) -> dict[str, object]:
        return {
            "scheduler": name,
            "rate_mbit": RATE_MBIT,
            "layers": 4,
            "requests": REPLAY_REQUESTS,
            "rmlq": {"e": 2.0, "u": 2.0},
        }

    with netns.veth_testbed(RATE_MBIT, tag=f"{os.getpid()}r") as bed:
        rmlq = netns.run_plan(bed, load("rmlq"), port=47010, mode="replay")["ttft_ms"]
        fs = netns.run_plan(bed, load("fs"), port=47011, mode="replay")["ttft_ms"]
    assert set(rmlq) == set(fs) == {"bg", "ia"}, (rmlq, fs)
    # RMLQ: the interactive request's flows overtake the deferred bulk P2D, so it completes while the bulk
    # transfer is still going (finish = arrival + TTFT), and sooner than under Fair Sharing, where it shares.
    assert 150.0 + float(rmlq["ia"]) < float(rmlq["bg"]), rmlq  # type: ignore[arg-type]
    assert float(rmlq["ia"]) < float(fs["ia"]), (rmlq, fs)  # type: ignore[arg-type]


@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
def test_replay_gives_a_baseline_rmlqs_overload_check_only_when_asked() -> None:
    """Three requests at once whose KV-reuse fetches alone (1 MB each, 400 ms at 20 Mbit/s) exceed the third
    one's deadline: with the check SJF prunes before sending it all (a pruned request has no TTFT);
    without it SJF sends everything, as the paper's baselines do."""
    requests = [
        {
            "id": f"q{i}",
            "tier": "interactive",
            "arrival_ms": 0.0,
            "reuse_bytes": 1_000_000,
            "p2d_bytes": 20_000,
            "compute_ms": 20.0,
            "slo_ms": 1_000.0,
        }
        for i in range(3)
    ]

    def load(prune_baselines: bool) -> dict[str, object]:
        return {
            "scheduler": "sjf",
            "rate_mbit": RATE_MBIT,
            "layers": 4,
            "requests": requests,
            "prune": True,
            "prune_baselines": prune_baselines,
        }

    with netns.veth_testbed(RATE_MBIT, tag=f"{os.getpid()}p") as bed:
        plain = netns.run_plan(bed, load(False), port=47012, mode="replay")
        checked = netns.run_plan(bed, load(True), port=47013, mode="replay")
    assert plain["pruned"] == [] and set(plain["ttft_ms"]) == {"q0", "q1", "q2"}, plain
    assert checked["pruned"], checked
    assert not set(checked["pruned"]) & set(checked["ttft_ms"]), checked
    assert set(checked["pruned"]) | set(checked["ttft_ms"]) == {"q0", "q1", "q2"}, checked
