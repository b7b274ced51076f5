"""The gateway benchmark's pure parts (the benchmark itself is run by hand: benchmarks are not tests)."""

from __future__ import annotations

import pytest

from nitsum_load import bench_gateway as bg


def test_prompts_distinct_and_in_range():
    ps = bg.prompts(20, 16)
    assert len(ps) == 20 and all(len(p) == 16 for p in ps)
    assert len({tuple(p[:16]) for p in ps}) == 20  # no two share a 16-token prefix block
    assert min(min(p) for p in ps) >= 100 and max(max(p) for p in ps) < 200


def test_compare_and_format():
    engine = {"latency_ms": [1.0, 2.0, 3.0], "requests_per_s": 100.0}
    gateway = {"latency_ms": [3.0, 4.0, 7.0], "requests_per_s": 25.0}
    r = bg.compare(engine, gateway)
    assert r["engine_latency_ms"] == {"p50": 2.0, "p90": pytest.approx(2.8)}
    assert r["gateway_latency_ms"] == {"p50": 4.0, "p90": pytest.approx(6.4)}  # rank 1.8: 4 + 0.8 * 3
    assert r["added_latency_p50_ms"] == 2.0 and r["latency_ratio_p50"] == 2.0
    assert r["throughput_ratio"] == 0.25
    text = bg.format_result(r)
    assert "2.00x" in text and "0.25x" in text and "added latency: p50 2.00 ms" in text


def test_usage_errors(capsys):
    with pytest.raises(SystemExit):
        bg.main(["--requests", "0"])
    assert "--requests must be >= 1" in capsys.readouterr().err


def test_mesh_tokens_result_sets_the_tpot_against_the_same_runs_step():
    from nitsum_load import bench_floor_tokens as bft

    measured = {"ttft_ms": [4.0, 6.0, 5.0], "per_token_ms": [1.0, 1.2, 1.1], "max_gap_ms": [3.0, 9.0, 5.0]}
    r = bft.mesh_tokens_result(64, 0.5, measured)
    assert r["max_gap_ms"]["p50"] == 5.0 and "longest gap between two tokens p50 5.00 ms" in bft.format_mesh_tokens(r)
    assert r["streams"] == 3 and r["tokens"] == 64 and r["engine_step_ms"] == 0.5
    assert r["per_token_ms"]["p50"] == pytest.approx(1.1) and r["per_token_over_step"] == pytest.approx(2.2)
    assert r["ttft_ms"]["p50"] == 5.0
    assert "2.20x" in bft.format_mesh_tokens(r)


def test_mesh_tokens_result_pairs_each_stream_with_the_step_measured_right_before_it():
    from nitsum_load import bench_floor_tokens as bft

    measured = {
        "ttft_ms": [4.0, 6.0, 5.0],
        "per_token_ms": [1.0, 3.0, 1.2],
        "max_gap_ms": [3.0, 9.0, 5.0],
        "engine_step_ms": [0.5, 2.0, 1.0],  # the machine slowed down in the middle stream
    }
    r = bft.mesh_tokens_result(64, 0.5, measured)
    q = r["paired"]
    assert q["per_token_over_step"]["p50"] == pytest.approx(1.5)  # ratios 2.0, 1.5, 1.2
    assert q["engine_step_ms"]["p50"] == 1.0 and q["engine_step_min_ms"] == 0.5 and q["engine_step_max_ms"] == 2.0
    assert r["per_token_over_step"] == pytest.approx(2.4)  # the unpaired figure: TPOT p50 1.2 over the one step 0.5
    assert "TPOT / step p50 1.50x" in bft.format_mesh_tokens(r)
    assert "paired" not in bft.mesh_tokens_result(64, 0.5, {k: v for k, v in measured.items() if k != "engine_step_ms"})


def test_step_probe_measures_the_in_process_engines_decode_step():
    engine = bg.build_in_process("tiny")
    probe = bg.step_probe(engine, 8)
    step = probe(bg.prompts(1, 16)[0])
    assert step > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stream-tokens", "1"], "--stream-tokens must be 0 (no per-token phase) or >= 2"),
        (["--streams", "0"], "--streams must be >= 1"),
    ],
)
def test_stream_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        bg.main(argv)
    assert message in capsys.readouterr().err
