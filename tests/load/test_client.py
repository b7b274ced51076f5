"""The streaming client against a fake OpenAI server on a free 127.0.0.1 port: lifecycles and error kinds."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from nitsum_load.client import (
    ClientConfig,
    PromptScale,
    RequestSpec,
    RequestTracker,
    build_body,
    calibrate_prompt,
    send,
    synth_prompt,
)

SPEC = RequestSpec(
    request_id="r1",
    arrival_ms=0.0,
    prompt_tokens=6,
    output_tokens=5,
    tier="background",
    ttft_slo_ms=10_000.0,
    tpot_slo_ms=100.0,
    weight=1.0,
)


async def run_one(url: str, model: str, spec: RequestSpec = SPEC, **cfg_kw) -> RequestTracker:
    cfg = ClientConfig(base_url=url, model=model, **cfg_kw)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tracker = RequestTracker(spec)
    async with aiohttp.ClientSession() as session:
        await send(session, cfg, tracker, lambda: (loop.time() - t0) * 1000.0)
    return tracker


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_streamed_lifecycle(fake_server, endpoint):
    tracker = await run_one(fake_server.url, "ok", endpoint=endpoint)
    rec = tracker.to_record()
    assert rec.error is None and rec.succeeded
    assert rec.output_tokens == 5
    assert rec.prompt_tokens == (3 * 6 + 5 if endpoint == "chat" else 3 * 6)  # from usage (fake tokenizer)
    assert len(rec.token_times_ms) == 5
    assert list(rec.token_times_ms) == sorted(rec.token_times_ms)
    assert rec.first_token_ms == rec.token_times_ms[0] and rec.finish_ms == rec.token_times_ms[-1]
    assert tracker.done_ms >= rec.finish_ms and tracker.dispatched_ms <= rec.first_token_ms
    assert (tracker.http_status, tracker.server_request_id, tracker.server_tier) == (200, "srv-1", "background")
    assert tracker.to_log()["server_tier"] == "background"
    assert rec.slo_met  # a few ms against a 10 s / 100 ms target
    seen = fake_server.seen[-1]
    assert seen["path"] == f"/v1/{'chat/' if endpoint == 'chat' else ''}completions"
    h = {k.lower(): v for k, v in seen["headers"].items()}
    assert (h["x-request-tier"], h["x-slo-ttft-ms"], h["x-slo-tpot-ms"]) == ("background", "10000", "100")
    b = seen["body"]
    assert (b["stream"], b["stream_options"], b["max_tokens"], b["ignore_eos"]) == (
        True,
        {"include_usage": True},
        5,
        True,
    )


async def test_token_ids_count_multi_token_chunks(fake_server):
    tracker = await run_one(
        fake_server.url, "multi", endpoint="completions", prompt_format="token-ids", return_token_ids=True
    )
    rec = tracker.to_record()
    assert rec.output_tokens == 5 and len(set(rec.token_times_ms)) == 1  # five tokens, one arrival time
    assert fake_server.seen[-1]["body"]["prompt"] == [100, 101, 102, 103, 104, 105]
    assert fake_server.seen[-1]["body"]["return_token_ids"] is True


async def test_api_key_header(fake_server):
    await run_one(fake_server.url, "ok", api_key="sekret")
    h = {k.lower(): v for k, v in fake_server.seen[-1]["headers"].items()}
    assert h["authorization"] == "Bearer sekret"


@pytest.mark.parametrize(
    ("model", "kind"),
    [("fail-429", "http_429"), ("fail-503", "http_503"), ("fail-400", "http_4xx"), ("fail-500", "http_5xx")],
)
async def test_http_errors(fake_server, model, kind):
    tracker = await run_one(fake_server.url, model)
    rec = tracker.to_record()
    assert (rec.error, rec.first_token_ms, rec.finish_ms, rec.output_tokens) == (kind, None, None, 0)
    assert "nope" in tracker.error_detail


async def test_broken_stream_keeps_tokens_seen(fake_server):
    rec = (await run_one(fake_server.url, "break")).to_record()
    assert (rec.error, rec.output_tokens, rec.finish_ms) == ("stream_error", 2, None)
    assert rec.first_token_ms is not None and not rec.slo_met


async def test_in_stream_error(fake_server):
    tracker = await run_one(fake_server.url, "in-stream-error")
    assert tracker.error == "stream_error" and "engine died" in tracker.error_detail


async def test_finish_reason_without_done_is_success(fake_server):
    rec = (await run_one(fake_server.url, "no-done")).to_record()
    assert rec.error is None and rec.output_tokens == 5 and rec.succeeded


async def test_timeout(fake_server):
    rec = (await run_one(fake_server.url, "slow", request_timeout_s=0.2)).to_record()
    assert (rec.error, rec.first_token_ms) == ("timeout", None)


async def test_connection_refused():
    with socket.socket() as s:  # a port nobody listens on: bind, read it, close
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = (await run_one(f"http://127.0.0.1:{port}", "ok")).to_record()
    assert rec.error == "connection"


def test_body_and_prompt_synthesis():
    assert synth_prompt(3, "text") == "hello hello hello"
    assert synth_prompt(3, "token-ids", seed_index=99) == [199, 100, 101]
    chat = build_body(ClientConfig(base_url="http://x", model="m", ignore_eos=False), SPEC)
    assert chat["messages"] == [{"role": "user", "content": synth_prompt(6, "text")}]
    assert "ignore_eos" not in chat and "prompt" not in chat
    with pytest.raises(ValueError, match="token-id prompts"):
        ClientConfig(base_url="http://x", model="m", prompt_format="token-ids")


def test_prompt_scale_fit_and_words():
    scale = PromptScale.fit(8, 29, 40, 125)  # 3 tokens per word + 5
    assert (scale.tokens_per_word, scale.overhead_tokens) == (3.0, 5.0)
    assert [scale.words_for(n) for n in (1, 8, 35, 305)] == [1, 1, 10, 100]
    assert PromptScale.fit(8, 30, 40, 30) == PromptScale()  # unusable: fall back to one token per word
    assert synth_prompt(4, "text", scale=PromptScale(2.0, 0.0)) == "hello hello"


@pytest.mark.parametrize(("endpoint", "overhead"), [("chat", 5.0), ("completions", 0.0)])
async def test_calibrate_prompt_against_server(fake_server, endpoint, overhead):
    cfg = ClientConfig(base_url=fake_server.url, model="ok", endpoint=endpoint)
    async with aiohttp.ClientSession() as session:
        scale = await calibrate_prompt(session, cfg)
    assert scale == PromptScale(3.0, overhead)
    assert fake_server.seen[-1]["body"]["stream"] is False


async def test_calibrate_prompt_error_is_runtime_error(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, model="fail-500")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RuntimeError, match="HTTP 500"):
            await calibrate_prompt(session, cfg)
