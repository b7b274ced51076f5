"""Bad input gets a clear OpenAI-shaped error and changes nothing; no worker means 503 + Retry-After."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

pytestmark = pytest.mark.timeout(120)


async def _post(url: str, path: str, body, headers=None, raw: bytes | None = None):
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with session.post(url + path, data=data, headers=hdrs) as resp:
            return resp.status, resp.headers.copy(), await resp.json(content_type=None)


def _assert_openai_error(body, code=None, param=None):
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "stop": 7}, "stop"),
        (COMP, {"prompt": 12}, "prompt"),
        (COMP, {"prompt": ""}, "prompt"),
        (COMP, {"prompt": [1, -2]}, "prompt"),
        (COMP, {"prompt": [10**9]}, "prompt"),
        (COMP, {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        (COMP, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMP, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMP, {"prompt": "x", "logprobs": True}, "logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (COMP, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        (COMP, {"prompt": "x", "frequency_penalty": "a"}, "frequency_penalty"),
        (COMP, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (COMP, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        (COMP, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        (COMP, {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
        (COMP, {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
        (COMP, {"prompt": "x", "priority": "high"}, "priority"),
        (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (COMP, {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        (COMP, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        (COMP, {"prompt": "x", "seed": "s"}, "seed"),
    ],
)
async def test_bad_fields_are_400_with_the_param(gateway_url, path, body, param):
    status, headers, answer = await _post(gateway_url, path, body)
    assert status == 400, answer
    _assert_openai_error(answer, param=param)
    assert headers["x-request-id"]


# Every field the gateway does not honour is refused, named; "off" values of known fields are accepted.
REFUSED = [
    (COMP, {"echo": True}, "echo"),
    (COMP, {"suffix": "end"}, "suffix"),
    (COMP, {"best_of": 3}, "best_of"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"response_format": {"type": "yaml"}}, "response_format"),
    (CHAT, {"response_format": "json"}, "response_format"),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format",
    ),
    (CHAT, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"metadata": {"a": "b"}}, "metadata"),
    (CHAT, {"service_tier": "flex"}, "service_tier"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"audio": {"voice": "alloy"}}, "audio"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (COMP, {"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    (COMP, {"min_tokens": 17}, "min_tokens"),
    (COMP, {"min_p": 1.5}, "min_p"),
    (CHAT, {"min_tokens": 1, "response_format": {"type": "json_object"}}, "min_tokens"),
    (COMP, {"guided_json": {"type": "object"}}, "guided_json"),
    (COMP, {"some_vendor_field": 1}, "some_vendor_field"),
    (CHAT, {"logprobs": True, "echo": True}, "echo"),
]


def _with_base(path, extra):
    base = {"messages": [{"role": "user", "content": "x"}]} if path == CHAT else {"prompt": "x"}
    return {**base, "max_tokens": 2, **extra} if "min_tokens" not in extra else {**base, **extra}


@pytest.mark.parametrize("path, extra, param", REFUSED)
async def test_unsupported_fields_are_400_naming_them(gateway_url, path, extra, param):
    status, _, answer = await _post(gateway_url, path, _with_base(path, extra))
    assert status == 400, answer
    _assert_openai_error(answer, param=param)
    assert param in answer["error"]["message"]


@pytest.mark.parametrize(
    "path, extra",
    [
        (COMP, {"echo": False, "best_of": 1, "suffix": None, "logprobs": None, "n": 1}),
        (
            CHAT,
            {
                "tools": [],
                "tool_choice": "none",
                "response_format": {"type": "text"},
                "store": False,
                "service_tier": "auto",
                "logprobs": False,
                "user": "u1",
            },
        ),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                    },
                }
            },
        ),
        (COMP, {"response_format": {"type": "json_object"}}),
        # vLLM's benchmark_serving completions body, as it sends it.
        (
            COMP,
            {
                "model": None,
                "temperature": 0.0,
                "best_of": 1,
                "max_tokens": 8,
                "min_tokens": 8,
                "logprobs": None,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            CHAT,
            {
                "temperature": 0.0,
                "max_completion_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "min_p": 0.1,
                "top_k": 5,
            },
        ),
        (
            CHAT,
            {
                "n": 2,
                "best_of": 2,
                "logprobs": True,
                "top_logprobs": 3,
                "presence_penalty": 1,
                "frequency_penalty": -1,
                "logit_bias": {"5": -100},
                "priority": -1,
            },
        ),
    ],
)
async def test_off_values_and_honoured_fields_pass_validation(gateway_url, path, extra):
    # No worker behind this gateway: passing validation shows as the 503 of the mesh, not a 400.
    status, _, answer = await _post(gateway_url, path, _with_base(path, extra))
    assert status == 503, answer


async def test_unknown_objective_is_400_and_known_ones_pass(gateway_url):
    status, _, answer = await _post(
        gateway_url, COMP, _with_base(COMP, {}), headers={"x-gateway-inference-objective": "no-such"}
    )
    assert status == 400
    _assert_openai_error(answer, code="unknown_objective", param="x-gateway-inference-objective")
    for objective in ("critical", "sheddable", "interactive"):
        status, _, answer = await _post(
            gateway_url,
            COMP,
            _with_base(COMP, {}),
            headers={"x-gateway-inference-objective": objective, "x-gateway-inference-fairness-id": "tenant-a"},
        )
        assert status == 503, answer


async def test_unknown_fields_tolerated_when_configured(tmp_path, bare_nats, tiny_model_dir):
    from tests.gateway.conftest import _start_gateway

    proc, url = _start_gateway(tmp_path, bare_nats.url, tiny_model_dir, {"NITSUM_GATEWAY_ALLOW_UNKNOWN_FIELDS": "true"})
    try:
        status, headers, answer = await _post(url, COMP, _with_base(COMP, {"some_vendor_field": 1, "other": {"x": 1}}))
        assert status == 503, answer  # got past validation
        assert headers["x-nitsum-ignored-fields"] == "some_vendor_field,other"
        # Known fields keep their rules: an unsupported value is still refused.
        status, _, answer = await _post(url, COMP, _with_base(COMP, {"echo": True}))
        assert status == 400 and answer["error"]["param"] == "echo"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_malformed_json_and_content_type(gateway_url):
    status, _, body = await _post(gateway_url, CHAT, None, raw=b'{"messages": [')
    assert status == 400
    _assert_openai_error(body, code="invalid_json")
    status, _, body = await _post(gateway_url, CHAT, None, headers={"Content-Type": "text/plain"}, raw=b"hello")
    assert status == 400
    _assert_openai_error(body, code="invalid_content_type")
    status, _, body = await _post(gateway_url, CHAT, [1, 2, 3])
    assert status == 400
    _assert_openai_error(body)


async def test_unknown_tier_and_bad_slo_headers(gateway_url):
    msg = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    status, _, body = await _post(gateway_url, CHAT, msg, headers={"x-request-tier": "platinum"})
    assert status == 400
    _assert_openai_error(body, code="unknown_tier", param="x-request-tier")
    status, _, body = await _post(gateway_url, CHAT, msg, headers={"x-slo-ttft-ms": "soon"})
    assert status == 400
    _assert_openai_error(body, param="x-slo-ttft-ms")
    status, _, body = await _post(gateway_url, CHAT, msg, headers={"x-slo-tpot-ms": "-5"})
    assert status == 400


async def test_body_over_the_limit_is_413_json(gateway_url):
    big = {"prompt": "x" * (9 << 20), "max_tokens": 1}
    status, _, body = await _post(gateway_url, COMP, big)
    assert status == 413
    _assert_openai_error(body, code="body_too_large")


async def test_context_overflow_and_huge_message_lists_are_400_and_loop_stays_responsive(gateway_url):
    long_prompt = list(range(5, 260)) * 12  # > 2048 tokens
    status, _, body = await _post(gateway_url, COMP, {"prompt": long_prompt, "max_tokens": 1})
    assert status == 400
    _assert_openai_error(body, code="context_length_exceeded")
    many = {"messages": [{"role": "user", "content": "a"}] * 100_000, "max_tokens": 1}

    async def health_probe():
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            async with session.get(gateway_url + "/health") as resp:
                return resp.status, time.monotonic() - t0

    (status, _, body), (health_status, _) = await asyncio.gather(_post(gateway_url, CHAT, many), health_probe())
    assert status == 400  # 100,000 messages fit the body limit; the message limit refuses them, before any work
    _assert_openai_error(body, param="messages")
    assert health_status == 200


async def test_unknown_model_and_route(gateway_url):
    status, _, body = await _post(gateway_url, COMP, {"prompt": "x", "model": "gpt-9"})
    assert status == 404
    _assert_openai_error(body, code="model_not_found", param="model")
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway_url + "/v2/nothing") as resp:
            assert resp.status == 404
            _assert_openai_error(await resp.json())


async def test_no_worker_is_503_with_retry_after(gateway_url):
    status, headers, body = await _post(
        gateway_url, CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    )
    assert status == 503
    assert int(headers["Retry-After"]) >= 1
    _assert_openai_error(body)
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway_url + "/ready") as resp:
            assert resp.status == 503
            assert "Retry-After" in resp.headers
            assert (await resp.json())["ready"] is False
