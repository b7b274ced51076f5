"""bench fidelity's calibration pieces: the evaluation / calibration split, the simulator on a given table and
service model, and the seed summary."""

from __future__ import annotations

import dataclasses

import pytest

from nitsum.policy.costmodel import cost_model, load_device_table
from nitsum.sim.service import ServiceModel
from nitsum.workloads import TraceRequest
from nitsum_load import bench_fidelity as bf


def test_rows_alternate_evaluation_and_calibration():
    assert bf.split_rows(list(range(7))) == ([0, 2, 4, 6], [1, 3, 5])


def test_the_simulator_steps_on_the_given_table():
    # One request alone: its TTFT is exactly one prefill step of the table it runs on.
    workload = [TraceRequest(arrival_ms=0.0, prompt_tokens=100, output_tokens=4)]
    table = load_device_table(None)
    slow = dataclasses.replace(table, step_overhead_ms=table.step_overhead_ms + 2.0)
    base, _ = bf.simulate(workload, "static-tp:1")
    adjusted, used = bf.simulate(workload, "static-tp:1", slow)
    assert used == slow
    assert base.records[0].ttft_ms == pytest.approx(cost_model("tiny", table).step_time_ms(1, 1, 100, 100))
    assert adjusted.records[0].ttft_ms == pytest.approx(base.records[0].ttft_ms + 2.0)


def test_analyse_calibrates_on_calibration_rows_and_simulates_evaluation_rows_per_seed():
    # "Live" = the simulator with a known service model: calibration recovers it, and the service runs (per seed)
    # cover the evaluation rows only.
    import argparse

    w = [TraceRequest(arrival_ms=100.0 * i, prompt_tokens=32, output_tokens=6) for i in range(6)]
    known = ServiceModel(path_ms=(4.0,), step_ratios=(1.5,))
    live, _ = bf.simulate(w, "static-tp:1", service=known)
    session = bf.Session(0, w, live.records, [], [], 0.0)
    bf.analyse(session, argparse.Namespace(policy="static-tp:1", trace="test", seeds=2), load_device_table(None))
    assert session.calibration.model.path_ms == pytest.approx((4.0,) * 3)
    assert session.calibration.model.step_ratios == pytest.approx((1.5,) * 3)
    assert len(session.service) == 2 and [r.send_ms for r in session.service[0]] == [0.0, 200.0, 400.0]
    evaluation, _ = bf.split_rows(live.records)
    assert [r.ttft_ms for r in session.service[1]] == pytest.approx([r.ttft_ms for r in evaluation])
    assert [r.tpot_ms for r in session.service[1]] == pytest.approx([r.tpot_ms for r in evaluation])


def test_over_seeds_median_and_range():
    medians, ranges = bf.over_seeds([[1.0, 2.0, None, 4.0], [3.0, 2.0, None, 5.0], [2.0, 8.0, None, 6.0]])
    assert medians == [2.0, 2.0, None, 5.0]
    assert ranges == [(1.0, 3.0), (2.0, 8.0), None, (4.0, 6.0)]
    rows = bf.compare([2.0, 2.0, 1.0, 5.0], medians, ranges)
    assert [r["rel_error"] for r in rows] == [0.0, 0.0, None, 0.0]
    assert "1.00-3.00" in bf.format_rows(rows)


def test_bootstrap_intervals_bracket_the_figure_and_collapse_for_identical_requests():
    from nitsum.metrics import make_record

    same = [
        make_record(
            request_id=str(i),
            tier="interactive",
            send_ms=0.0,
            first_token_ms=10.0,
            finish_ms=20.0,
            output_tokens=11,
            prompt_tokens=4,
        )
        for i in range(10)
    ]
    assert bf.bootstrap_intervals(same, resamples=20) == [(10.0, 10.0), (10.0, 10.0), (1.0, 1.0), (1.0, 1.0)]
    spread = [
        make_record(
            request_id=str(i),
            tier="interactive",
            send_ms=0.0,
            first_token_ms=float(i + 1),
            finish_ms=float(i + 1) + 10.0,
            output_tokens=11,
            prompt_tokens=4,
        )
        for i in range(20)
    ]
    (lo, hi), *_ = bf.bootstrap_intervals(spread, resamples=100)
    assert lo < 10.5 < hi  # the TTFT p50 of 1..20 ms
    assert bf.bootstrap_intervals(spread, resamples=100) == bf.bootstrap_intervals(spread, resamples=100)  # seeded


def test_per_request_rows_pair_live_and_simulated():
    from nitsum.metrics import make_record

    def r(first, chunks):
        times = tuple(first + i * 2.0 for i in range(chunks)) + (first + 2.0 * (chunks - 1),) * (3 - chunks)
        return make_record(
            request_id="x",
            tier="interactive",
            send_ms=0.0,
            first_token_ms=first,
            finish_ms=times[-1],
            output_tokens=3,
            prompt_tokens=8,
            token_times_ms=times,
        )

    (row,) = bf.per_request_rows([r(5.0, 2)], [r(3.0, 3)], [r(6.0, 3)])
    assert (row["ttft_live_ms"], row["ttft_table_ms"], row["ttft_service_ms"]) == (5.0, 3.0, 6.0)
    assert (row["tpot_live_ms"], row["tpot_table_ms"], row["live_chunks"]) == (1.0, 2.0, 2)


def test_interleave_inverts_split_rows():
    rows = list(range(9))
    assert bf.interleave(*bf.split_rows(rows)) == rows


def test_replay_of_a_mesh_that_behaves_like_the_table_finds_no_service_cost(tmp_path, capsys):
    # A saved two-session "live" run whose records are the simulator's own: calibration must find a path of 0 and a
    # step ratio of 1, and the simulator with that service model must reproduce the live figures exactly.
    import json

    settings = {
        "trace": "azure-conv",
        "requests": 3,
        "sessions": 2,
        "rate": 4.0,
        "max_prompt_tokens": 64,
        "max_output_tokens": 8,
        "policy": "static-tp:1",
    }
    for k in range(2):
        workload = bf.build_workload("azure-conv", 6, 4.0, 64, 8, first_row=6 * k)
        evaluation, calibration = bf.split_rows(bf.simulate(workload, "static-tp:1")[0].records)
        for name, records in (("live", evaluation), ("live-calibration", calibration)):
            d = tmp_path / f"session-{k}" / name
            d.mkdir(parents=True)
            (d / "requests.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    (tmp_path / "fidelity.json").write_text(json.dumps({"settings": settings, "wall0_unix_ms": [0.0, 0.0]}))
    out = tmp_path / "again"
    assert bf.main(["--replay", str(tmp_path), "--seeds", "2", "--out", str(out)]) == 0
    result = json.loads((out / "fidelity.json").read_text())
    for cal in result["calibrations"]:
        assert set(cal["service_model"]["path_ms"]) == {0.0}
        assert cal["service_model"]["step_ratios"] == pytest.approx([1.0] * 3)
    assert [r["rel_error"] for r in result["rows"]] == [0.0, 0.0, 0.0, 0.0]
    assert [r["rel_error"] for r in result["service_rows"]] == pytest.approx([0.0] * 4, abs=1e-12)
    assert "within the 15% goal" in capsys.readouterr().out
    assert (out / "requests.csv").read_text().count("\n") == 7  # header + 2 sessions x 3 evaluation rows


def test_slices_of_sessions_follow_each_other_in_the_trace():
    a = bf.build_workload("azure-conv", 4, 4.0, 10_000, 10_000, first_row=0)
    b = bf.build_workload("azure-conv", 4, 4.0, 10_000, 10_000, first_row=4)
    both = bf.build_workload("azure-conv", 8, 4.0, 10_000, 10_000)
    assert [r.prompt_tokens for r in a + b] == [r.prompt_tokens for r in both]
    assert a[0].arrival_ms == b[0].arrival_ms == 0.0


def test_replay_needs_a_saved_run(tmp_path):
    with pytest.raises(SystemExit):
        bf.main(["--replay", str(tmp_path)])


def test_path_breakdown_places_spans_on_the_client_clock():
    wall0 = 1_000_000.0  # unix ms of the load generator's time 0

    def span(name, rid, start_ms, end_ms):
        return {
            "name": name,
            "start_unix_ns": int((wall0 + start_ms) * 1e6),
            "end_unix_ns": int((wall0 + end_ms) * 1e6),
            "attributes": {"nitsum.request_id": rid},
        }

    spans = [
        span("gateway.request", "cmpl-1", 1.0, 40.0),
        span("coordinator.route", "cmpl-1", 2.5, 3.0),
        span("worker.generate", "cmpl-1", 4.0, 30.0),
        span("coordinator.route", "ready-x", 0.0, 1.0),
    ]
    logs = [
        {
            "request_id": "req-0",
            "server_request_id": "cmpl-1",
            "dispatched_ms": 0.5,
            "first_token_ms": 12.0,
            "finish_ms": 31.5,
        },
        {
            "request_id": "req-1",
            "server_request_id": "cmpl-2",
            "dispatched_ms": 0.5,
            "first_token_ms": 9.0,
            "finish_ms": 20.0,
        },
    ]  # no spans: left out
    (row,) = bf.path_breakdown(logs, spans, wall0)
    expected = {
        "to_gateway_ms": 0.5,
        "gateway_to_coordinator_ms": 1.5,
        "coordinator_to_worker_ms": 1.5,
        "worker_to_first_token_ms": 8.0,
        "worker_span_ms": 26.0,
        "last_token_lag_ms": 1.5,
    }
    assert row["request_id"] == "req-0"
    assert {k: row[k] for k in expected} == pytest.approx(expected, abs=1e-6)
    assert "worker_to_first_token 8.00/8.00" in bf.format_breakdown([row])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "60"], "--requests at most 50"),
        (["--sessions", "2", "--url", "http://127.0.0.1:1"], "1 with --url"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--device-table", "/nonexistent.json"], "no such file"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit):
        bf.main(argv)
    assert message in capsys.readouterr().err
