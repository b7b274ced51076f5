"""bench fidelity's service-overhead model: what it subtracts, what it adds, and that the simulator really
steps on a table given to it (ClusterConfig.device_kind alone only names presets)."""

from __future__ import annotations

import dataclasses

import pytest

from nitsum.metrics import make_record
from nitsum.policy.costmodel import cost_model, load_device_table
from nitsum.workloads import TraceRequest
from nitsum_load import bench_fidelity as bf


def test_overheads_subtract_the_tables_own_prediction():
    table = load_device_table(None)
    cm = cost_model("tiny", table)
    ov = bf.overheads_from(table, path_ttft_ms=5.0, step_tpot_ms=2.0)
    assert ov.path_ms == pytest.approx(5.0 - cm.step_time_ms(1, 1, bf.PATH_PROMPT_TOKENS, bf.PATH_PROMPT_TOKENS))
    mean_ctx = bf.STEP_PROMPT_TOKENS + bf.STEP_OUTPUT_TOKENS // 2
    assert ov.step_ms == pytest.approx(2.0 - cm.step_time_ms(1, 1, 1, mean_ctx))
    assert (ov.live_path_ttft_ms, ov.live_step_tpot_ms) == (5.0, 2.0)


def test_adjusted_table_adds_the_service_step_and_never_subtracts():
    table = load_device_table(None)
    up = bf.adjusted_table(table, bf.ServiceOverheads(path_ms=3.0, step_ms=0.5, live_path_ttft_ms=4.0,
                                                      live_step_tpot_ms=1.5))
    assert up.step_overhead_ms == pytest.approx(table.step_overhead_ms + 0.5)
    assert dataclasses.replace(up, step_overhead_ms=table.step_overhead_ms, source=table.source) == table
    same = bf.adjusted_table(table, bf.ServiceOverheads(3.0, -0.2, 4.0, 0.3))
    assert same.step_overhead_ms == table.step_overhead_ms


def test_shift_records_moves_every_observed_time_but_not_the_send():
    r = make_record(request_id="a", tier="interactive", send_ms=10.0, first_token_ms=15.0, finish_ms=18.0,
                    output_tokens=3, prompt_tokens=4, token_times_ms=(15.0, 16.5, 18.0))
    failed = make_record(request_id="b", tier="interactive", send_ms=0.0, first_token_ms=None, finish_ms=None,
                         output_tokens=0, prompt_tokens=4, error="http_503")
    got, kept = bf.shift_records([r, failed], 2.5)
    assert (got.send_ms, got.first_token_ms, got.finish_ms, got.token_times_ms) == (10.0, 17.5, 20.5,
                                                                                    (17.5, 19.0, 20.5))
    assert got.ttft_ms == pytest.approx(r.ttft_ms + 2.5) and got.tpot_ms == pytest.approx(r.tpot_ms)
    assert kept == failed


def test_the_simulator_steps_on_the_given_table():
    # One request alone: its TTFT is exactly one prefill step of the table it runs on.
    workload = [TraceRequest(arrival_ms=0.0, prompt_tokens=100, output_tokens=4)]
    table = load_device_table(None)
    slow = dataclasses.replace(table, step_overhead_ms=table.step_overhead_ms + 2.0)
    base, _ = bf.simulate(workload, "static-tp:1")
    adjusted, used = bf.simulate(workload, "static-tp:1", slow)
    assert used == slow
    assert base.records[0].ttft_ms == pytest.approx(cost_model("tiny", table).step_time_ms(1, 1, 100, 100))
    assert adjusted.records[0].ttft_ms == pytest.approx(cost_model("tiny", slow).step_time_ms(1, 1, 100, 100))
    assert adjusted.records[0].ttft_ms == pytest.approx(base.records[0].ttft_ms + 2.0)
