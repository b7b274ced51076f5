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


def test_service_runs_are_per_seed_on_evaluation_rows_only():
    w = [TraceRequest(arrival_ms=100.0 * i, prompt_tokens=32, output_tokens=6) for i in range(6)]
    bare, _ = bf.simulate(w, "static-tp:1")
    model = ServiceModel(path_ms=(4.0,), step_ratios=(1.5,))
    per_seed, records = bf.service_runs(w, "static-tp:1", load_device_table(None), model, seeds=2)
    assert len(per_seed) == 2 and per_seed[0] == per_seed[1]  # one-point distributions: seeds agree
    assert [r.send_ms for r in records] == [0.0, 200.0, 400.0]
    bare_eval, _ = bf.split_rows(bare.records)
    assert [r.ttft_ms for r in records] == pytest.approx([r.ttft_ms + 4.0 for r in bare_eval])
    assert [r.tpot_ms for r in records] == pytest.approx([1.5 * r.tpot_ms for r in bare_eval])


def test_over_seeds_median_and_range():
    medians, ranges = bf.over_seeds([[1.0, 2.0, None, 4.0], [3.0, 2.0, None, 5.0], [2.0, 8.0, None, 6.0]])
    assert medians == [2.0, 2.0, None, 5.0]
    assert ranges == [(1.0, 3.0), (2.0, 8.0), None, (4.0, 6.0)]
    rows = bf.compare([2.0, 2.0, 1.0, 5.0], medians, ranges)
    assert [r["rel_error"] for r in rows] == [0.0, 0.0, None, 0.0]
    assert "1.00-3.00" in bf.format_rows(rows)
