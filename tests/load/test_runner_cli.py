"""Open-loop runner, workload shaping, report files and `nitsum load` end to end against the fake server."""

from __future__ import annotations

import asyncio
import csv
import json

import pytest

from nitsum.metrics import summarize
from nitsum.workloads import TraceRequest
from nitsum_load import cli
from nitsum_load.client import ClientConfig, RequestSpec
from nitsum_load.progress import render
from nitsum_load.report import FILES, format_table, read_lifecycle_log
from nitsum_load.runner import Counters, run_open_loop
from nitsum_load.workload import Shaping, parse_tier_mix, shape


def spec(i: int, arrival_ms: float, out: int = 3, tier: str = "interactive") -> RequestSpec:
    return RequestSpec(
        request_id=f"r{i}",
        arrival_ms=arrival_ms,
        prompt_tokens=4,
        output_tokens=out,
        tier=tier,
        ttft_slo_ms=10_000.0,
        tpot_slo_ms=1_000.0,
        weight=1.0,
    )


async def test_open_loop_fires_on_schedule_and_cuts_at_duration(fake_server):
    specs = [spec(i, 40.0 * i) for i in range(6)]  # 0, 40, ..., 200 ms
    counters = Counters()
    result = await run_open_loop(
        specs, ClientConfig(base_url=fake_server.url, model="ok"), duration_s=0.15, counters=counters
    )
    # Arrivals at 0, 40, 80, 120 ms are inside the 150 ms window; 160 and 200 are not sent.
    assert [t.spec.request_id for t in result.trackers] == ["r0", "r1", "r2", "r3"]
    for t in result.trackers:
        assert t.dispatched_ms >= t.spec.arrival_ms  # never early
        assert t.finished
    assert (counters.planned, counters.sent, counters.done, counters.failed) == (4, 4, 4, 0)
    assert counters.tokens == 12 and not result.interrupted


async def test_open_loop_does_not_wait_for_earlier_requests(fake_server):
    # r0 takes ~1 s (server "slow"); r1 is due at 20 ms and must go out then, not after r0.
    cfg = ClientConfig(base_url=fake_server.url, model="slow", request_timeout_s=0.3)
    result = await run_open_loop([spec(0, 0.0), spec(1, 20.0)], cfg)
    r0, r1 = result.trackers
    assert r1.dispatched_ms < 250.0  # r0 is still waiting for its 300 ms timeout at that point
    assert (r0.error, r1.error) == ("timeout", "timeout")


async def test_stop_event_cancels_in_flight_as_unfinished(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, model="slow", request_timeout_s=30)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, stop.set)
    result = await run_open_loop([spec(0, 0.0), spec(1, 10.0), spec(2, 5_000.0)], cfg, stop=stop)
    assert result.interrupted
    assert [t.spec.request_id for t in result.trackers] == ["r0", "r1"]  # r2 was never due
    records = [t.to_record() for t in result.trackers]
    assert [r.outcome for r in records] == ["unfinished", "unfinished"]
    assert summarize(records).overall.errors == {"unfinished": 2}


async def test_drain_timeout_bounds_the_run(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, model="slow", request_timeout_s=30)
    result = await run_open_loop([spec(0, 0.0)], cfg, drain_timeout_s=0.1)
    assert result.trackers[0].to_record().outcome == "unfinished"
    assert not result.interrupted


async def test_concurrency_limit_queues_and_counts_wait(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, model="ok")
    specs = [spec(i, 0.0, out=20) for i in range(3)]
    result = await run_open_loop(specs, cfg, concurrency_limit=1)
    t = sorted(result.trackers, key=lambda t: t.dispatched_ms)
    # One at a time: each starts after the previous one's last token.
    assert t[1].dispatched_ms >= t[0].token_times_ms[-1] and t[2].dispatched_ms >= t[1].token_times_ms[-1]
    # The wait is charged to TTFT: send_ms stays the scheduled arrival (0).
    assert all(x.to_record().send_ms == 0.0 for x in t)


def test_parse_tier_mix():
    assert parse_tier_mix("interactive=0.3,background=0.7") == {"interactive": 0.3, "background": 0.7}
    assert parse_tier_mix("interactive=1,background=3") == {"interactive": 0.25, "background": 0.75}
    for bad, msg in (
        ("gold=1", "unknown tier"),
        ("interactive", "NAME=FRACTION"),
        ("interactive=x", "not a number"),
        ("interactive=0", "positive"),
        ("interactive=-1", ">= 0"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_tier_mix(bad)


def test_shape_order_caps_and_slos():
    reqs = [TraceRequest(arrival_ms=1000.0 + 100.0 * i, prompt_tokens=900 + i, output_tokens=5 + i) for i in range(10)]
    specs = shape(
        reqs,
        Shaping(
            tier_mix={"interactive": 0.5, "background": 0.5},
            time_scale=0.5,
            max_requests=4,
            max_prompt_tokens=901,
            max_output_tokens=6,
            slo_tpot_ms=40.0,
            seed=3,
        ),
    )
    assert [s.arrival_ms for s in specs] == [0.0, 50.0, 100.0, 150.0]  # rebased, then halved
    assert [s.prompt_tokens for s in specs] == [900, 901, 901, 901]
    assert [s.output_tokens for s in specs] == [5, 6, 6, 6]
    assert sorted(s.tier for s in specs) == ["background", "background", "interactive", "interactive"]
    for s in specs:
        assert s.tpot_slo_ms == 40.0
        assert (s.ttft_slo_ms, s.weight) == ((200.0, 10.0) if s.tier == "interactive" else (10_000.0, 1.0))
    assert [s.request_id for s in specs] == ["req-0000", "req-0001", "req-0002", "req-0003"]


def test_progress_render():
    c = Counters(planned=10, sent=4, in_flight=1, done=3, failed=1, tokens=17)
    line = render(c, 2.0, width=10)
    assert line.startswith("[###-------]  30.0%  sent 4/10  in flight 1  done 3  failed 1  tokens 17")
    c.duration_s = 4.0
    assert render(c, 2.0, width=10).startswith("[#####-----]  50.0%")


def test_cli_poisson_writes_every_report_file(fake_server, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(
        [
            "--url",
            fake_server.url,
            "--poisson",
            "200",
            "--max-requests",
            "24",
            "--tier-mix",
            "interactive=0.5,background=0.5",
            "--prompt-tokens",
            "8",
            "--output-tokens",
            "4",
            "--out",
            str(out),
            "--progress",
            "off",
            "--seed",
            "7",
        ]
    )
    assert rc == 0
    for name in FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    rep = summary["report"]
    assert summary["meta"]["model"] == "ok"  # discovered from /v1/models
    assert rep["overall"]["requests"] == 24 and rep["overall"]["succeeded"] == 24
    assert rep["tiers"]["interactive"]["requests"] == 12 and rep["tiers"]["background"]["requests"] == 12
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["tier"] for r in rows] == ["interactive", "background", "all"]
    assert rows[2]["requests"] == "24"
    records = read_lifecycle_log(out / "requests.jsonl")
    assert len(records) == 24 and all(r.output_tokens == 4 for r in records)
    # Calibrated against the fake tokenizer (3 tokens/word + 5 for the chat template): 1 word = 8 tokens exactly.
    assert summary["meta"]["prompt_scale"] == {"tokens_per_word": 3.0, "overhead_tokens": 5.0}
    assert all(r.prompt_tokens == 8 for r in records)
    # The files agree with the shared metric code recomputed from the log.
    assert summarize(records).to_dict() == rep
    for png in ("latency_cdf.png", "timeline.png", "attainment.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "interactive" in printed and "sent 24 of 24 planned requests" in printed
    # Re-report from the log: the same table.
    assert cli.main(["--from-log", str(out / "requests.jsonl")]) == 0
    assert format_table(summarize(records)) in capsys.readouterr().out


def test_cli_errors_are_reported_not_raised(fake_server, tmp_path, capsys):
    out = tmp_path / "fail"
    rc = cli.main(
        [
            "--url",
            fake_server.url,
            "--model",
            "fail-429",
            "--gamma",
            "100,2",
            "--max-requests",
            "5",
            "--out",
            str(out),
            "--progress",
            "off",
        ]
    )
    assert rc == 0
    rep = json.loads((out / "summary.json").read_text())["report"]
    assert fake_server.seen[-1]["body"]["return_token_ids"] is True  # on by default
    assert rep["overall"]["errors"] == {"http_429": 5} and rep["overall"]["slo_attainment"] == 0.0


def test_cli_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--max-requests", "3"])
    assert e.value.code == 2 and "choose a workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--poisson", "1", "--tier-mix", "gold=1"])
    assert "unknown tier" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--poisson", "-1"])
    assert "must be > 0" in capsys.readouterr().err


def test_read_trace_names_and_paths(monkeypatch):
    from nitsum.workloads import default_trace_path
    from nitsum_load import workload

    conv = workload.read_trace("azure-conv", limit=3)
    assert len(conv) == 3 and conv[0].arrival_ms == 0.0 and {r.source for r in conv} == {"azure-conv"}
    code = workload.read_trace(str(default_trace_path("azure-code")), limit=2)
    assert [r.source for r in code] == ["azure-code", "azure-code"]
    moon = workload.read_trace("mooncake", limit=4, bucket_spread_ms=0.0)
    assert len(moon) == 4 and all(r.prefix_hash_ids for r in moon)
    spread = workload.read_trace("mooncake", limit=4)  # default: each ~3 s bucket spread over 3 s
    assert [r.arrival_ms for r in spread] != [r.arrival_ms for r in moon]
    assert all(r.arrival_ms >= m.arrival_ms for r, m in zip(spread, moon))
    calls = []
    monkeypatch.setattr(
        workload, "servegen_arrivals", lambda path, **kw: calls.append((path.name, kw)) or [TraceRequest(0.0, 1, 1)] * 5
    )
    assert len(workload.read_trace("servegen:mm-image", limit=2, duration_s=30.0, seed=4)) == 2
    assert calls == [("servegen_mm-image.tar.gz", {"duration_s": 30.0, "seed": 4})]
    with pytest.raises(FileNotFoundError):
        workload.read_trace("no-such-trace")


def test_ctrl_c_writes_partial_report(fake_server, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "partial"
    before = len(fake_server.seen)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nitsum.cli",
            "load",
            "--url",
            fake_server.url,
            "--model",
            "hang",
            "--poisson",
            "50",
            "--max-requests",
            "400",
            "--no-calibrate",
            "--out",
            str(out),
            "--progress",
            "off",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The SIGINT handler is installed before the first request goes out, so wait for one to arrive.
        deadline = time.monotonic() + 60
        while len(fake_server.seen) < before + 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert len(fake_server.seen) >= before + 3, proc.stderr.read() if proc.poll() is not None else "no request"
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "interrupted: partial report" in stdout
    rep = json.loads((out / "summary.json").read_text())
    assert rep["meta"]["interrupted"] is True
    overall = rep["report"]["overall"]
    assert 3 <= overall["requests"] < 400
    assert overall["errors"] == {"unfinished": overall["requests"]}


async def test_progress_bar_draws_and_finishes_with_newline():
    import io

    from nitsum_load.progress import ProgressBar

    stream = io.StringIO()
    c = Counters(planned=2)
    bar = ProgressBar(c, stream, interval_s=0.01)
    bar.start()
    await asyncio.sleep(0.05)
    c.done = 2
    await bar.stop()
    text = stream.getvalue()
    assert text.startswith("\r[") and text.endswith("\n")
    assert "done 2" in text.rsplit("\r", 1)[1]


def test_cli_strict_openai_flags_drop_extensions(fake_server, tmp_path):
    rc = cli.main(
        [
            "--url",
            fake_server.url,
            "--model",
            "ok",
            "--poisson",
            "100",
            "--max-requests",
            "1",
            "--no-ignore-eos",
            "--no-token-ids",
            "--out",
            str(tmp_path / "strict"),
            "--progress",
            "off",
        ]
    )
    assert rc == 0
    body = fake_server.seen[-1]["body"]
    assert "ignore_eos" not in body and "return_token_ids" not in body


def test_cli_replays_a_burstgpt_trace_and_refuses_a_bad_one_before_sending(fake_server, tmp_path, capsys):
    trace = tmp_path / "BurstGPT_1.csv"
    trace.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0,ChatGPT,6,3,9,Conversation log\n"
        "0,GPT-4,7,2,9,Conversation log\n"
        "1,ChatGPT,5,0,5,API log\n"  # a failed request in the source: not replayed
        "1,GPT-4,4,4,8,API log\n"
    )
    out = tmp_path / "run"
    args = ["--url", fake_server.url, "--trace", str(trace), "--time-scale", "0.05", "--progress", "off"]
    assert cli.main([*args, "--out", str(out)]) == 0
    records = read_lifecycle_log(out / "requests.jsonl")
    assert sorted(r.output_tokens for r in records) == [2, 3, 4]
    before = len(fake_server.seen)
    trace.write_text(trace.read_text() + "later,GPT-4,4,4,8,API log\n")
    assert cli.main([*args, "--out", str(tmp_path / "bad")]) == 2
    assert "BurstGPT_1.csv:6: column Timestamp" in capsys.readouterr().err
    assert len(fake_server.seen) == before and not (tmp_path / "bad").exists()
