"""The fidelity benchmark's pieces that need no live mesh: workload slice, simulator run, comparison rows."""

from __future__ import annotations

import pytest

from nitsum.metrics import make_record, summarize
from nitsum_load import bench_fidelity as bf


def test_build_workload_slice_rate_and_caps():
    w = bf.build_workload("azure-conv", 12, 4.0, 256, 32)
    assert len(w) == 12 and w[0].arrival_ms == 0.0
    assert w[-1].arrival_ms == pytest.approx(11 / 4.0 * 1000.0)  # 11 gaps at a mean of 250 ms
    assert all(r.prompt_tokens <= 256 and r.output_tokens <= 32 for r in w)


def test_simulate_serves_every_request():
    w = bf.build_workload("azure-conv", 8, 4.0, 64, 8)
    result, table = bf.simulate(w, "static-tp:1")
    assert table.name == "cpu"
    assert result.report.overall.requests == 8 and result.report.overall.succeeded == 8
    assert [r.output_tokens for r in sorted(result.records, key=lambda r: r.send_ms)] == [r.output_tokens for r in w]


def rec(i, first, finish, out):
    return make_record(
        request_id=str(i),
        tier="interactive",
        send_ms=0.0,
        first_token_ms=first,
        finish_ms=finish,
        output_tokens=out,
        prompt_tokens=4,
    )


def test_side_by_side_relative_error():
    live = summarize([rec(0, 10.0, 20.0, 11), rec(1, 20.0, 40.0, 11)])  # TTFT 10, 20; TPOT 1, 2
    sim = summarize([rec(0, 11.0, 21.0, 11), rec(1, 22.0, 42.0, 11)])  # TTFT 11, 22; TPOT 1, 2
    rows = bf.side_by_side(live, sim)
    assert [r["metric"] for r in rows] == ["TTFT p50 (ms)", "TTFT p90 (ms)", "TPOT p50 (ms)", "TPOT p90 (ms)"]
    assert rows[0]["live"] == 15.0 and rows[0]["sim"] == 16.5 and rows[0]["rel_error"] == pytest.approx(0.1)
    assert rows[2]["rel_error"] == 0.0
    text = bf.format_rows(rows)
    assert "+10.0%" in text and "+0.0%" in text


def test_an_abbreviated_option_is_refused_not_taken_for_another(capsys) -> None:
    # `--seed 3` once ran as `--seeds 3` (3 simulator seeds instead of 40) without a word.
    with pytest.raises(SystemExit) as exc:
        bf.main(["--seed", "3"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --seed 3" in capsys.readouterr().err
