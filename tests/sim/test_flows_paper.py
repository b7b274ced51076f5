"""Nuska on the flow-level network (issue #19): the paper's contention example, overload pruning, the §6.3 setup."""

from __future__ import annotations

import dataclasses
import math

import pytest

from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.flows import FlowSpec, RmlqConfig, RmlqScheduler, Stage
from nitsum.sim.engine import Simulator
from nitsum.sim.flowsetup import PAPER_SETUPS, moe_spec, shard_spec
from nitsum.sim.flowsim import FlowClusterConfig, FlowClusterSim
from nitsum.sim.network import Network
from nitsum.workloads import TraceRequest

LINK_BPS = 100e9  # one 100 Gb/s link: 1 GB takes 80 ms
GB = 1_000_000_000


class _Driver:
    """A scheduler on one link of the flow-level network, consulted every millisecond (the sim's refresh)."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.sim = Simulator()
        self.net = Network(self._done)
        self.net.add_link("l", LINK_BPS)
        self.done: dict[str, float] = {}
        self.on_done = None

    def add(self, spec: FlowSpec) -> None:
        now = self.sim.now_ms
        self.sched.on_arrival(spec, now)
        self.net.add_flow(spec.flow_id, ("l",), spec.size_bytes, now, key=(math.inf,))

    def _done(self, sim, flow, now):
        self.sched.on_complete(flow.fid, now)
        self.done[flow.fid] = now
        if self.on_done is not None:
            self.on_done(flow.fid, now)
        return self._commit()

    def _commit(self):
        now = self.sim.now_ms
        keys = self.sched.service_keys(now)
        for fid in self.net.flows:
            self.net.set_key(fid, keys.get(fid, (math.inf,)), now)
        return self.net.commit(now)

    def _refresh(self, sim, _):
        out = self._commit()
        if self.net.flows:
            out.append((sim.now_ms + 1.0, self._refresh, None))
        return out

    def start(self, until_ms: float) -> None:
        self.sim.schedule(0.0, self._refresh, None)
        self.sim.run(until_ms=until_ms)


def _rmlq() -> RmlqScheduler:
    return RmlqScheduler(RmlqConfig(link_bandwidth_bps={"l": LINK_BPS}))


def _contention(sched):
    """A stage-3 KV transfer (1 GB, deadline 2 s) on a link that back-to-back stage-2 all-to-alls of a computing
    batch keep busy (0.5 GB each, one after the other, for 3 s)."""
    d = _Driver(sched)
    starts: dict[str, float] = {}
    count = [0]

    def next_collective(_fid=None, now=0.0):
        if now >= 3000.0 or (_fid is not None and not _fid.startswith("a2a")):
            return
        count[0] += 1
        fid = f"a2a{count[0]}"
        sched.on_layer_boundary("u1", count[0], now)
        starts[fid] = now
        d.add(FlowSpec(fid, "r1", "u1", Stage.COLLECTIVE, GB // 2, "a", "b", ("l",), target_layer=count[0]))

    d.on_done = next_collective
    next_collective()
    d.add(FlowSpec("p2d", "r0", "u0", Stage.P2D, GB, "a", "c", ("l",), deadline_ms=2000.0, request_deadline_ms=2000.0))
    d.start(until_ms=4000.0)
    cct = {f: d.done[f] - starts[f] for f in starts if f in d.done}
    return d.done["p2d"], cct


def test_contention_example_stage2_protected_stage3_deferred_to_its_deadline():
    p2d_done, cct = _contention(_rmlq())
    alone = GB / 2 * 8 / LINK_BPS * 1000  # 40 ms
    # Stage 3 waits while it has slack, is promoted as its MLU rises, and still lands before its deadline.
    assert 1000.0 < p2d_done <= 2000.0
    # Every all-to-all that did not overlap the promoted transfer ran at the full link rate.
    unhindered = [c for c in cct.values() if c == pytest.approx(alone, rel=1e-6)]
    assert len(unhindered) >= len(cct) - 4
    # Fair sharing: the transfer finishes early (it had 2 s) and the first all-to-alls take twice as long.
    fs_done, fs_cct = _contention(make_flow_scheduler("fs"))
    assert fs_done < 200.0
    assert fs_cct["a2a1"] == pytest.approx(2 * alone, rel=1e-6)
    assert max(fs_cct["a2a1"], fs_cct["a2a2"]) > max(cct["a2a1"], cct["a2a2"])
    # The one all-to-all RMLQ slowed is the one running when the transfer reached P1 (MLU past Q_1 = 0.125:
    # 640 ms before its deadline), and the transfer then took the link alone: done at 2000 - 640 + 80 ms.
    assert p2d_done == pytest.approx(2000.0 - 640.0 + 80.0, abs=1.0)
    assert [f for f, c in cct.items() if c > alone * 1.000001] == ["a2a35"]


def _overload(prune: bool):
    """One big transfer whose deadline is first, four small ones after it: the link cannot carry all five."""
    sched = _rmlq()
    d = _Driver(sched)
    specs = [
        FlowSpec("big", "rb", "ub", Stage.P2D, 2 * GB, "a", "b", ("l",), deadline_ms=170.0, request_deadline_ms=170.0)
    ]
    for i in range(4):
        dl = 200.0 + 5 * i
        specs.append(
            FlowSpec(
                f"s{i}", f"r{i}", f"u{i}", Stage.P2D, GB // 2, "a", "b", ("l",), deadline_ms=dl, request_deadline_ms=dl
            )
        )
    for s in specs:
        d.add(s)
    pruned: list[str] = []
    if prune:
        est = {s.request_id: s.size_bytes * 8 / LINK_BPS * 1000 for s in specs}
        pruned = sched.prune(0.0, est)
        for s in specs:
            if s.request_id in pruned:  # the service withdraws a pruned request's flows
                d.net.remove_flow(s.flow_id, 0.0)
                sched.on_complete(s.flow_id, 0.0)
    d.start(until_ms=2000.0)
    met = [s.request_id for s in specs if s.flow_id in d.done and d.done[s.flow_id] <= s.deadline_ms + 1e-6]
    return pruned, met


def test_pruning_restores_feasibility_on_a_crafted_overload():
    pruned, met = _overload(prune=True)
    assert pruned == ["rb"]  # the largest contributor to the cumulative delay at the first violation
    assert met == ["r0", "r1", "r2", "r3"]  # every request left meets its deadline
    no_pruned, no_met = _overload(prune=False)
    assert no_pruned == [] and len(no_met) == 2  # without pruning the big one pushes three past their deadlines


def test_paper_setups_are_32_gpu_instances_with_the_stated_parallelism():
    assert {(s.model, s.tp, s.ep) for s in PAPER_SETUPS.values()} == {
        ("mixtral-8x22b", 4, 8),
        ("dbrx", 2, 16),
        ("qwen3-coder", 1, 32),
    }
    for s in PAPER_SETUPS.values():
        assert s.gpus == 32
        assert FlowClusterConfig(model=s.model, tp=s.tp, ep=s.ep).instance_servers == 4
        m = moe_spec(s.model)
        shard = shard_spec(m, s.ep)
        # one EP rank holds every attention layer and 1/EP of the experts; active parameters are unchanged
        assert shard.num_experts * s.ep == m.num_experts
        assert shard.active_params == m.active_params
    with pytest.raises(ValueError, match="whole servers"):
        _ = FlowClusterConfig(tp=2, ep=2).instance_servers


def _burst(n: int, prompt: int, hashes=()) -> list[TraceRequest]:
    return [TraceRequest(0.0, prompt, 1, prefix_hash_ids=tuple(hashes)) for _ in range(n)]


def test_all_to_all_between_the_instance_servers_is_stage2_traffic_on_the_nics():
    sim = FlowClusterSim("fs", FlowClusterConfig(num_servers=8, prune=False), _burst(1, 8192))
    res = sim.run()
    assert res["report"].overall.slo_attainment == 1.0
    b = res["bottleneck"]
    assert b["uplink_util_stage2"] > 0 and b["uplink_util_stage3"] > 0 and b["uplink_util_stage1"] == 0
    # 4 blocks x 12 server pairs, each a2a_bytes_per_flow of the batch's tokens
    assert sim.bytes_by_stage["2"] == pytest.approx(4 * 12 * sim.a2a_bytes_per_flow(8192), rel=1e-6)
    assert len(res["cct_samples"]) == 4


def test_kv_reuse_fetch_when_the_prefix_lives_on_another_instance():
    c = FlowClusterConfig(num_servers=16, prune=False)  # two prefill instances
    first = TraceRequest(0.0, 4096, 1, prefix_hash_ids=tuple(range(8)))
    # a long prompt with the same prefix follows it to its instance (KV-aware routing: a local hit); the third
    # shares the prefix too, but that instance is busy for long, so the router sends it to the idle one, and
    # it fetches the 4096 cached tokens from the server that computed them (stage 1)
    blocker = TraceRequest(1.0, 32_768, 1, prefix_hash_ids=tuple(range(8)) + tuple(range(100, 156)))
    second = TraceRequest(2.0, 4096 + 512, 1, prefix_hash_ids=tuple(range(8)) + (999,))
    sim = FlowClusterSim("rmlq", c, [first, blocker, second])
    res = sim.run()
    assert all(r.done_ms is not None for r in sim.reqs) and res["report"].overall.slo_attainment == 1.0
    a, b, r = sim.reqs
    assert b.home == a.home and b.holder is None and b.cached == 4096  # local hit: no fetch
    assert sim.instance_of_server[r.home] != sim.instance_of_server[a.home]
    assert r.holder == a.home and r.cached == 4096
    assert sim.bytes_by_stage["1"] == pytest.approx(sim.kv_bytes(4096), rel=1e-6)


def test_overloaded_cluster_prunes_with_a_clear_error_and_loses_nothing():
    c = FlowClusterConfig(num_servers=8)
    reqs = _burst(40, 16_384)
    sim = FlowClusterSim("rmlq", c, reqs)
    res = sim.run(drain_ms=60_000.0)
    assert res["pruned"] > 0
    for r in sim.reqs:
        assert (r.done_ms is not None) != (r.error == "pruned")  # each request ends exactly one way
    assert not sim.net.flows and not sim.flow_meta and not sim.units
    errors = res["report"].overall.errors
    assert errors.get("pruned") == res["pruned"]
    # baselines never prune, unless the breakdown gives them RMLQ's check (then they lose nothing either)
    base = FlowClusterSim("fs", c, reqs).run(drain_ms=60_000.0)
    assert base["pruned"] == 0 and base["report"].overall.errors == {}
    for name in ("fs", "sjf"):
        checked = FlowClusterSim(name, dataclasses.replace(c, prune_baselines=True), reqs)
        res = checked.run(drain_ms=60_000.0)
        assert res["pruned"] > 0 and res["report"].overall.errors == {"pruned": res["pruned"]}
        assert all((r.done_ms is not None) != (r.error == "pruned") for r in checked.reqs)


def test_a_trace_window_with_a_warm_cache_keeps_the_traces_reuse():
    """The experiment's workload: trace rows from the middle on, in order, the rows before it already cached.
    The reuse the simulator finds equals the leading-block reuse counted straight from the trace."""
    from nitsum.sim.experiments.flows import windowed
    from nitsum.workloads import default_trace_path, read_mooncake

    trace = read_mooncake(default_trace_path("mooncake-conv", prefer_excerpt=True))
    start = len(trace) // 2
    reqs = windowed(trace, start, 20.0, 3.0, seed=1)
    assert [r.prefix_hash_ids for r in reqs] == [t.prefix_hash_ids for t in trace[start : start + len(reqs)]]
    assert all(b.arrival_ms > a.arrival_ms for a, b in zip(reqs, reqs[1:]))
    c = FlowClusterConfig(num_servers=16, prune=False)
    sim = FlowClusterSim("fs", c, reqs, warm=trace[:start])
    res = sim.run()
    seen: set[int] = set()
    cached = prompt = 0
    for i, t in enumerate(trace[: start + len(reqs)]):
        p = min(t.prompt_tokens, c.max_prompt_tokens)
        hashes = t.prefix_hash_ids[: -(-p // 512)]
        lead = 0
        for h in hashes:
            if h not in seen:
                break
            lead += 1
        seen.update(hashes)
        if i >= start:
            cached += min(lead * 512, p - 1)
            prompt += p
    assert res["reuse_ratio"] == pytest.approx(cached / prompt, abs=1e-9)
    assert res["reuse_ratio"] > 0.05  # the 300-row excerpt: 12 % of its second half is a cached prefix


def test_the_scheduler_learns_each_flows_remaining_bytes():
    """MLU, SJF sizes and Karuna's rates are computed on what a flow has left: the sim reports progress."""
    import math as _math

    sim = FlowClusterSim("rmlq", FlowClusterConfig(num_servers=8, prune=False), _burst(2, 16_384))
    seen: list[tuple[int, float, int]] = []

    def probe(s, _):
        for fid, f in sim.net.flows.items():
            st = sim.sched.state(fid)
            seen.append((st.remaining_bytes, f.size, _math.ceil(sim.net.remaining_bytes(fid, s.now_ms))))
        return [(s.now_ms + 1.0, probe, None)] if s.now_ms < 5_000 else []

    sim.sim.schedule(0.5, probe, None)
    sim.run()
    assert any(rem < size for rem, size, _ in seen)
    assert all(rem >= on_wire for rem, _, on_wire in seen)  # never ahead of the network


def _stage_arrivals(sim: FlowClusterSim) -> list[tuple[float, Stage]]:
    seen: list[tuple[float, Stage]] = []
    arrive = sim.sched.on_arrival

    def record(spec, now):
        seen.append((now, spec.stage))
        arrive(spec, now)

    sim.sched.on_arrival = record
    return seen


@pytest.mark.parametrize("layerwise", [True, False])
def test_stage3_leaves_block_by_block_as_each_block_is_computed(layerwise):
    """Rule 32: the paper's P2D stage emits its flows per layer; `p2d_layerwise=False` is one transfer at the end."""
    c = FlowClusterConfig(num_servers=8, prune=False, p2d_layerwise=layerwise)
    sim = FlowClusterSim("fs", c, _burst(1, 8192))
    seen = _stage_arrivals(sim)
    res = sim.run()
    (r,) = sim.reqs
    p2d = [t for t, s in seen if s is Stage.P2D]
    a2a = sorted({t for t, s in seen if s is Stage.COLLECTIVE})  # one all-to-all per block
    assert len(a2a) == c.layer_blocks
    if layerwise:
        assert p2d == a2a  # block b's KV leaves when block b's compute ends, beside its all-to-all
    else:
        assert len(p2d) == 1 and p2d[0] > a2a[-1]
    assert sim.bytes_by_stage["3"] == pytest.approx(sim.kv_bytes(8192), rel=1e-6)
    assert r.done_ms is not None and r.done_ms >= p2d[-1] and res["report"].overall.slo_attainment == 1.0
    # the idle TTFT behind the SLO follows the same pipeline: layer-wise, only the last block's KV is on the path
    iso = sim.isolated_ttft_ms(8192, 0, False)
    assert iso == pytest.approx(r.slo / c.slo_factor)
    other = FlowClusterSim("fs", FlowClusterConfig(num_servers=8, p2d_layerwise=not layerwise), [])
    assert (iso < other.isolated_ttft_ms(8192, 0, False)) == layerwise


def test_layerwise_stage3_meets_its_own_batchs_all_to_all_and_rmlq_defers_it():
    """The paper's Fig. 7 on the simulator: stage 3 beside the batch's stage 2. FS shares the uplink and dilutes the
    all-to-all, EDF puts the explicit deadline first and dilutes it more, RMLQ defers stage 3 (its MLU is far below
    Q_1) and the all-to-all runs at full rate. Sent after the last block, stage 3 meets no all-to-all of its own batch
    and every scheduler's collective time is the same."""

    def cct(name: str, layerwise: bool) -> tuple[float, float]:
        sim = FlowClusterSim(
            name, FlowClusterConfig(num_servers=8, prune=False, p2d_layerwise=layerwise), _burst(1, 16_384)
        )
        res = sim.run()
        return res["cct_ms"].mean, sim.reqs[0].done_ms

    rmlq, fs, edf = (cct(n, True) for n in ("rmlq", "fs", "edf"))
    assert rmlq[0] < fs[0] < edf[0]
    assert rmlq[1] < fs[1]  # a shorter prefill makespan: the first token comes sooner
    after = [cct(n, False)[0] for n in ("rmlq", "fs", "edf")]
    assert after == pytest.approx([rmlq[0]] * 3)


def test_a_doomed_batch_is_pruned_when_it_arrives_before_it_computes():
    """Rule 33: the check on batch arrival covers the batch that arrived, before it has sent anything, so its compute
    is not spent on requests that cannot make it. A burst: after the first batches no one can meet the deadline."""
    c = FlowClusterConfig(num_servers=8)
    reqs = _burst(12, 16_384)
    rm = FlowClusterSim("rmlq", c, reqs)
    res = rm.run(drain_ms=60_000.0)
    fs = FlowClusterSim("fs", c, reqs)
    base = fs.run(drain_ms=60_000.0)
    assert res["pruned"] > 0 and base["pruned"] == 0
    assert res["report"].overall.slo_attainment >= base["report"].overall.slo_attainment
    pruned = [r for r in rm.reqs if r.error == "pruned"]
    assert pruned and all(r.p2d_emitted == 0 for r in pruned)  # given up before any block of theirs was computed
    assert rm.compute_ms < fs.compute_ms
    assert not rm.net.flows and not rm.flow_meta and not rm.units


def test_a_batch_stalled_on_a_later_blocks_fetch_raises_it_to_rli_zero():
    """Rule 34: a batch waiting for block b's KV-reuse fetch is at block b's first layer, so that fetch is RLI 0 (the
    highest implicit level) while the batch waits; before, the batch reported no boundary until the fetch had
    arrived, and a fetch for a later block sat at the lowest level while its batch stalled on it."""
    c = FlowClusterConfig(num_servers=16, prune=False, nics_per_server=1)
    first = TraceRequest(0.0, 4096, 1, prefix_hash_ids=tuple(range(8)))
    blocker = TraceRequest(1.0, 32_768, 1, prefix_hash_ids=tuple(range(8)) + tuple(range(100, 156)))
    second = TraceRequest(2.0, 4096 + 512, 1, prefix_hash_ids=tuple(range(8)) + (999,))
    sim = FlowClusterSim("rmlq", c, [first, blocker, second])
    stalled: list[tuple[int, list[int]]] = []
    try_block = sim._try_block

    def watch(u):
        was = u.wait_from
        events = try_block(u)
        if was is None and u.wait_from is not None:  # it has just stalled on block u.block's fetches
            levels = [
                sim.sched.state(fid).level
                for fid, (fu, block, stage, _) in sim.flow_meta.items()
                if fu is u and stage is Stage.KV_REUSE and block == u.block
            ]
            stalled.append((u.block, levels))
        return events

    sim._try_block = watch
    res = sim.run()
    assert res["report"].overall.slo_attainment == 1.0
    assert stalled and all(levels and set(levels) == {2} for _, levels in stalled)  # P2 = RLI 0
