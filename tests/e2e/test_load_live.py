"""`nitsum load` against the live mesh from `nitsum up` (fixture `live_mesh`, defined in tests/e2e/conftest.py,
yields the gateway's base URL): a few dozen requests must produce every report file with sane numbers."""

from __future__ import annotations

import csv
import json

import pytest

from nitsum.metrics import summarize
from nitsum_load import cli
from nitsum_load.report import FILES, read_lifecycle_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_REQUESTS = 30
OUTPUT_TOKENS = 8


def test_load_against_live_mesh_writes_sane_report(live_mesh, tmp_path):
    out = tmp_path / "live"
    rc = cli.main(
        [
            "--url",
            live_mesh,
            "--poisson",
            "4",
            "--max-requests",
            str(NUM_REQUESTS),
            "--tier-mix",
            "interactive=0.3,background=0.7",
            "--prompt-tokens",
            "16",
            "--output-tokens",
            str(OUTPUT_TOKENS),
            "--request-timeout",
            "60",
            "--drain-timeout",
            "120",
            "--out",
            str(out),
            "--progress",
            "off",
            "--seed",
            "1",
        ]
    )
    assert rc == 0
    for name in FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    rep = summary["report"]
    overall = rep["overall"]
    assert overall["requests"] == NUM_REQUESTS
    assert overall["errors"] == {}, overall["errors"]  # a light load on a healthy mesh: nothing fails
    assert overall["succeeded"] == NUM_REQUESTS
    assert rep["tiers"]["interactive"]["requests"] == 9 and rep["tiers"]["background"]["requests"] == 21
    records = read_lifecycle_log(out / "requests.jsonl")
    assert len(records) == NUM_REQUESTS
    for r in records:
        assert r.ttft_ms is not None and r.ttft_ms > 0
        assert 1 <= r.output_tokens <= OUTPUT_TOKENS
        assert len(r.token_times_ms) >= 1
    assert 0.0 <= overall["slo_attainment"] <= 1.0
    assert overall["ttft_ms"]["p50"] <= overall["ttft_ms"]["p99"]
    assert summarize(records).to_dict() == rep  # the files are the shared metric code's numbers
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["tier"] for r in rows] == ["interactive", "background", "all"]
    # The gateway read the tier header: it echoes the tier and names the request (ARCHITECTURE.md, HTTP).
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert all(line["http_status"] == 200 and line["server_request_id"] for line in lines)
    assert [line["server_tier"] for line in lines] == [line["tier"] for line in lines]


def test_load_completions_token_id_prompts_live(live_mesh, tmp_path):
    out = tmp_path / "live-completions"
    rc = cli.main(
        [
            "--url",
            live_mesh,
            "--poisson",
            "4",
            "--max-requests",
            "6",
            "--endpoint",
            "completions",
            "--prompt-format",
            "token-ids",
            "--prompt-tokens",
            "12",
            "--output-tokens",
            "4",
            "--request-timeout",
            "60",
            "--out",
            str(out),
            "--progress",
            "off",
        ]
    )
    assert rc == 0
    records = read_lifecycle_log(out / "requests.jsonl")
    assert [r.outcome for r in records] == ["ok"] * 6
    # With token ids returned and ignore_eos sent (both by default), every request streams exactly the tokens
    # asked for, each with its own arrival time.
    assert all(r.output_tokens == 4 and len(r.token_times_ms) == 4 for r in records)
    # usage.prompt_tokens: the 12 ids sent, plus a BOS token if the server prepends one.
    assert all(r.prompt_tokens in (12, 13) for r in records), [r.prompt_tokens for r in records]


def _long_prompt(i: int, length: int) -> list[int]:
    return [3 + (i * 31 + j * 17) % 250 for j in range(length)]


async def _complete(session, url: str, prompt: list[int], headers: dict) -> tuple[int, dict, dict]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def test_overload_answers_background_429_at_once_and_serves_interactive(live_mesh):
    """A flood of long background prompts (TTFT target 5 s) beyond what the groups can start in time, then
    short interactive ones (target 1.5 s: earlier deadlines than the flood's, so ahead of it under EDF). The
    surplus background is answered 429/503 with Retry-After in the OpenAI error shape; every interactive
    request is served. Admission prices prefills from the committed CPU step table (not this machine's
    speed), and the flood is far beyond it (~12 s of prefill against a 5 s target), so the split does not
    depend on timing."""
    import asyncio

    import aiohttp

    background = {"x-request-tier": "background", "x-slo-ttft-ms": "5000"}
    interactive = {"x-request-tier": "interactive", "x-slo-ttft-ms": "1500"}

    async def run():
        timeout = aiohttp.ClientTimeout(total=240)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            flood = [
                asyncio.ensure_future(_complete(session, live_mesh, _long_prompt(i, 1500), background))
                for i in range(60)
            ]
            await asyncio.sleep(0.5)  # the flood is in (refusals come back at once)
            urgent = [
                asyncio.ensure_future(_complete(session, live_mesh, _long_prompt(1000 + i, 16), interactive))
                for i in range(4)
            ]
            return await asyncio.gather(*flood), await asyncio.gather(*urgent)

    flood, urgent = asyncio.run(run())
    assert [status for status, _, _ in urgent] == [200] * len(urgent), [b for _, _, b in urgent]
    refused = [(status, headers, body) for status, headers, body in flood if status in (429, 503)]
    served = [status for status, _, _ in flood if status == 200]
    assert refused and served, [status for status, _, _ in flood]
    assert len(refused) + len(served) == len(flood), [status for status, _, _ in flood]
    for _status, headers, body in refused:
        assert int(headers["Retry-After"]) >= 1
        error = body["error"]
        assert error["type"] in ("rate_limit_error", "service_unavailable") and error["message"], body
    assert any("overloaded" in body["error"]["message"] for _, _, body in refused)


def test_bench_gateway_streams_count_every_token_through_the_mesh(live_mesh):
    """The per-token phase of `nitsum bench gateway` against the live mesh: every stream brings exactly the asked
    tokens (counted by their ids, also those whose text the detokenizer holds back), warm-up ones not counted."""
    import asyncio

    from nitsum_load import bench_floor_tokens as bft
    from nitsum_load import bench_gateway as bg

    measured = asyncio.run(bft.mesh_streams(live_mesh, "tiny", bg.prompts(3, 16), 24, 1, 60.0))
    assert {k: len(v) for k, v in measured.items()} == {"ttft_ms": 2, "per_token_ms": 2, "max_gap_ms": 2}
    assert all(x > 0 for x in measured["ttft_ms"])
    # >= 0, not > 0: on a loaded machine a worker's run of decode steps can reach the client in one read, so every
    # token of a stream may carry the same stamp (seen with the suite and a simulation on the 2 cores).
    assert all(x >= 0 for x in measured["per_token_ms"])
    # a stream's longest gap between two tokens is at least its mean one
    assert all(g >= t for g, t in zip(measured["max_gap_ms"], measured["per_token_ms"], strict=True))
    result = bft.mesh_tokens_result(24, 0.5, measured)
    assert result["per_token_over_step"] == result["per_token_ms"]["p50"] / 0.5
