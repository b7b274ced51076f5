"""nitsum.workloads: trace readers on the committed excerpts (exact), on the real traces when present, and the
arrival processes / tier assignment / time scaling."""

from __future__ import annotations

import math
import statistics

import pytest

from nitsum.workloads import (
    TraceRequest,
    assign_tiers,
    default_trace_path,
    gamma,
    is_excerpt,
    poisson,
    read_azure,
    read_burstgpt,
    read_csv_trace,
    read_mooncake,
    scale_time,
    scale_to_rate,
    servegen_arrivals,
    traces_dir,
    window,
)
from nitsum.workloads.servegen import servegen_clients


def excerpt(name: str):
    return default_trace_path(name, prefer_excerpt=True)


def real(name: str):
    try:
        path = default_trace_path(name)
    except FileNotFoundError:
        pytest.skip(f"{name}: no real trace and no excerpt")
    if is_excerpt(path):
        pytest.skip("real traces not present (shared/traces or NITSUM_TRACES_DIR)")
    return path


# --- Azure -----------------------------------------------------------------------------------------------------


def test_azure_excerpt_is_crlf_and_reads_exactly():
    path = excerpt("azure-code")
    assert b"\r\n" in path.read_bytes()[:200], "the excerpt must keep the original CRLF line ends"
    reqs = read_azure(path)
    assert len(reqs) == 300
    assert reqs[0] == TraceRequest(0.0, 4808, 10, source="azure-code")
    # 18:17:04.0319600 - 18:17:03.9799600 = 52.0 ms, to the 100-ns digit
    assert reqs[1].arrival_ms == 52.0 and (reqs[1].prompt_tokens, reqs[1].output_tokens) == (3180, 8)
    # last row has no trailing newline and still parses: 18:20:40.8181990 - 18:17:03.9799600
    assert reqs[-1].arrival_ms == pytest.approx(216_838.239, abs=1e-3)
    assert (reqs[-1].prompt_tokens, reqs[-1].output_tokens) == (176, 88)
    assert all(a.arrival_ms <= b.arrival_ms for a, b in zip(reqs, reqs[1:]))


def test_azure_limit_and_tier():
    reqs = read_azure(excerpt("azure-conv"), limit=5, tier="background")
    assert len(reqs) == 5 and {r.tier for r in reqs} == {"background"} and {r.source for r in reqs} == {"azure-conv"}


def test_azure_rejects_wrong_header(tmp_path):
    p = tmp_path / "x.csv"
    p.write_bytes(b"a,b,c\r\n1,2,3\r\n")
    with pytest.raises(ValueError, match="expected header"):
        read_azure(p)


# The 2024 week-long traces (AzureLLMInferenceDataset2024) as they are published: the same header, stamps with a
# UTC offset and 6 fractional digits, some rows with no fraction at all.
AZURE_2024 = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2024-05-10 00:00:00.009930+00:00,374,44\n"
    "2024-05-10 00:00:00.017592+00:00,396,109\n"
    "2024-05-10 00:00:01+00:00,879,42\n"
    "2024-05-10 00:00:00.5+00:00,20,1\n"
)


def test_azure_2024_stamps_with_utc_offsets_read_to_the_microsecond(tmp_path):
    p = tmp_path / "AzureLLMInferenceTrace_conv_1week.csv"
    p.write_text(AZURE_2024)
    reqs = read_azure(p)
    assert [r.arrival_ms for r in reqs] == [0.0, pytest.approx(7.662), pytest.approx(490.07), pytest.approx(990.07)]
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(374, 44), (396, 109), (20, 1), (879, 42)]
    assert {r.source for r in reqs} == {"azure-conv"}
    assert read_csv_trace(p) == reqs
    # An offset is a different instant: the same wall clock two hours east is two hours earlier.
    q = tmp_path / "zones.csv"
    q.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 02:00:00.25+02:00,1,1\n"
        "2024-05-10T00:00:01Z,2,2\n"
        "2024-05-09 23:59:59.25-0000,3,3\n"
    )
    assert [(r.prompt_tokens, r.arrival_ms) for r in read_azure(q)] == [(3, 0.0), (1, 1000.0), (2, 1750.0)]


@pytest.mark.parametrize(
    "row, named",
    [
        ("2024-05-10 25:00:00+00:00,1,1", "column TIMESTAMP"),
        ("2024-13-10 00:00:00,1,1", "column TIMESTAMP"),
        ("yesterday,1,1", "column TIMESTAMP"),
        ("2024-05-10 00:00:00,lots,1", "column ContextTokens"),
        ("2024-05-10 00:00:00,1,-3", "column GeneratedTokens"),
        ("2024-05-10 00:00:00,1.5,3", "column ContextTokens"),
        ("2024-05-10 00:00:00,1", "expected 3 columns"),
    ],
)
def test_azure_bad_rows_are_refused_naming_line_and_column(tmp_path, row, named):
    p = tmp_path / "bad.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,1,1\n" + row + "\n")
    with pytest.raises(ValueError, match=rf"bad\.csv:3: {named}"):
        read_azure(p)


# BurstGPT (github.com/HPMLL/BurstGPT) as its README documents it: seconds from the first day's midnight, failed
# requests with 0 response tokens; its later files add Session ID and Elapsed time.
BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,472,18,490,Conversation log\n"
    "5,ChatGPT,1087,230,1317,Conversation log\n"
    "5,GPT-4,0,20,20,Conversation log\n"
    "6,GPT-4,417,276,693,Conversation log\n"
    "118,ChatGPT,300,0,300,API log\n"
    "120,GPT-4,35,7,42,API log\n"
)


def test_burstgpt_reads_seconds_leaves_out_failures_and_filters_models(tmp_path):
    p = tmp_path / "BurstGPT_1.csv"
    p.write_text(BURSTGPT)
    reqs = read_burstgpt(p)
    assert [(r.arrival_ms, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 472, 18),
        (0.0, 1087, 230),
        (0.0, 1, 20),  # an empty prompt is still one token
        (1000.0, 417, 276),
        (115_000.0, 35, 7),  # the failed request at 118 s is left out
    ]
    assert {r.source for r in reqs} == {"burstgpt"} and read_csv_trace(p) == reqs
    gpt4 = read_burstgpt(p, models=["GPT-4"], tier="background")
    assert [r.arrival_ms for r in gpt4] == [0.0, 1000.0, 115_000.0] and {r.tier for r in gpt4} == {"background"}
    assert len(read_burstgpt(p, limit=2)) == 2
    # A stamp's requests spread evenly, never past the next stamp nor past one second.
    spread = read_csv_trace(p, bucket_spread_ms=3000)
    assert [r.arrival_ms for r in spread] == [0.0, pytest.approx(1000 / 3), pytest.approx(2000 / 3), 1000.0, 115_000.0]
    # The session columns of the later files are read past.
    q = tmp_path / "BurstGPT_3.csv"
    q.write_text(
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0.5,a1,2.0,ChatGPT,10,5,15,Conversation log\n"
        "1.25,a1,1.0,ChatGPT,20,6,26,Conversation log\n"
    )
    assert [(r.arrival_ms, r.prompt_tokens) for r in read_burstgpt(q)] == [(0.0, 10), (750.0, 20)]


def test_csv_traces_are_told_apart_and_strangers_refused(tmp_path):
    az = tmp_path / "az.csv"
    az.write_text(AZURE_2024)
    bg = tmp_path / "bg.csv"
    bg.write_text(BURSTGPT)
    with pytest.raises(ValueError, match="BurstGPT header"):
        read_azure(bg)
    with pytest.raises(ValueError, match="Azure header"):
        read_burstgpt(az)
    other = tmp_path / "sharegpt.csv"
    other.write_text("conversation_id,turns\n1,2\n")
    with pytest.raises(ValueError, match="neither an Azure LLM inference trace .* nor a BurstGPT"):
        read_csv_trace(other)
    bad = tmp_path / "bad.csv"
    bad.write_text(BURSTGPT + "soon,ChatGPT,1,1,2,API log\n")
    with pytest.raises(ValueError, match=r"bad\.csv:8: column Timestamp"):
        read_burstgpt(bad)
    bare = tmp_path / "nomodel.csv"
    bare.write_text("Timestamp,Request tokens,Response tokens\n1,2,3\n")
    assert [(r.prompt_tokens, r.output_tokens) for r in read_burstgpt(bare)] == [(2, 3)]
    with pytest.raises(ValueError, match="no Model column"):
        read_burstgpt(bare, models=["GPT-4"])


def test_azure_real_traces_match_source_statistics():
    code = read_azure(real("azure-code"))
    conv = read_azure(real("azure-conv"))
    assert (len(code), len(conv)) == (8819, 19366)
    assert statistics.fmean(r.prompt_tokens for r in code) == pytest.approx(2047.8, abs=0.05)
    assert statistics.fmean(r.output_tokens for r in conv) == pytest.approx(211.1, abs=0.05)
    assert code[-1].arrival_ms / 1000 == pytest.approx(3435.9, abs=0.05)


# --- Mooncake --------------------------------------------------------------------------------------------------


def test_mooncake_excerpt_prefix_blocks():
    reqs = read_mooncake(excerpt("mooncake-conv"))
    assert len(reqs) == 300
    assert reqs[0].prompt_tokens == 6758 and reqs[0].output_tokens == 500
    assert reqs[0].prefix_hash_ids == tuple(range(14))
    assert reqs[1].prefix_hash_ids[:2] == (0, 14)  # shares block 0 with request 0
    # hash_ids are 512-token blocks: len == ceil(input / 512) for every row
    assert all(len(r.prefix_hash_ids) == math.ceil(r.prompt_tokens / 512) for r in reqs)
    assert reqs[-1].arrival_ms == 102_000.0


def test_mooncake_bucket_spread_is_even_and_keeps_order():
    fired = read_mooncake(excerpt("mooncake-conv"), limit=40)
    spread = read_mooncake(excerpt("mooncake-conv"), limit=40, bucket_spread_ms=3000.0)
    bucket0 = [r for r in fired if r.arrival_ms == 0.0]
    n = len(bucket0)
    assert n >= 2
    assert [r.arrival_ms for r in spread[:n]] == [k * 3000.0 / n for k in range(n)]
    assert [r.prompt_tokens for r in spread] == [r.prompt_tokens for r in fired]


def test_mooncake_real_trace_reuse_ratio():
    reqs = read_mooncake(real("mooncake-conv"))
    assert len(reqs) == 12031
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        lead = 0
        for h in r.prefix_hash_ids:
            if h not in seen:
                break
            lead += 1
        hit += lead
        total += len(r.prefix_hash_ids)
        seen.update(r.prefix_hash_ids)
    assert hit / total == pytest.approx(0.366, abs=0.001)  # SOURCE.md: 36.6% ideal block reuse


# --- ServeGen --------------------------------------------------------------------------------------------------


def test_servegen_excerpt_is_deterministic_and_rate_tracks_windows():
    path = excerpt("servegen-mm-image")
    assert servegen_clients(path) == [2, 14, 21]
    a = servegen_arrivals(path, duration_s=1200.0, seed=3)
    b = servegen_arrivals(path, duration_s=1200.0, seed=3)
    c = servegen_arrivals(path, duration_s=1200.0, seed=4)
    assert a == b and a != c
    assert all(0.0 <= r.arrival_ms < 1_200_000.0 for r in a)
    assert all(x.arrival_ms <= y.arrival_ms for x, y in zip(a, a[1:]))
    assert {r.source.split(":")[0] for r in a} == {"servegen-mm-image"}
    # Mean count over seeds ~ sum over windows of rate * 600 s for the three clients (the first 6 windows).
    expected = 0.0
    import tarfile

    with tarfile.open(path, "r:gz") as tar:
        for m in tar:
            if m.name.endswith("-trace.csv"):
                rows = tar.extractfile(m).read().decode().splitlines()[:6]
                expected += sum(float(row.split(",")[1]) * 600 for row in rows if row.split(",")[3])
    counts = [len(servegen_arrivals(path, duration_s=3600.0, seed=s)) for s in range(5)]
    assert statistics.fmean(counts) == pytest.approx(expected, rel=0.1)
    doubled = servegen_arrivals(path, duration_s=1200.0, seed=3, rate_scale=2.0)
    assert len(doubled) == pytest.approx(2 * len(a), rel=0.1)


def test_servegen_clients_filter_and_start_offset():
    path = excerpt("servegen-mm-image")
    only = servegen_arrivals(path, duration_s=600.0, clients=[21], seed=1)
    assert {r.source for r in only} == {"servegen-mm-image:21"}
    later = servegen_arrivals(path, start_s=3600.0, duration_s=600.0, seed=1)
    assert later and all(0.0 <= r.arrival_ms < 600_000.0 for r in later)


def test_servegen_real_archive_lengths_use_pooled_pmf_for_missing_clients():
    path = real("servegen-m-small")
    reqs = servegen_arrivals(
        path, duration_s=60.0, start_s=80_000.0, clients=[1, 2], seed=0
    )  # client 1 has no dataset.json
    assert {r.source.rsplit(":", 1)[1] for r in reqs} == {"1", "2"}
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in reqs)


# --- synthetic arrivals and transforms -------------------------------------------------------------------------


def test_poisson_rate_and_determinism():
    reqs = poisson(10.0, num_requests=5000, seed=7)
    assert reqs == poisson(10.0, num_requests=5000, seed=7)
    assert reqs[0].arrival_ms == 0.0 and len(reqs) == 5000
    gaps = [b.arrival_ms - a.arrival_ms for a, b in zip(reqs, reqs[1:])]
    assert statistics.fmean(gaps) == pytest.approx(100.0, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.07)


def test_gamma_cv_and_duration():
    reqs = gamma(20.0, 3.0, duration_s=500.0, seed=1)
    assert all(r.arrival_ms < 500_000.0 for r in reqs)
    gaps = [b.arrival_ms - a.arrival_ms for a, b in zip(reqs, reqs[1:])]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(3.0, rel=0.2)
    assert len(reqs) == pytest.approx(10_000, rel=0.15)


def test_arrivals_draw_lengths_from_a_trace():
    trace = read_mooncake(excerpt("mooncake-conv"), limit=10)
    reqs = poisson(5.0, num_requests=50, seed=2, lengths=trace)
    pairs = {(r.prompt_tokens, r.output_tokens, r.prefix_hash_ids) for r in trace}
    assert all((r.prompt_tokens, r.output_tokens, r.prefix_hash_ids) in pairs for r in reqs)


def test_arrivals_need_exactly_one_bound():
    with pytest.raises(ValueError):
        poisson(1.0)
    with pytest.raises(ValueError):
        poisson(1.0, duration_s=1.0, num_requests=3)


def test_assign_tiers_exact_counts_and_seeded():
    reqs = poisson(1.0, num_requests=101, seed=0)
    tagged = assign_tiers(reqs, {"interactive": 0.3, "background": 0.7}, seed=5)
    assert sum(r.tier == "interactive" for r in tagged) == 30  # 30.3 -> 30, 70.7 -> 71
    assert sum(r.tier == "background" for r in tagged) == 71
    assert [r.arrival_ms for r in tagged] == [r.arrival_ms for r in reqs]
    assert tagged == assign_tiers(reqs, {"interactive": 0.3, "background": 0.7}, seed=5)
    assert tagged != assign_tiers(reqs, {"interactive": 0.3, "background": 0.7}, seed=6)
    with pytest.raises(ValueError):
        assign_tiers(reqs, {"interactive": 0.5, "background": 0.6})


def test_scale_time_rate_and_window():
    reqs = [TraceRequest(float(t), 10, 2) for t in (0, 100, 200, 400)]
    assert [r.arrival_ms for r in scale_time(reqs, 0.5)] == [0.0, 50.0, 100.0, 200.0]
    assert [r.arrival_ms for r in scale_to_rate(reqs, 15.0)] == pytest.approx([0.0, 50.0, 100.0, 200.0])
    assert [r.arrival_ms for r in window(reqs, 100.0, 400.0)] == [0.0, 100.0]
    with pytest.raises(ValueError):
        scale_time(reqs, 0.0)


def test_default_trace_path_finds_real_or_excerpt(monkeypatch, tmp_path):
    monkeypatch.setenv("NITSUM_TRACES_DIR", str(tmp_path / "missing"))
    assert traces_dir() is None
    assert is_excerpt(default_trace_path("azure-code"))
    (tmp_path / "azure_llm_2023").mkdir()
    fake = tmp_path / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
    fake.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 00:00:00.0000000,5,6")
    monkeypatch.setenv("NITSUM_TRACES_DIR", str(tmp_path))
    assert default_trace_path("azure-code") == fake and not is_excerpt(fake)
    with pytest.raises(FileNotFoundError, match="names:"):
        default_trace_path("no-such-trace")
