"""RMLQ (Nuska) behaviour on the paper's own examples, with exact levels, orders and finish times."""

from __future__ import annotations

import pytest

from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.flows import (
    DSCP_TABLE,
    FlowSpec,
    FlowTable,
    RmlqConfig,
    RmlqScheduler,
    Stage,
    dscp_table,
    level_for_mlu,
    minimal_link_utilization,
    tos_for_dscp,
)

LINK = "l0"
LINK_BYTES_PER_MS = 1_000_000  # 1 GB/s
LINK_BPS = LINK_BYTES_PER_MS * 8 * 1000.0


def reuse(fid: str, unit: str, target: int, size: int = 1000, deadlines: tuple[float, ...] = ()) -> FlowSpec:
    return FlowSpec(
        fid,
        f"r-{fid}",
        unit,
        Stage.KV_REUSE,
        size,
        "a",
        "b",
        (LINK,),
        target_layer=target,
        request_deadlines_ms=deadlines,
    )


def collective(fid: str, unit: str, layer: int, size: int = 1000, deadlines: tuple[float, ...] = ()) -> FlowSpec:
    return FlowSpec(
        fid,
        f"r-{fid}",
        unit,
        Stage.COLLECTIVE,
        size,
        "a",
        "b",
        (LINK,),
        target_layer=layer,
        request_deadlines_ms=deadlines,
    )


def p2d(fid: str, unit: str, size: int, deadline_ms: float) -> FlowSpec:
    return FlowSpec(fid, f"r-{fid}", unit, Stage.P2D, size, "a", "b", (LINK,), deadline_ms=deadline_ms)


def rmlq(**kw: object) -> RmlqScheduler:
    return RmlqScheduler(RmlqConfig(link_bandwidth_bps={LINK: LINK_BPS}, **kw))  # type: ignore[arg-type]


def served_order(s: FlowTable, now_ms: float) -> list[str]:
    keys = s.service_keys(now_ms)
    return sorted(keys, key=lambda f: keys[f])


def run_fluid(s: FlowTable, flows: list[FlowSpec], until_ms: int, boundary_units: dict[str, int]) -> dict[str, int]:
    """One link, 1 ms steps: strict priority by service key, equal keys split evenly.

    Units in `boundary_units` cross a layer boundary every 10 ms at t ≡ 5 (mod 10), starting at that
    layer. Returns flow id → finish time in ms.
    """
    for f in flows:
        s.on_arrival(f, 0.0)
    remaining = {f.flow_id: f.size_bytes for f in flows}
    layers = dict(boundary_units)
    finish: dict[str, int] = {}
    for t in range(until_ms):
        if t % 10 == 5:
            for unit in layers:
                layers[unit] += 1
                s.on_layer_boundary(unit, layers[unit], float(t))
        keys = s.service_keys(float(t))
        capacity = LINK_BYTES_PER_MS
        for key in sorted(set(keys.values())):
            group = sorted(f for f in keys if keys[f] == key)
            share = capacity // len(group)
            for fid in group:
                sent = min(share, remaining[fid])
                remaining[fid] -= sent
                capacity -= sent
            if capacity <= 0:
                break
        for fid in sorted(keys):
            if remaining[fid] == 0:
                s.on_complete(fid, float(t + 1))
                finish[fid] = t + 1
            else:
                s.on_progress(fid, remaining[fid], float(t + 1))
    return finish


def test_thresholds_are_geometric_and_map_mlu_to_levels() -> None:
    cfg = RmlqConfig(num_levels=4, e=4.0, u=0.5)
    q = cfg.thresholds()
    assert q == (0.125, 0.03125, 0.0078125)
    assert [level_for_mlu(m, q) for m in (2.0, 0.125, 0.1, 0.03125, 0.01, 0.0078125, 0.001, 0.0)] == [
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
    ]
    # 10 MB with 1 s left on 8 Gbit/s needs 1 % of the link.
    assert minimal_link_utilization(10_000_000, 1000.0, 8e9, 0.0) == 0.01
    assert minimal_link_utilization(10_000_000, 1000.0, 8e9, 0.5) == 0.02
    assert minimal_link_utilization(1, 0.0, 8e9, 0.0) == float("inf")


def test_collective_beats_kv_reuse_of_a_later_layer_and_reuse_climbs_with_the_layer() -> None:
    s = rmlq()
    s.on_layer_boundary("u", 3, 0.0)
    s.on_arrival(reuse("reuse5", "u", target=5), 0.0)
    s.on_arrival(collective("coll3", "u", layer=3), 0.0)
    assert s.priorities(0.0) == {"coll3": 2, "reuse5": 4}  # RLI 0 → P2; RLI 2 → P4
    assert served_order(s, 0.0) == ["coll3", "reuse5"]
    s.on_layer_boundary("u", 4, 1.0)
    assert s.priorities(1.0)["reuse5"] == 3
    s.on_layer_boundary("u", 5, 2.0)
    assert s.priorities(2.0)["reuse5"] == 2
    assert s.state("reuse5").rli == 0  # type: ignore[union-attr]
    # Promotion is monotonic: a stale (smaller) layer number never demotes.
    s.on_layer_boundary("u", 1, 3.0)
    assert s.priorities(3.0)["reuse5"] == 2
    assert s.stats.promotions == 2


def test_reuse_rli_is_capped_at_the_lowest_level() -> None:
    s = rmlq(num_levels=4)
    s.on_layer_boundary("u", 0, 0.0)
    s.on_arrival(reuse("far", "u", target=60), 0.0)
    assert s.priorities(0.0) == {"far": 4}


def test_p2d_stays_deferred_until_its_mlu_crosses_a_threshold_then_climbs_and_meets_its_deadline() -> None:
    # A bulk KV-reuse fetch needed by the current layer (RLI 0, P2) keeps the link busy throughout.
    bulk = reuse("bulk", "ub", target=0, size=10**10)
    urgent = p2d("pd", "up", size=10_000_000, deadline_ms=1000.0)
    s = rmlq()
    levels: list[tuple[int, int]] = []
    orig = s._set_level

    def spy(rec, level):  # type: ignore[no-untyped-def]
        if rec.spec.flow_id == "pd" and level != rec.level:
            levels.append((level, len(levels)))
        orig(rec, level)

    s._set_level = spy  # type: ignore[method-assign]
    finish = run_fluid(s, [bulk, urgent], until_ms=1000, boundary_units={"ub": 0, "up": 0})
    # MLU(t) = 10 / (1000 − t): 0.01 → P3 at arrival; ≥ Q_2 = 1/32 first at the boundary t = 685 (P2,
    # still behind the implicit bulk flow of the same level); ≥ Q_1 = 1/8 at t = 925 → P1, alone on the
    # link: 10 MB at 1 MB/ms finishes at 935, inside its 1000 ms deadline.
    assert [lvl for lvl, _ in levels] == [3, 2, 1]
    assert finish == {"pd": 935}
    assert s.stats.promotions == 2
    assert s.stats.permits[("3", 1)] == 1 and s.stats.permits[("3", 3)] == 1
    assert s.stats.bytes_by_stage["3"] == 10_000_000


def test_fair_sharing_finishes_the_same_p2d_flow_needlessly_early() -> None:
    bulk = reuse("bulk", "ub", target=0, size=10**10)
    urgent = p2d("pd", "up", size=10_000_000, deadline_ms=1000.0)
    finish = run_fluid(make_flow_scheduler("fs"), [bulk, urgent], until_ms=1000, boundary_units={"ub": 0})
    assert finish == {"pd": 20}  # half the link from t = 0: earliness 980 ms taken from the bulk fetch


def test_explicit_flow_of_a_finished_unit_is_promoted_on_the_periodic_grid() -> None:
    s = rmlq(reevaluate_interval_ms=5.0)
    s.on_arrival(p2d("pd", "u", size=10_000_000, deadline_ms=1003.0), 0.0)
    # MLU(t) = 10 / (1003 − t) reaches Q_2 = 1/32 at t = 683 and Q_1 = 1/8 at t = 923; checks run on
    # the 5 ms grid from arrival, so the promotions land at 685 and 925 however often we look.
    assert s.priorities(0.0) == {"pd": 3}
    assert s.priorities(684.0) == {"pd": 3}
    assert s.priorities(685.0) == {"pd": 2}
    assert s.priorities(924.0) == {"pd": 2}
    assert s.priorities(925.0) == {"pd": 1}
    assert s.stats.promotions == 2
    t = RmlqScheduler(RmlqConfig(link_bandwidth_bps={LINK: LINK_BPS}, reevaluate_interval_ms=5.0))
    t.on_arrival(p2d("pd", "u", size=10_000_000, deadline_ms=1003.0), 0.0)
    assert t.priorities(2000.0) == {"pd": 1}  # one late look: straight to P1 (MLU is infinite)
    assert t.stats.promotions == 1


def test_progress_delays_the_timed_promotion() -> None:
    s = rmlq(reevaluate_interval_ms=5.0)
    s.on_arrival(p2d("pd", "u", size=10_000_000, deadline_ms=1003.0), 0.0)
    s.on_progress("pd", 5_000_000, 100.0)  # half sent: Q_1 now reached at t = 1003 − 40 = 963
    assert s.priorities(960.0) == {"pd": 2}
    assert s.priorities(965.0) == {"pd": 1}


def test_a_rise_in_link_load_rearms_the_timer() -> None:
    s = rmlq(reevaluate_interval_ms=5.0)
    s.on_arrival(p2d("pd", "u", size=10_000_000, deadline_ms=1003.0), 0.0)
    s.set_link_load(LINK, 0.5, now_ms=100.0)  # MLU doubles: Q_2 at 1003 − 640 = 363, Q_1 at 843
    assert s.priorities(360.0) == {"pd": 3}
    assert s.priorities(365.0) == {"pd": 2}
    assert s.priorities(845.0) == {"pd": 1}


def test_layer_boundaries_drive_explicit_flows_while_the_unit_computes() -> None:
    s = rmlq(reevaluate_interval_ms=5.0)
    s.on_layer_boundary("u", 0, 0.0)
    s.on_arrival(p2d("pd", "u", size=10_000_000, deadline_ms=1000.0), 0.0)
    assert s.priorities(950.0) == {"pd": 3}  # computing: no timer promotion between boundaries
    s.on_layer_boundary("u", 1, 950.0)
    assert s.priorities(950.0) == {"pd": 1}
    s.on_unit_done("u", 951.0)
    assert s.priorities(960.0) == {"pd": 1}


def test_link_load_of_higher_levels_raises_mlu() -> None:
    s = rmlq()
    s.set_link_load(LINK, 0.75)
    s.on_arrival(p2d("pd", "u", size=10_000_000, deadline_ms=1000.0), 0.0)
    assert s.state("pd").mlu == 0.04  # type: ignore[union-attr]
    assert s.priorities(0.0) == {"pd": 2}
    with pytest.raises(ValueError):
        s.set_link_load(LINK, 1.5)


def test_implicit_flows_go_before_explicit_flows_of_the_same_level() -> None:
    s = rmlq()
    s.set_link_load(LINK, 0.75)
    s.on_arrival(p2d("pd", "u1", size=10_000_000, deadline_ms=1000.0), 0.0)  # P2 (MLU 0.04)
    s.on_layer_boundary("u2", 0, 0.0)
    s.on_arrival(collective("coll", "u2", layer=0), 0.0)  # P2
    assert s.priorities(0.0) == {"pd": 2, "coll": 2}
    assert served_order(s, 0.0) == ["coll", "pd"]


def test_one_tight_request_does_not_lift_a_loose_batch_above_a_more_urgent_one() -> None:
    loose = (100.0, 1000.0, 1000.0, 1000.0)  # RED = 0.25·100 + 0.75·1000 = 775
    urgent = (500.0, 500.0)  # RED = 500
    s = rmlq()
    for unit in ("loose", "urgent"):
        s.on_layer_boundary(unit, 0, 0.0)
    s.on_arrival(collective("cl", "loose", 0, deadlines=loose), 0.0)
    s.on_arrival(collective("cu", "urgent", 0, deadlines=urgent), 0.0)
    assert s.order() == ["urgent", "loose"]
    assert served_order(s, 0.0) == ["cu", "cl"]
    # EDF's min-deadline order is the one the piggyback effect misleads.
    edf = make_flow_scheduler("edf")
    edf.on_arrival(collective("cl", "loose", 0, deadlines=loose), 0.0)
    edf.on_arrival(collective("cu", "urgent", 0, deadlines=urgent), 0.0)
    assert edf.order() == ["loose", "urgent"]


def test_sigma_drops_units_without_flows() -> None:
    s = rmlq()
    s.on_arrival(p2d("a", "ua", 10, 300.0), 0.0)
    s.on_arrival(p2d("b", "ub", 10, 200.0), 0.0)
    assert s.order() == ["ub", "ua"]
    s.on_complete("b", 1.0)
    assert s.order() == ["ua"]
    assert s.priorities(1.0).keys() == {"a"}
    assert s.stats.bytes_by_stage == {"3": 10}


def test_pruning_removes_the_largest_contributor_and_restores_feasibility() -> None:
    s = rmlq()

    def flow(fid: str, rid: str, unit: str, deadline: float, unit_deadlines: tuple[float, ...]) -> FlowSpec:
        return FlowSpec(
            fid,
            rid,
            unit,
            Stage.COLLECTIVE,
            100,
            "a",
            "b",
            (LINK,),
            target_layer=0,
            request_deadlines_ms=unit_deadlines,
            request_deadline_ms=deadline,
        )

    s.on_arrival(flow("f1", "r1", "u1", 100.0, (100.0,)), 0.0)
    s.on_arrival(flow("f2", "r2", "u2", 150.0, (150.0, 150.0)), 0.0)
    s.on_arrival(flow("f3", "r3", "u2", 150.0, (150.0, 150.0)), 0.0)
    s.on_arrival(flow("f4", "r4", "u3", 500.0, (500.0,)), 0.0)
    assert s.order() == ["u1", "u2", "u3"]
    delays = {"r1": 30.0, "r2": 20.0, "r3": 300.0, "r4": 50.0}
    # Unit u2 would finish at 350 > 150; r3 contributes most → pruned; then 30, 50, 100 all fit.
    assert s.prune(0.0, delays) == ["r3"]
    assert s.priorities(0.0).keys() == {"f1", "f2", "f4"}
    assert s.state("f3").pruned  # type: ignore[union-attr]
    assert s.stats.pruned_requests == 1
    assert s.prune(0.0, delays) == []
    # A late flow of a pruned request stays suppressed.
    s.on_arrival(flow("f3b", "r3", "u2", 150.0, (150.0, 150.0)), 1.0)
    assert "f3b" not in s.priorities(1.0)


def test_pruning_on_batch_arrival_checks_a_batch_that_has_sent_nothing_yet() -> None:
    """A batch that just arrived has no flow; it takes its place in σ by its requests' RED and is checked."""
    s = rmlq()
    s.on_arrival(p2d("a", "u1", 10, 100.0), 0.0)  # request r-a, deadline 100
    pending = {"n1": ("u2", 120.0), "n2": ("u2", 400.0), "late": ("u3", 50.0)}
    # σ: u3 (RED 50) first, then u1 (100), then u2 (RED of 120 and 400).
    assert s._order_with({"r-a": "u1", **{r: u for r, (u, _) in pending.items()}}, {"late": 50.0}) == [
        "u3",
        "u1",
        "u2",
    ]
    delays = {"r-a": 10.0, "n1": 30.0, "n2": 250.0, "late": 60.0}
    # u3 ends at 60 > 50: pruned (the only one there); then u1 at 10 and u2 at 290 > 120: n2 contributes most.
    assert s.prune(0.0, delays, pending) == ["late", "n2"]
    assert s.prune(0.0, delays, pending) == []  # pruned requests stay out of later checks
    # the pruned request's first flow, when it comes, is suppressed; the survivor's is not
    s.on_arrival(FlowSpec("n2f", "n2", "u2", Stage.P2D, 10, "a", "b", (LINK,), deadline_ms=400.0), 1.0)
    s.on_arrival(FlowSpec("n1f", "n1", "u2", Stage.P2D, 10, "a", "b", (LINK,), deadline_ms=120.0), 1.0)
    assert s.priorities(1.0).keys() == {"a", "n1f"}
    # baselines take the same call and prune nothing
    assert make_flow_scheduler("sjf").prune(0.0, delays, pending) == []


def test_a_baseline_built_with_the_overload_check_prunes_in_its_own_unit_order() -> None:
    """The breakdown's variant: a baseline runs RMLQ's worst-case check, walking its own σ. FS ranks units by
    arrival, so a loose unit that came first is counted ahead of an urgent one; EDF ranks by deadline as RMLQ."""
    loose = p2d("loose", "u-loose", 10, 500.0)  # request r-loose, arrives first
    urgent = p2d("urgent", "u-urgent", 10, 100.0)  # request r-urgent
    delays = {"r-loose": 80.0, "r-urgent": 50.0}
    for name in ("fs", "edf"):
        assert make_flow_scheduler(name).prune(0.0, delays) == []  # the paper's baselines: no pruning
    fs = make_flow_scheduler("fs", overload_check=True)
    edf = make_flow_scheduler("edf", overload_check=True)
    for s in (fs, edf):
        s.on_arrival(loose, 0.0)
        s.on_arrival(urgent, 0.0)
    assert fs.order() == ["u-loose", "u-urgent"] and edf.order() == ["u-urgent", "u-loose"]
    # FS: loose ends at 80, urgent at 130 > 100: the larger contributor up to there (loose, 80 ms) goes.
    assert fs.prune(0.0, delays) == ["r-loose"]
    assert fs.priorities(0.0).keys() == {"urgent"} and fs.stats.pruned_requests == 1
    # EDF: urgent at 50, loose at 130: both fit.
    assert edf.prune(0.0, delays) == []
    # and RMLQ can be built without it
    off = make_flow_scheduler("rmlq", overload_check=False)
    off.on_arrival(p2d("x", "ux", 10, 10.0), 0.0)
    assert off.prune(0.0, {"r-x": 50.0}) == []


def test_dscp_table_defaults() -> None:
    assert DSCP_TABLE == {1: 46, 2: 34, 3: 26, 4: 18, 5: 10, 6: 0, 7: 8, 8: 1}
    assert dscp_table(3) == {1: 46, 2: 34, 3: 1}
    assert tos_for_dscp(46) == 184
    with pytest.raises(ValueError):
        dscp_table(9)


def test_flow_spec_validation() -> None:
    with pytest.raises(ValueError, match="deadline_ms"):
        FlowSpec("f", "r", "u", Stage.P2D, 1, "a", "b")
    with pytest.raises(ValueError, match="target_layer"):
        FlowSpec("f", "r", "u", Stage.KV_REUSE, 1, "a", "b")
    with pytest.raises(ValueError, match="size_bytes"):
        FlowSpec("f", "r", "u", Stage.COLLECTIVE, -1, "a", "b")
    with pytest.raises(ValueError):
        RmlqConfig(num_levels=1)
