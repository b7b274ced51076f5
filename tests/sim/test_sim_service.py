"""The simulator's device tables and service model: what `device_kind` accepts, what a service model adds to a
request (exactly), the seeded draws, and calibration from live vs simulated records."""

from __future__ import annotations

import dataclasses
import random

import pytest

from nitsum.metrics import make_record
from nitsum.policy.costmodel import cost_model, load_device_table
from nitsum.sim.cluster import ClusterConfig, ClusterSim, run_cluster
from nitsum.sim.service import ServiceModel, ServiceSampler, calibrate_service, calibrate_service_fixed_point, draw
from nitsum.workloads import TraceRequest

ONE = [TraceRequest(arrival_ms=0.0, prompt_tokens=100, output_tokens=4)]


def cpu_config(**kw) -> ClusterConfig:
    base = dict(model="tiny", device_kind="cpu", num_nodes=1, devices_per_node=1, min_tp=1, max_tp=1, max_batch=64)
    return ClusterConfig(**{**base, **kw})


def slow_table():
    table = load_device_table(None)
    return dataclasses.replace(table, name="cpu-slow", step_overhead_ms=table.step_overhead_ms + 2.0)


# -- device tables -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["spec", "path", "cost_model"])
def test_device_kind_takes_a_measured_table(form, tmp_path):
    table = slow_table()
    path = tmp_path / "table.json"
    path.write_text(table.to_json())
    kind = {"spec": table, "path": str(path), "cost_model": cost_model("tiny", table)}[form]
    config = cpu_config(device_kind=kind)
    sim = ClusterSim("static-tp:1", config, ONE)
    assert sim.cost.device == table
    assert config.policy_config().devices == (("cpu-slow", table),)
    assert sim.policy.cost_for(sim._node_view(sim.nodes[0])).device == table  # the policy steps on it too
    res = sim.run()
    assert res.records[0].ttft_ms == pytest.approx(cost_model("tiny", table).step_time_ms(1, 1, 100, 100))


def test_device_kind_preset_names_are_kept():
    assert cpu_config().device_name == "cpu"
    assert ClusterConfig(device_kind="h200").device.name == "h200"


@pytest.mark.parametrize(
    "kind, message",
    [
        ("tpu", "unknown device kind 'tpu'; known: cpu, a100, h100, h200, or a path"),
        ("/nonexistent/table.json", "no such file"),
        (3, "not int"),
    ],
)
def test_unknown_device_kind_is_a_clear_error(kind, message):
    with pytest.raises(ValueError, match=message):
        cpu_config(device_kind=kind)


def test_cost_model_of_another_model_is_refused():
    with pytest.raises(ValueError, match="cost model of 'llama-3-8b'"):
        cpu_config(device_kind=cost_model("llama-3-8b", "h100"))


# -- the service model -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(path_ms=()), "at least one"),
        (dict(path_ms=(-1.0,)), "path samples"),
        (dict(step_ratios=(0.0,)), "step ratios"),
        (dict(noise_window_ms=-5.0), "noise_window_ms"),
    ],
)
def test_service_model_rejects_bad_samples(kw, message):
    with pytest.raises(ValueError, match=message):
        ServiceModel(**kw)


def test_service_model_adds_the_path_to_ttft_and_scales_decode_steps_only():
    bare = run_cluster("static-tp:1", cpu_config(), ONE).records[0]
    service = ServiceModel(path_ms=(3.0,), step_ratios=(2.0,))
    got = run_cluster("static-tp:1", cpu_config(service=service), ONE).records[0]
    assert got.send_ms == bare.send_ms == 0.0
    assert got.ttft_ms == pytest.approx(bare.ttft_ms + 3.0)  # the prefill step itself is not scaled
    assert got.tpot_ms == pytest.approx(2.0 * bare.tpot_ms)
    assert got.output_tokens == bare.output_tokens == 4


def test_the_path_delays_what_the_client_sees_not_admission():
    # A 500 ms path is longer than the interactive TTFT target (200 ms): the request is still admitted and served
    # (the path is observed after the engine), its TTFT includes it and its TPOT does not.
    w = [
        TraceRequest(arrival_ms=0.0, prompt_tokens=16, output_tokens=2),
        TraceRequest(arrival_ms=10.0, prompt_tokens=16, output_tokens=2),
    ]
    bare = run_cluster("static-tp:1", cpu_config(epoch_ms=1.0), w).records
    res = run_cluster("static-tp:1", cpu_config(epoch_ms=1.0, service=ServiceModel(path_ms=(500.0,))), w)
    assert [r.succeeded for r in res.records] == [True, True]
    assert [r.ttft_ms for r in res.records] == [pytest.approx(b.ttft_ms + 500.0) for b in bare]
    assert [r.tpot_ms for r in res.records] == [pytest.approx(b.tpot_ms) for b in bare]


def test_stalled_samples_give_all_tokens_at_once():
    # Path samples 0 and 50 ms, the 50 ms one stalled. Seed 5's draws (from Random(10)) put the first request
    # near 50 (stalled: TPOT 0) and the second near 0 (its tokens as simulated, shifted by its path).
    w = [
        TraceRequest(arrival_ms=0.0, prompt_tokens=16, output_tokens=4),
        TraceRequest(arrival_ms=10.0, prompt_tokens=16, output_tokens=4),
    ]
    model = ServiceModel(path_ms=(0.0, 50.0), stalled=(False, True), seed=5)
    u = random.Random(10)
    (p1, n1), (p2, n2) = draw([0.0, 50.0], u.random()), draw([0.0, 50.0], u.random())
    assert (n1, n2) == (1, 0)
    bare = run_cluster("static-tp:1", cpu_config(), w).records
    first, second = run_cluster("static-tp:1", cpu_config(service=model), w).records
    assert (first.request_id, second.request_id) == ("r0", "r1")
    assert first.ttft_ms == pytest.approx(p1 + bare[0].ttft_ms) and first.tpot_ms == 0.0
    assert second.ttft_ms == pytest.approx(p2 + bare[1].ttft_ms) and second.tpot_ms == pytest.approx(bare[1].tpot_ms)
    with pytest.raises(ValueError, match="one stalled flag"):
        ServiceModel(path_ms=(1.0, 2.0), stalled=(True,))


def test_draws_interpolate_the_empirical_distribution():
    assert draw([1.0, 2.0, 4.0], 0.0) == (1.0, 0)
    assert draw([1.0, 2.0, 4.0], 0.25) == (1.5, 0)  # position 0.5: halfway from 1 to 2, nearest sample 0
    assert draw([1.0, 2.0, 4.0], 0.75) == (3.0, 2)  # position 1.5: halfway from 2 to 4 (round half to even: 2)
    assert draw([1.0, 2.0, 4.0], 0.999) == (pytest.approx(3.996), 2)
    assert draw([7.0], 0.6) == (7.0, 0)


def test_sampler_draws_one_ratio_per_window_in_order():
    model = ServiceModel(
        path_ms=(4.0, 1.0, 2.0), stalled=(True, False, False), step_ratios=(3.0, 1.0, 2.0), noise_window_ms=10.0, seed=7
    )
    s = ServiceSampler(model)
    ratios = random.Random(15)
    draws = [draw([1.0, 2.0, 3.0], ratios.random())[0] for _ in range(4)]
    assert len(set(draws)) == 4
    assert s.step_ratio(0.0) == draws[0]
    assert s.step_ratio(9.99) == draws[0]  # same window
    assert s.step_ratio(35.0) == draws[3]  # windows 1 and 2 were drawn although no step started in them
    paths = random.Random(14)
    expected = []
    for _ in range(20):
        value, nearest = draw([1.0, 2.0, 4.0], paths.random())
        expected.append((value, nearest == 2))  # the flag travels with its sample (4.0) through the sort
    assert [s.path() for _ in range(20)] == expected and any(f for _, f in expected)
    per_step = ServiceSampler(dataclasses.replace(model, noise_window_ms=0.0))
    fresh = random.Random(15)
    assert [per_step.step_ratio(1.0) for _ in range(6)] == [draw([1.0, 2.0, 3.0], fresh.random())[0] for _ in range(6)]


def test_one_step_ratio_per_window_for_every_decode_step_in_it():
    # Two requests 500 ms apart, windows of 400 ms: each decodes inside one window, with that window's draw.
    w = [
        TraceRequest(arrival_ms=0.0, prompt_tokens=32, output_tokens=6),
        TraceRequest(arrival_ms=500.0, prompt_tokens=32, output_tokens=6),
    ]
    bare = run_cluster("static-tp:1", cpu_config(), w).records
    model = ServiceModel(step_ratios=(2.0, 5.0, 7.0), noise_window_ms=400.0, seed=4)
    u = random.Random(9)
    r1, r2 = draw([2.0, 5.0, 7.0], u.random())[0], draw([2.0, 5.0, 7.0], u.random())[0]
    assert r1 != r2
    got = run_cluster("static-tp:1", cpu_config(service=model), w).records
    assert [g.tpot_ms for g in got] == [pytest.approx(r1 * bare[0].tpot_ms), pytest.approx(r2 * bare[1].tpot_ms)]
    assert [g.ttft_ms for g in got] == [pytest.approx(b.ttft_ms) for b in bare]  # path 0, prefill not scaled


def test_a_decode_keeps_the_ratio_of_the_window_it_started_in():
    # Windows of 2 ms: a 40-token decode spans many of them, yet every one of its steps takes its starting
    # window's draw (the first window is drawn at the decode's start, after the prefill step).
    w = [TraceRequest(arrival_ms=0.0, prompt_tokens=32, output_tokens=40)]
    bare = run_cluster("static-tp:1", cpu_config(), w).records[0]
    model = ServiceModel(step_ratios=(2.0, 5.0, 7.0), noise_window_ms=2.0, seed=1)
    s = ServiceSampler(model)
    start_ratio = s.step_ratio(bare.first_token_ms)
    got = run_cluster("static-tp:1", cpu_config(service=model), w).records[0]
    assert got.tpot_ms == pytest.approx(start_ratio * bare.tpot_ms)
    assert bare.finish_ms - bare.first_token_ms > 4 * model.noise_window_ms  # it did span several windows


def test_a_decode_step_is_slowed_by_the_mean_ratio_of_its_requests():
    # Flat 1 ms steps. A prefills in [0, 1]; [1, 2] is A's first decode mixed with B's prefill (a step with
    # prefill tokens is not scaled); from t = 2 both decode: A started in window 0, B in window 1.
    from nitsum.policy.costmodel import DeviceSpec

    flat = DeviceSpec(
        "flat",
        peak_flops=1e30,
        mem_bandwidth_bytes_per_s=1e30,
        link_bandwidth_bytes_per_s=1.0,
        memory_bytes=1e12,
        step_overhead_ms=1.0,
    )
    w = [
        TraceRequest(arrival_ms=0.0, prompt_tokens=4, output_tokens=3),
        TraceRequest(arrival_ms=0.5, prompt_tokens=4, output_tokens=3),
    ]
    model = ServiceModel(step_ratios=(2.0, 4.0), noise_window_ms=1.5, seed=3)
    s = ServiceSampler(model)
    ra, rb = s.step_ratio(1.0), s.step_ratio(2.0)  # A's decode starts at 1 ms, B's at 2 ms
    a, b = run_cluster("static-tp:1", cpu_config(device_kind=flat, chunk_tokens=4, service=model), w).records
    assert ra != rb
    # A: the mixed step (1 ms), then the shared decode step at the mean of the two ratios (its last token).
    assert (a.first_token_ms, a.finish_ms) == (pytest.approx(1.0), pytest.approx(2.0 + (ra + rb) / 2))
    # B: first token at 2, the shared step, then a step of its own at rb.
    assert (b.first_token_ms, b.finish_ms) == (pytest.approx(2.0), pytest.approx(2.0 + (ra + rb) / 2 + rb))


def test_service_runs_are_seeded():
    w = [TraceRequest(arrival_ms=40.0 * i, prompt_tokens=64, output_tokens=8) for i in range(20)]
    model = ServiceModel(path_ms=(1.0, 5.0, 9.0), step_ratios=(1.0, 1.5, 3.0), noise_window_ms=20.0)
    a = run_cluster("static-tp:1", cpu_config(service=model), w)
    b = run_cluster("static-tp:1", cpu_config(service=model), w)
    c = run_cluster("static-tp:1", cpu_config(service=dataclasses.replace(model, seed=1)), w)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
    assert [r.ttft_ms for r in a.records] != [r.ttft_ms for r in c.records]


# -- calibration -------------------------------------------------------------------------------------------


def rec(i, send, first, finish, out, prompt=32):
    return make_record(
        request_id=f"r{i}",
        tier="interactive",
        send_ms=send,
        first_token_ms=first,
        finish_ms=finish,
        output_tokens=out,
        prompt_tokens=prompt,
    )


def test_calibration_measures_paths_ratios_and_window_exactly():
    live = [
        rec(0, 0.0, 12.0, 42.0, 11),  # TTFT 12, TPOT 3, decode span 30
        rec(1, 100.0, 105.0, 125.0, 11),  # TTFT 5 (below the simulated 7: path 0), TPOT 2, span 20
        rec(2, 200.0, 210.0, 210.0, 11),  # all tokens in one chunk: TPOT 0, no ratio
        rec(3, 300.0, 309.0, None, 0),
    ]  # unfinished: a path, no ratio
    sim = [
        rec(0, 0.0, 7.0, 22.0, 11),
        rec(1, 100.0, 107.0, 117.0, 11),
        rec(2, 200.0, 207.0, 217.0, 11),
        rec(3, 300.0, 306.0, 316.0, 11),
    ]
    cal = calibrate_service(live, sim, seed=3, source="test")
    assert cal.model.path_ms == (0.0, 3.0, 3.0, 5.0)
    assert cal.model.step_ratios == (pytest.approx(2.0), pytest.approx(2.0))  # 3/1.5 and 2/1
    assert cal.model.noise_window_ms == 30.0  # the longest decode with a ratio (30 and 20 ms)
    assert (cal.model.seed, cal.model.source) == (3, "test")
    assert (cal.requests, cal.path_samples, cal.path_clamped, cal.ratio_samples, cal.ratio_dropped) == (4, 4, 1, 2, 2)
    # Request 2's tokens came at once: its path sample (3.0, the second of the two 3.0s by sort) is flagged.
    assert cal.model.stalled == (False, False, True, False) and cal.stalled == 1


def test_calibration_refuses_mismatched_pairs_and_empty_data():
    with pytest.raises(AssertionError, match="not the same request"):
        calibrate_service([rec(0, 0.0, 5.0, 9.0, 3)], [rec(0, 50.0, 55.0, 59.0, 3)])
    with pytest.raises(ValueError, match="calibration needs"):
        calibrate_service([rec(0, 0.0, None, None, 0)], [rec(0, 0.0, 5.0, 9.0, 3)])


def test_fixed_point_calibration_measures_against_a_slowed_simulation():
    # The simulation at slowdown m: TPOT = m, and TTFT = 5 + 2 m (queueing behind slowed decodes grows with m).
    # Live: TPOT 3, TTFT 20. Round 0 (bare) finds ratio 3; against the simulation at m = 3 the ratio stays 3 and
    # the path is 20 - 11 = 9, not the 13 the bare simulation would leave in it.
    live = [rec(i, 100.0 * i, 100.0 * i + 20.0, 100.0 * i + 20.0 + 3.0 * 10, 11) for i in range(3)]

    def simulate_at(m):
        return [rec(i, 100.0 * i, 100.0 * i + 5.0 + 2.0 * m, 100.0 * i + 5.0 + 2.0 * m + m * 10, 11) for i in range(3)]

    cal, tried = calibrate_service_fixed_point(live, simulate_at, iterations=2)
    assert tried == [1.0, pytest.approx(3.0), pytest.approx(3.0)]
    assert cal.model.step_ratios == pytest.approx((3.0,) * 3)
    assert cal.model.path_ms == pytest.approx((9.0,) * 3)
    bare = calibrate_service(live, simulate_at(1.0))
    assert bare.model.path_ms == pytest.approx((13.0,) * 3)
