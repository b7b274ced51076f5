"""`nitsum bench profile`: the roofline fit (exact, on synthetic data) and one quick live profile whose
table loads with the cost model's loader and predicts the measured steps within a sane factor."""

from __future__ import annotations

import json
import statistics

import pytest

from nitsum.bench.profile import (
    DEFAULT_TABLE_PATH,
    RooflineFit,
    StepPoint,
    fit_roofline,
    fitted_device,
    main,
    predict_ms,
    roofline_terms,
    table_json,
)
from nitsum.policy.costmodel import CostModel, DeviceSpec, load_device_table, model_spec

TINY = model_spec("tiny")
CPU_LIKE = DeviceSpec(
    "cpu-like",
    peak_flops=100e9,
    mem_bandwidth_bytes_per_s=40e9,
    link_bandwidth_bytes_per_s=1e9,
    memory_bytes=1e9,
    compute_efficiency=0.5,
    memory_efficiency=0.25,
    step_overhead_ms=0.8,
)


def _points(shapes):
    return [StepPoint(kind, b, n, ctx, 1.0) for kind, b, n, ctx in shapes]


def test_roofline_terms_reproduce_the_cost_model():
    # The fit's features are the cost model's own terms: with a device's rates, predict_ms == step_time_ms.
    model = CostModel(TINY, CPU_LIKE)
    a = 1e3 / (CPU_LIKE.peak_flops * CPU_LIKE.compute_efficiency)
    b = 1e3 / (CPU_LIKE.mem_bandwidth_bytes_per_s * CPU_LIKE.memory_efficiency)
    fit = RooflineFit(a, b, CPU_LIKE.step_overhead_ms, True, True, 0.0)
    for p in _points(
        [("decode", 1, 1, 20), ("decode", 32, 32, 40000), ("prefill", 1, 1024, 1024), ("prefill", 4, 256, 256)]
    ):
        flops, num_bytes = roofline_terms(TINY, p)
        assert predict_ms(fit, flops, num_bytes) == pytest.approx(
            model.step_time_ms(1, p.batch_size, p.num_tokens, p.context_tokens), rel=1e-12
        )


def test_fit_recovers_known_rates_from_mixed_bound_points():
    # Synthetic "measurements" from known rates, some points memory-bound (decode over a long context on a
    # slow memory), some compute-bound (prefill): the fit must find the rates exactly.
    a_true, b_true, c_true = 2e-8, 5e-7, 0.7
    shapes = [
        ("decode", 1, 1, 16),
        ("decode", 64, 64, 200_000),
        ("decode", 16, 16, 50_000),
        ("prefill", 1, 512, 512),
        ("prefill", 4, 1024, 1024),
        ("prefill", 1, 64, 64),
    ]
    flops, num_bytes = zip(*(roofline_terms(TINY, p) for p in _points(shapes)))
    measured = [max(f * a_true, x * b_true) + c_true for f, x in zip(flops, num_bytes)]
    assert any(f * a_true > x * b_true for f, x in zip(flops, num_bytes)) and any(
        f * a_true < x * b_true for f, x in zip(flops, num_bytes)
    )
    fit = fit_roofline(list(flops), list(num_bytes), measured)
    assert fit.compute_identified and fit.memory_identified
    assert fit.ms_per_flop == pytest.approx(a_true, rel=1e-9)
    assert fit.ms_per_byte == pytest.approx(b_true, rel=1e-9)
    assert fit.step_overhead_ms == pytest.approx(c_true, rel=1e-9)
    assert fit.mean_abs_pct_error == pytest.approx(0.0, abs=1e-9)


def test_an_unbound_term_is_only_bounded_and_the_table_takes_the_measured_peak():
    a_true, c_true = 2e-8, 0.5
    shapes = [("decode", 1, 1, 16), ("decode", 8, 8, 512), ("prefill", 1, 256, 256), ("prefill", 4, 256, 256)]
    flops, num_bytes = zip(*(roofline_terms(TINY, p) for p in _points(shapes)))
    measured = [f * a_true + c_true for f in flops]  # no memory term at all
    fit = fit_roofline(list(flops), list(num_bytes), measured)
    assert fit.compute_identified and not fit.memory_identified
    assert fit.ms_per_flop == pytest.approx(a_true, rel=1e-9)
    # The slowest bandwidth that binds nowhere: it ties with compute at exactly one (the tightest) point.
    ratios = [x * fit.ms_per_byte / (f * fit.ms_per_flop) for f, x in zip(flops, num_bytes)]
    assert max(ratios) == pytest.approx(1.0, rel=1e-9)
    fast_peak = 10 * fit.effective_bytes_per_s
    device = fitted_device(CPU_LIKE, fit, peak_flops=1e12, peak_bytes_per_s=fast_peak, source="test")
    assert device.mem_bandwidth_bytes_per_s == fast_peak and device.memory_efficiency == 1.0
    assert device.peak_flops * device.compute_efficiency == pytest.approx(1e3 / a_true, rel=1e-9)
    assert device.step_overhead_ms == pytest.approx(c_true, rel=1e-9)
    assert device.placeholder is False
    # Fields the profile does not measure carry over.
    assert (device.link_bandwidth_bytes_per_s, device.collective_latency_ms, device.memory_bytes) == (
        1e9,
        CPU_LIKE.collective_latency_ms,
        1e9,
    )


def test_table_json_loads_with_the_cost_model_loader_and_keeps_the_points():
    points = _points([("decode", 1, 1, 16), ("prefill", 1, 64, 64), ("prefill", 2, 128, 128)])
    flops, num_bytes = zip(*(roofline_terms(TINY, p) for p in points))
    measured = [f * 1e-8 + 0.3 for f in flops]
    points = [StepPoint(p.kind, p.batch_size, p.num_tokens, p.context_tokens, t) for p, t in zip(points, measured)]
    fit = fit_roofline(list(flops), list(num_bytes), measured)
    device = fitted_device(CPU_LIKE, fit, 1e11, 1e10, "measured in a test")
    text = table_json(
        device, points, [predict_ms(fit, f, x) for f, x in zip(flops, num_bytes)], fit, "nitsum bench profile --test"
    )
    assert DeviceSpec.from_json(text) == device
    data = json.loads(text)
    assert data["schema"] == "nitsum.costmodel.device/1"
    assert [(p["kind"], p["batch_size"], p["num_tokens"]) for p in data["measurements"]["points"]] == [
        ("decode", 1, 1),
        ("prefill", 1, 64),
        ("prefill", 2, 128),
    ]


@pytest.mark.timeout(120)
def test_quick_live_profile_writes_a_loadable_table_that_predicts_the_measurements(tmp_path, capsys):
    shipped = DEFAULT_TABLE_PATH.read_bytes()
    out = tmp_path / "cpu.json"
    assert main(["--quick", "--out", str(out)]) == 0
    assert DEFAULT_TABLE_PATH.read_bytes() == shipped, "the shipped table is written only with --write-default"
    device = load_device_table(out)
    assert device.name == "cpu" and device.placeholder is False
    assert "measured" in device.source and "nitsum bench profile --quick" in device.source
    assert device.step_overhead_ms >= 0 and 0 < device.compute_efficiency <= 1 and 0 < device.memory_efficiency <= 1
    points = json.loads(out.read_text())["measurements"]["points"]
    assert len(points) == 7 and {p["kind"] for p in points} == {"decode", "prefill"}
    model = CostModel(TINY, device)
    ratios = []
    for p in points:
        predicted = model.step_time_ms(1, p["batch_size"], p["num_tokens"], p["context_tokens"])
        assert predicted == pytest.approx(p["predicted_ms"], rel=1e-3, abs=1e-4)  # the table is the fit
        ratios.append(predicted / p["step_ms"])
    # A sane factor, not a timing threshold: the fitted model explains the typical (median) measured step
    # within 3x. The median, because on a shared machine any single point can be slowed by a neighbour.
    assert 1 / 3 <= statistics.median(ratios) <= 3, ratios
    assert "mean absolute percentage error" in capsys.readouterr().out


def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--threads", "0"])


def test_fit_recovers_per_sequence_and_prefill_step_costs():
    # Synthetic measurements with a per-sequence and a prefill-step cost on top of the roofline: the fit finds
    # all five coefficients, and the table it writes predicts through the cost model exactly what was measured.
    a_true, b_true, c_true, d_true, e_true = 2e-8, 5e-7, 0.3, 0.02, 0.6
    shapes = [
        ("decode", 1, 1, 16),
        ("decode", 64, 64, 200_000),
        ("decode", 16, 16, 50_000),
        ("decode", 32, 32, 800),
        ("prefill", 1, 512, 512),
        ("prefill", 4, 1024, 1024),
        ("prefill", 1, 16, 16),
        ("prefill", 16, 1024, 1024),
    ]
    points = _points(shapes)
    flops, num_bytes = zip(*(roofline_terms(TINY, p) for p in points))
    batches, prefills = [p.batch_size for p in points], [p.kind == "prefill" for p in points]
    measured = [
        max(f * a_true, x * b_true) + c_true + d_true * bs + (e_true if pf else 0.0)
        for f, x, bs, pf in zip(flops, num_bytes, batches, prefills)
    ]
    fit = fit_roofline(list(flops), list(num_bytes), measured, batches, prefills)
    # (lstsq over five columns: exact to ~1e-9 relative, not to the last bit)
    assert (fit.ms_per_flop, fit.ms_per_byte) == (pytest.approx(a_true, rel=1e-6), pytest.approx(b_true, rel=1e-6))
    assert (fit.step_overhead_ms, fit.ms_per_seq, fit.prefill_step_ms) == (
        pytest.approx(c_true, rel=1e-6),
        pytest.approx(d_true, rel=1e-6),
        pytest.approx(e_true, rel=1e-6),
    )
    assert fit.mean_abs_pct_error == pytest.approx(0.0, abs=1e-9)
    device = fitted_device(CPU_LIKE, fit, peak_flops=1e12, peak_bytes_per_s=1e11, source="test")
    assert (device.seq_overhead_ms, device.prefill_step_overhead_ms) == (fit.ms_per_seq, fit.prefill_step_ms)
    model = CostModel(TINY, device)
    for p, t in zip(points, measured):
        assert model.step_time_ms(1, p.batch_size, p.num_tokens, p.context_tokens) == pytest.approx(t, rel=1e-6)
    # Without those columns the fit is the plain roofline (the old three-term model).
    plain = fit_roofline(list(flops), list(num_bytes), measured)
    assert (plain.ms_per_seq, plain.prefill_step_ms) == (0.0, 0.0) and plain.mean_abs_pct_error > 0.01


@pytest.mark.timeout(240)
def test_quick_profile_writes_a_step_table_with_tp2_rows_measured_on_a_node_world(tmp_path):
    from nitsum.policy.steptable import load_step_rows, select

    out = tmp_path / "cpu.csv"
    assert main(["--quick", "--tp", "1,2", "--csv", str(out)]) == 0
    rows = load_step_rows(out)  # the step-table loader accepts what the profile writes
    assert {r.tp for r in rows} == {1, 2} and {r.phase for r in rows} == {"prefill", "decode"}
    assert {(r.device, r.model) for r in rows} == {("cpu", "tiny")}
    for tp in (1, 2):
        mine = [r for r in rows if r.tp == tp]
        assert len(mine) == 7
        assert sorted((r.phase, r.batch_size, r.prompt_tokens) for r in mine if r.phase == "prefill") == [
            ("prefill", 1, 16),
            ("prefill", 1, 128),
            ("prefill", 4, 64),
        ]
    table = select(rows, "cpu", TINY)
    for r in rows:  # the table prices its own points exactly
        n = r.batch_size if r.phase == "decode" else r.batch_size * r.prompt_tokens
        ctx = r.batch_size * (r.context_tokens if r.phase == "decode" else r.prompt_tokens)
        assert table.step_ms(r.tp, r.batch_size, n, ctx) == r.ms


def test_bad_tp_levels_are_clear_errors(capsys):
    for bad in ("3", "x", "0"):
        with pytest.raises(SystemExit):
            main(["--tp", bad])
        assert "--tp" in capsys.readouterr().err
