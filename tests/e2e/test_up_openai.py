"""`nitsum up` end to end with the official `openai` client, and one trace across the services."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.e2e.conftest import get_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_streamed_and_not(mesh_process):
    client = _client(mesh_process.url)
    models = client.models.list()
    model = models.data[0].id
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    # Greedy: the streamed text is exactly the non-streamed text.
    assert "".join(text) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert finish == full.choices[0].finish_reason


def test_completions_with_token_ids_and_errors(mesh_process):
    client = _client(mesh_process.url)
    out = client.completions.create(
        model="tiny",
        prompt=[1, 5, 9, 12],
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].model_extra["token_ids"]) == 5
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    assert info.value.status_code == 400
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_spans_of_three_services_share_a_trace(mesh_process):
    client = _client(mesh_process.url)
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "trace me"}], max_tokens=3, temperature=0
    )
    spans_path = mesh_process.run_dir / "spans.jsonl"
    deadline = time.monotonic() + 15
    found = None
    while time.monotonic() < deadline and found is None:
        if spans_path.exists():
            by_trace: dict[str, set[str]] = {}
            for line in spans_path.read_text().splitlines():
                span = json.loads(line)
                by_trace.setdefault(span["trace_id"], set()).add(span["service"])
            for trace_id, services in by_trace.items():
                if {"gateway", "coordinator"} <= services and services & {"decode-worker", "prefill-worker"}:
                    found = trace_id
        time.sleep(0.3)
    assert found is not None, "no trace holds spans of gateway, coordinator and a worker"


def test_admin_status_and_ready(mesh_process):
    import subprocess
    import sys

    status, body = get_json(mesh_process.url + "/ready")
    assert status == 200 and body["ready"] is True
    out = subprocess.run(
        [sys.executable, "-m", "nitsum.cli", "admin", "status"],
        env=mesh_process.env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["ok"] is True and answer["policy"] == "adaptive"
    assert len(answer["workers"]) == 2
    assert {g["tp"] for g in answer["groups"]} == {1}
    assert set(answer["queue_depth"]) == {"interactive", "background"}
