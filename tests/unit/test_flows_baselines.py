"""Baselines (FS, SJF, EDF, Karuna) and the pure RED / pruning functions, with exact values."""

from __future__ import annotations

import math

import pytest

from nitsum.policy.flow_baselines import SCHEDULER_NAMES, make_flow_scheduler, size_class
from nitsum.policy.flow_order import RequestLoad, prune_overload, robust_effective_deadline
from nitsum.policy.flows import FlowSpec, Stage

MIB = 1 << 20


def f(fid: str, stage: Stage, size: int, deadline: float | None = None, unit: str = "u") -> FlowSpec:
    return FlowSpec(
        fid,
        f"r-{fid}",
        unit,
        stage,
        size,
        "a",
        "b",
        ("l0",),
        target_layer=None if stage.explicit else 0,
        deadline_ms=deadline,
    )


def order_by_keys(s, now: float = 0.0) -> list[str]:  # type: ignore[no-untyped-def]
    keys = s.service_keys(now)
    return sorted(keys, key=lambda k: (keys[k], k))


def test_fair_sharing_gives_every_flow_the_same_class() -> None:
    s = make_flow_scheduler("fs")
    s.on_arrival(f("big", Stage.KV_REUSE, 100 * MIB), 0.0)
    s.on_arrival(f("pd", Stage.P2D, MIB, 50.0), 0.0)
    assert s.priorities(0.0) == {"big": 8, "pd": 8}
    assert len(set(s.service_keys(0.0).values())) == 1
    assert s.rates(0.0, {"l0": 1e9}) is None


def test_sjf_serves_smallest_remaining_first_and_tracks_progress() -> None:
    s = make_flow_scheduler("sjf")
    s.on_arrival(f("a", Stage.KV_REUSE, 64 * MIB), 0.0)
    s.on_arrival(f("b", Stage.COLLECTIVE, 2 * MIB), 0.0)
    s.on_arrival(f("c", Stage.P2D, 8 * MIB, 100.0), 0.0)
    assert order_by_keys(s) == ["b", "c", "a"]
    assert s.priorities(0.0) == {"a": 5, "b": 2, "c": 3}
    s.on_progress("a", MIB // 2, 1.0)
    assert order_by_keys(s, 1.0) == ["a", "b", "c"]
    assert s.priorities(1.0)["a"] == 1


def test_edf_serves_explicit_deadlines_first_and_shares_the_rest() -> None:
    s = make_flow_scheduler("edf")
    s.on_arrival(f("coll", Stage.COLLECTIVE, MIB), 0.0)
    s.on_arrival(f("late", Stage.P2D, MIB, 300.0), 0.0)
    s.on_arrival(f("soon", Stage.MIGRATION, MIB, 100.0), 0.0)
    s.on_arrival(f("reuse", Stage.KV_REUSE, MIB), 0.0)
    assert order_by_keys(s) == ["soon", "late", "coll", "reuse"]
    keys = s.service_keys(0.0)
    assert keys["coll"] == keys["reuse"]


def test_karuna_paces_deadline_flows_at_their_minimal_rate_and_runs_the_rest_sjf() -> None:
    s = make_flow_scheduler("karuna")
    s.on_arrival(f("pd", Stage.P2D, 1_000_000, 1000.0), 0.0)
    s.on_arrival(f("big", Stage.KV_REUSE, 64 * MIB), 0.0)
    s.on_arrival(f("small", Stage.KV_REUSE, 2 * MIB), 0.0)
    assert order_by_keys(s) == ["pd", "small", "big"]
    assert s.priorities(0.0) == {"pd": 1, "small": 3, "big": 6}
    assert s.rates(500.0, {"l0": 1e9}) == {"pd": 16_000_000.0}  # 8 Mbit in 0.5 s
    assert s.rates(500.0, {"l0": 1e6}) == {"pd": 1e6}  # capped at the bottleneck
    assert s.rates(1000.0, {"l0": 1e9}) == {"pd": 1e9}  # late: as fast as the link allows


def test_size_classes_and_factory() -> None:
    assert [size_class(n, 8) for n in (0, MIB - 1, MIB, 4 * MIB - 1, 4 * MIB, 4**10 * MIB)] == [0, 0, 1, 1, 2, 7]
    assert SCHEDULER_NAMES == ("rmlq", "fs", "sjf", "edf", "karuna")
    assert [make_flow_scheduler(n).name for n in SCHEDULER_NAMES] == list(SCHEDULER_NAMES)
    with pytest.raises(ValueError, match="unknown flow scheduler"):
        make_flow_scheduler("pfabric")


def test_red_splits_at_the_largest_gap() -> None:
    assert robust_effective_deadline([]) == math.inf
    assert robust_effective_deadline([300.0]) == 300.0
    assert robust_effective_deadline([1000.0, 100.0, 1000.0, 1000.0]) == 775.0
    assert robust_effective_deadline([200.0, 200.0]) == 200.0
    # Equal largest gaps (100 → 200, 200 → 300): split at the first; f = 1/4.
    assert robust_effective_deadline([100.0, 200.0, 300.0, 300.0]) == 0.25 * 100.0 + 0.75 * 200.0


def test_prune_overload_picks_the_largest_contributor_before_the_first_miss() -> None:
    loads = [
        RequestLoad("heavy", "u1", 1000.0, 80.0),  # feasible itself, but delays u2 past its deadline
        RequestLoad("tight", "u2", 100.0, 30.0),
        RequestLoad("later", "u3", 1000.0, 500.0),  # after the miss: not a contributor
    ]
    assert prune_overload(["u1", "u2", "u3"], loads, 0.0) == ["heavy"]
    assert prune_overload(["u2", "u1", "u3"], loads, 0.0) == []
    # Repeat until feasible: both big requests of one doomed unit go.
    doomed = [RequestLoad("a", "u", 30.0, 40.0), RequestLoad("b", "u", 30.0, 30.0), RequestLoad("c", "u", 30.0, 5.0)]
    assert prune_overload(["u"], doomed, 0.0) == ["a", "b"]
    assert prune_overload([], doomed, 0.0) == []


def test_make_flow_scheduler_passes_rmlq_thresholds_and_baselines_ignore_them() -> None:
    paper = make_flow_scheduler("rmlq")
    spread = make_flow_scheduler("rmlq", rmlq_e=2.0, rmlq_u=2.0)
    assert paper.config.thresholds()[:2] == (0.125, 0.03125)  # type: ignore[attr-defined]
    assert spread.config.thresholds()[:3] == (1.0, 0.5, 0.25)  # type: ignore[attr-defined]
    assert make_flow_scheduler("fs", rmlq_e=2.0, rmlq_u=2.0).name == "fs"
    with pytest.raises(ValueError, match="E > 1"):
        make_flow_scheduler("rmlq", rmlq_e=1.0)
