"""Measured step-time tables (nitsum.policy.steptable): exact at and between points, the fit outside them,
bad rows refused naming line and column, and the simulator and the policy reading the same table."""

from __future__ import annotations

import pytest

from nitsum.policy.costmodel import CostModel, device_spec, model_spec
from nitsum.policy.steptable import (
    COLUMNS,
    StepRow,
    StepTableError,
    features,
    fit_table,
    load_step_rows,
    parse_rows,
    select,
    write_rows,
)
from nitsum.sim.cluster import ClusterConfig, ClusterSim

LLAMA = model_spec("llama-3-70b")
HEADER = ",".join(COLUMNS)

TABLE = (
    HEADER
    + "\n"
    + "\n".join(
        [
            "h100,llama-3-70b,4,decode,1,0,1000,20.0",
            "h100,llama-3-70b,4,decode,1,0,3000,24.0",
            "h100,llama-3-70b,4,decode,16,0,1000,26.0",
            "h100,llama-3-70b,4,decode,16,0,3000,34.0",
            "h100,llama-3-70b,4,prefill,1,512,512,40.0",
            "h100,llama-3-70b,4,prefill,1,2048,2048,130.0",
            "h100,llama-3-70b,8,decode,1,0,1000,17.0",
            "h100,llama-3-70b,8,decode,16,0,1000,22.0",
            "h100,llama-3-70b,8,prefill,1,512,512,27.0",
            "h100,llama-3-70b,8,prefill,1,2048,2048,75.0",
        ]
    )
    + "\n"
)


def _table():
    return select(parse_rows(TABLE), "h100", LLAMA)


def test_exact_at_every_measured_point():
    t = _table()
    cm = CostModel(LLAMA, device_spec("h100"), steps=t)
    for r in t.rows:
        if r.phase == "decode":
            got = cm.step_time_ms(r.tp, r.batch_size, r.batch_size, r.batch_size * r.context_tokens)
        else:
            got = cm.step_time_ms(r.tp, r.batch_size, r.batch_size * r.prompt_tokens, r.batch_size * r.prompt_tokens)
        assert got == r.ms


def test_linear_between_points_along_tokens_and_batch():
    t = _table()
    # halfway along the context axis at batch 1: the mean of the two measured steps
    assert t.step_ms(4, 1, 1, 2000) == pytest.approx(22.0, rel=1e-12)
    # a quarter of the way along the prompt axis
    assert t.step_ms(4, 1, 896, 896) == pytest.approx(40.0 + 0.25 * 90.0, rel=1e-12)
    # between batch 1 and 16 at a measured context: linear in batch size
    assert t.step_ms(4, 6, 6, 6 * 1000) == pytest.approx(20.0 + 5 / 15 * 6.0, rel=1e-12)
    # in both: bilinear (rows first, then across batch sizes)
    assert t.step_ms(4, 6, 6, 6 * 2000) == pytest.approx(22.0 + 5 / 15 * (30.0 - 22.0), rel=1e-12)


def test_outside_the_points_the_fitted_roofline_scaled_to_the_edge():
    t = _table()
    edge = 130.0
    beyond = t.step_ms(4, 1, 8192, 8192)
    expected = t.fit_ms(4, 1, 8192, 8192) * edge / t.fit_ms(4, 1, 2048, 2048)
    assert beyond == pytest.approx(expected, rel=1e-12) and beyond > edge
    # a level the table lacks: the fit at that level, scaled by the nearest level's measured / fit ratio
    tp2 = t.step_ms(2, 1, 512, 512)
    assert tp2 == pytest.approx(t.fit_ms(2, 1, 512, 512) * 40.0 / t.fit_ms(4, 1, 512, 512), rel=1e-12)


def test_fit_recovers_known_coefficients_exactly():
    truth = (2e-13, 3e-10, 1e-9, 0.01, 1.5)
    rows = []
    for tp in (1, 2, 4, 8):
        for phase, b, tok in (
            ("decode", 1, 500),
            ("decode", 32, 2000),
            ("decode", 8, 8000),
            ("prefill", 1, 256),
            ("prefill", 1, 4096),
            ("prefill", 4, 1024),
        ):
            n = b if phase == "decode" else b * tok
            f = features(LLAMA, tp, b, n, b * tok)
            ms = sum(c * x for c, x in zip(truth, f))
            rows.append(
                StepRow(
                    "x", LLAMA.name, tp, phase, b, tok if phase == "prefill" else 0, tok if phase == "decode" else 0, ms
                )
            )
    coef = fit_table(LLAMA, tuple(rows))
    for got, want in zip(coef, truth):
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    "line,column,needle",
    [
        ("h100,llama-3-70b,3,decode,1,0,100,5", "tp", "not a power of two"),
        ("h100,llama-3-70b,4,decoding,1,0,100,5", "phase", "is not one of"),
        ("h100,llama-3-70b,4,decode,0,0,100,5", "batch_size", "must be >= 1"),
        ("h100,llama-3-70b,4,decode,1,0,abc,5", "context_tokens", "is not an integer"),
        ("h100,llama-3-70b,4,decode,1.5,0,100,5", "batch_size", "is not an integer"),
        ("h100,llama-3-70b,4,prefill,1,0,0,5", "prompt_tokens", "must be >= 1"),
        ("h100,llama-3-70b,4,decode,1,0,100,-1", "ms", "positive"),
        ("h100,llama-3-70b,4,decode,1,0,100,nan", "ms", "positive"),
        ("h100,llama-3-70b,4,decode,1,0,100,fast", "ms", "not a number"),
        (",llama-3-70b,4,decode,1,0,100,5", "device", "empty"),
    ],
)
def test_bad_rows_are_refused_naming_line_and_column(line, column, needle):
    text = HEADER + "\nh100,llama-3-70b,4,decode,1,0,50,5\n" + line + "\n"
    with pytest.raises(StepTableError) as err:
        parse_rows(text, "t.csv")
    msg = str(err.value)
    assert "t.csv: line 3" in msg and f"column {column!r}" in msg and needle in msg


def test_bad_headers_short_rows_and_duplicates_are_refused():
    with pytest.raises(StepTableError, match="line 1 .*missing column.*ms"):
        parse_rows("device,model,tp,phase,batch_size,prompt_tokens,context_tokens\n")
    with pytest.raises(StepTableError, match="line 2: 3 cells"):
        parse_rows(HEADER + "\nh100,x,4\n")
    with pytest.raises(StepTableError, match="line 3: the same point as line 2"):
        parse_rows(HEADER + "\nh100,x,4,decode,1,0,10,5\nh100,x,4,decode,1,7,10,6\n")
    with pytest.raises(StepTableError, match="no rows"):
        parse_rows(HEADER + "\n")
    with pytest.raises(StepTableError, match="no rows for device 'a100'.*h100/llama-3-70b"):
        select(parse_rows(TABLE), "a100", LLAMA)


def test_written_rows_parse_back():
    rows = parse_rows(TABLE)
    assert parse_rows(write_rows(rows)) == rows


def test_simulator_and_policy_price_steps_from_the_same_table(tmp_path):
    path = tmp_path / "h100.csv"
    path.write_text(TABLE)
    cfg = ClusterConfig(device_table=path)
    sim = ClusterSim("adaptive", cfg, [])
    node = sim._node_view(sim.nodes[0])
    policy_cost = sim.policy.cost_for(node)
    for args in ((4, 1, 1, 1000), (8, 16, 16, 16000), (4, 1, 2048, 2048), (4, 9, 520, 9000), (2, 3, 3, 900)):
        assert sim.cost.step_time_ms(*args) == policy_cost.step_time_ms(*args) == _table().step_ms(*args)
    bad = tmp_path / "bad.csv"
    bad.write_text(TABLE + "h100,llama-3-70b,4,decode,1,0,100,zero\n")
    with pytest.raises(StepTableError, match="line 12, column 'ms'"):
        ClusterConfig(device_table=bad)


def test_flow_simulator_prices_steps_from_a_table_and_refuses_one_without_its_model():
    from nitsum.sim.flowsim import FlowClusterConfig, FlowClusterSim

    plain = FlowClusterSim("rmlq", FlowClusterConfig(num_servers=8), [])
    shard = plain.cost.model.name
    text = (
        HEADER
        + "\n"
        + "".join(
            f"a100,{shard},{tp},decode,{b},0,{c},{ms}\n"
            for tp in (1, 2)
            for b, c, ms in ((1, 100, 2.0), (8, 800, 3.0), (16, 16000, 9.0))
        )
        + "".join(f"a100,{shard},{tp},prefill,1,{n},0,{ms}\n" for tp in (1, 2) for n, ms in ((128, 4.0), (2048, 30.0)))
    )
    rows = parse_rows(text)
    sim = FlowClusterSim("rmlq", FlowClusterConfig(num_servers=8, device_table=rows), [])
    assert sim.cost.step_time_ms(1, 8, 0, 800) == select(rows, "a100", plain.cost.model).step_ms(1, 8, 0, 800)
    with pytest.raises(StepTableError, match="no rows for device 'a100'"):
        FlowClusterSim("rmlq", FlowClusterConfig(num_servers=8, device_table=parse_rows(TABLE)), [])


def test_a_spreadsheet_export_loads_as_written(tmp_path):
    """A byte-order mark, CRLF line ends and whole counts written `8.0` (Excel, pandas) are the same table."""
    plain = HEADER + "\nh100,llama-3-70b,4,decode,8,0,1000,20\nh100,llama-3-70b,4,decode,16,0,1000,22.0\n"
    a = tmp_path / "plain.csv"
    a.write_text(plain)
    b = tmp_path / "export.csv"
    b.write_bytes(
        b"\xef\xbb\xbf" + plain.replace("4,decode,8,0,1000", "4.0,decode,8.0,0.0,1000.0").replace("\n", "\r\n").encode()
    )
    assert load_step_rows(b) == load_step_rows(a)
