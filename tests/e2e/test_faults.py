"""Faults on the live CPU mesh (real processes, real NATS, tiny model): nothing is lost, nothing hangs."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import openai
import pytest

from tests.e2e.harness import ManualMesh, http_get, prompts, stream_completion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A bound that only catches hangs (a stuck request would wait forever), not a performance claim.
HANG_GUARD_S = 60.0


@pytest.fixture
def mesh2(tmp_path, tiny_model_dir):
    mesh = ManualMesh(tmp_path, tiny_model_dir, num_workers=2).start()
    yield mesh
    mesh.stop()


@pytest.fixture
def mesh1(tmp_path, tiny_model_dir):
    mesh = ManualMesh(tmp_path, tiny_model_dir, num_workers=1).start()
    yield mesh
    mesh.stop()


async def _many(url: str, batch: list[list[int]], max_tokens: int, on_token=None):
    timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(stream_completion(session, url, p, max_tokens, on_token=on_token) for p in batch))


def _spans(mesh) -> list[dict]:
    path = mesh.tmp / "spans.jsonl"
    time.sleep(0.6)  # the span processors flush every 200 ms
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_worker_killed_mid_stream_with_a_spare(mesh2):
    batch = prompts(50)
    max_tokens = 96
    reference = asyncio.run(_many(mesh2.url, batch, max_tokens))
    assert all(r.status == 200 and len(r.token_ids) == max_tokens for r in reference)
    progress = {"tokens": 0, "killed": False}
    victim = mesh2.services["worker-0"]

    def on_token(_n):
        progress["tokens"] += 1
        if not progress["killed"] and progress["tokens"] >= 200:
            progress["killed"] = True
            victim.signal(signal.SIGKILL)

    results = asyncio.run(_many(mesh2.url, batch, max_tokens, on_token=on_token))
    assert progress["killed"]
    assert victim.process.wait(5) == -signal.SIGKILL
    for ref, got in zip(reference, results):
        assert got.status == 200 and got.error is None, got
        # Greedy: exactly the clean run's tokens, none duplicated, none missing.
        assert got.token_ids == ref.token_ids
        assert got.finish_reason == "length"
    rerouted = [
        s for s in _spans(mesh2) if s["name"] == "gateway.request" and any(e["name"] == "rerouted" for e in s["events"])
    ]
    assert rerouted, "re-routed requests must say so in their traces"
    assert all(
        e["attributes"]["nitsum.reason"] in ("worker_lost", "worker_silent", "stream_gap")
        for s in rerouted
        for e in s["events"]
        if e["name"] == "rerouted"
    )


def test_no_spare_every_request_ends_with_a_clear_error_then_service_resumes(mesh1):
    batch = prompts(8)
    state = {"killed": False, "tokens": 0}
    victim = mesh1.services["worker-0"]

    def on_token(_n):
        state["tokens"] += 1
        if not state["killed"] and state["tokens"] >= 20:
            state["killed"] = True
            victim.signal(signal.SIGKILL)

    t0 = time.monotonic()
    results = asyncio.run(_many(mesh1.url, batch, 400, on_token=on_token))
    assert state["killed"]
    assert time.monotonic() - t0 < HANG_GUARD_S
    for r in results:
        if r.status == 200:
            # Streams that had started end with an SSE error event naming what happened.
            assert r.error is not None and r.error["code"] and r.error["message"], r
        else:
            assert r.status == 503
    # No worker at all: 503 with Retry-After, at once.
    status, body = http_get(mesh1.url + "/ready")
    assert status == 503 and body["ready"] is False

    async def one():
        async with aiohttp.ClientSession() as s:
            async with s.post(mesh1.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

    status, retry_after, body = asyncio.run(one())
    assert status == 503 and int(retry_after) >= 1 and body["error"]["code"]
    # A worker registers: service resumes.
    mesh1.add_worker(1).start()
    mesh1.wait_ready()
    results = asyncio.run(_many(mesh1.url, batch[:2], 4))
    assert all(r.status == 200 and len(r.token_ids) == 4 for r in results)
    failed = [s for s in _spans(mesh1) if s["name"] == "gateway.request" and s["status"] == "ERROR"]
    assert failed and all(s["status_description"] for s in failed)


def test_client_disconnects_abort_at_the_workers_and_free_kv(mesh2):
    batch = prompts(100, seed=3)

    async def drop_all():
        async with aiohttp.ClientSession() as session:

            async def start_and_drop(p):
                body = {"prompt": p, "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
                resp = await session.post(mesh2.url + "/v1/completions", json=body)
                await resp.content.readline()  # the stream has started
                resp.close()  # the client goes away mid-stream

            await asyncio.gather(*(start_and_drop(p) for p in batch))

    asyncio.run(drop_all())
    deadline = time.monotonic() + 60  # generous: 100 aborts on a loaded 2-core machine take a while to land
    aborted = 0.0
    while time.monotonic() < deadline:
        aborted = sum(
            _metric(mesh2, f"worker-{i}", "nitsum_aborted_requests_total", 'reason="client_disconnected"')
            for i in range(2)
        )
        if aborted >= 100:
            break
        time.sleep(0.2)
    assert aborted == 100
    status = mesh2.wait_workers(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(w["kv_blocks_free"] != w["kv_blocks_total"] for w in status["workers"]):
        time.sleep(0.3)
        status = mesh2.admin_status()
    assert all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in status["workers"]), status
    results = asyncio.run(_many(mesh2.url, batch[:1], 5))
    assert results[0].status == 200 and len(results[0].token_ids) == 5
    cancelled = [
        s
        for s in _spans(mesh2)
        if s["name"] == "gateway.request" and s["attributes"].get("nitsum.error") == "client_disconnected"
    ]
    assert len(cancelled) == 100 and all(s["status"] == "ERROR" for s in cancelled)
    aborted_at_worker = [
        s
        for s in _spans(mesh2)
        if s["name"] == "worker.generate"
        and s["status"] == "ERROR"
        and "client_disconnected" in s["status_description"]
    ]
    assert len(aborted_at_worker) == 100


def _metric(mesh, service: str, name: str, label: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(mesh.metrics_url(service), timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


def test_nats_restart_services_reconnect(mesh2):
    batch = prompts(6)

    async def run():
        timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(stream_completion(session, mesh2.url, p, 300)) for p in batch]
            await asyncio.sleep(0.5)
            mesh2.nats.stop()
            await asyncio.sleep(1.0)
            mesh2.nats.start(log_path=mesh2.tmp / "nats2.log")
            back = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, back

    results, back = asyncio.run(run())
    for r in results:
        # In flight across the outage: finished, or ended with a clear error — never a hang.
        assert (r.status == 200 and (r.error is not None or len(r.token_ids) == 300)) or r.status in (503,), r
    # New requests succeed soon after NATS is back, without restarting any service.
    ok = False
    while time.monotonic() - back < 30 and not ok:
        got = asyncio.run(_many(mesh2.url, batch[:1], 3))[0]
        ok = got.status == 200 and len(got.token_ids) == 3
        if not ok:
            time.sleep(0.3)
    assert ok
    assert all(svc.process.poll() is None for svc in mesh2.services.values())


def test_graceful_drain_of_a_worker_and_of_the_gateway(mesh2):
    batch = prompts(10)

    async def run():
        timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            progress = {"tokens": 0}
            going = asyncio.Event()

            def on_token(_n):
                progress["tokens"] += 1
                if progress["tokens"] >= 20:
                    going.set()

            tasks = [
                asyncio.create_task(stream_completion(session, mesh2.url, p, 200, on_token=on_token)) for p in batch
            ]
            await asyncio.wait_for(going.wait(), HANG_GUARD_S)
            mesh2.services["worker-0"].signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            later = [asyncio.create_task(stream_completion(session, mesh2.url, p, 5)) for p in batch[:4]]
            return await asyncio.gather(*tasks), await asyncio.gather(*later)

    results, later = asyncio.run(run())
    assert all(r.status == 200 and r.error is None and len(r.token_ids) == 200 for r in results)
    assert all(r.status == 200 and len(r.token_ids) == 5 for r in later)
    assert mesh2.services["worker-0"].process.wait(40) == 0
    status = mesh2.admin_status()
    assert [w["worker_id"] for w in status["workers"]] == ["node0-1"]

    # Gateway: /ready turns 503 at once, streams in flight finish, then it exits.
    async def drain_gateway():
        timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            started = {"n": 0}
            first_tokens = asyncio.Event()

            def on_token(n):
                if n == 1:
                    started["n"] += 1
                    if started["n"] == 3:
                        first_tokens.set()

            tasks = [
                asyncio.create_task(stream_completion(session, mesh2.url, p, 300, on_token=on_token)) for p in batch[:3]
            ]
            await asyncio.wait_for(first_tokens.wait(), HANG_GUARD_S)  # every stream is in flight
            mesh2.services["gateway"].signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            async with session.get(mesh2.url + "/ready") as resp:
                ready_status = resp.status
            return ready_status, await asyncio.gather(*tasks)

    ready_status, streams = asyncio.run(drain_gateway())
    assert ready_status == 503
    assert all(r.status == 200 and len(r.token_ids) == 300 for r in streams)
    assert mesh2.services["gateway"].process.wait(40) == 0


def test_coordinator_killed_and_restarted_streams_keep_going(mesh2):
    batch = prompts(8)

    async def run():
        timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(stream_completion(session, mesh2.url, p, 400)) for p in batch]
            await asyncio.sleep(0.3)
            mesh2.services["coordinator"].signal(signal.SIGKILL)
            mesh2.services["coordinator"].process.wait(5)
            mesh2.add("coordinator", "coordinator").start()
            await asyncio.sleep(0)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert all(r.status == 200 and r.error is None and len(r.token_ids) == 400 for r in results)
    status = mesh2.wait_workers(2)
    assert len(status["workers"]) == 2
    after = asyncio.run(_many(mesh2.url, batch[:2], 4))
    assert all(r.status == 200 for r in after)


def test_wedged_worker_turns_ready_503(mesh1):
    worker = mesh1.services["worker-0"]
    worker.signal(signal.SIGSTOP)
    try:
        status, body = http_get(mesh1.url + "/ready", timeout_s=30)
        assert status == 503 and body["ready"] is False
    finally:
        worker.signal(signal.SIGCONT)
    mesh1.wait_ready()


def test_overload_is_429_with_retry_after_background_first(tmp_path, tiny_model_dir):
    mesh = ManualMesh(
        tmp_path,
        tiny_model_dir,
        num_workers=1,
        env_extra={"NITSUM_QUEUE_LIMIT_BACKGROUND": "2", "NITSUM_QUEUE_LIMIT_INTERACTIVE": "50"},
    ).start()
    try:

        async def flood():
            timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                bg = [
                    asyncio.create_task(
                        stream_completion(session, mesh.url, p, 300, headers={"x-request-tier": "background"})
                    )
                    for p in prompts(8)
                ]
                await asyncio.sleep(0.5)
                inter = await asyncio.gather(
                    *(
                        stream_completion(session, mesh.url, p, 4, headers={"x-request-tier": "interactive"})
                        for p in prompts(3, seed=9)
                    )
                )
                return await asyncio.gather(*bg), inter

        background, interactive = asyncio.run(flood())
        rejected = [r for r in background if r.status == 429]
        assert len(rejected) >= 5 and all(r.error["type"] == "rate_limit_error" for r in rejected)
        assert sum(r.status == 200 for r in background) == 2
        assert all(r.status == 200 for r in interactive)  # background is shed before interactive

        async def hold_queue():
            timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                held = [
                    asyncio.create_task(
                        stream_completion(session, mesh.url, p, 1900, headers={"x-request-tier": "background"})
                    )
                    for p in prompts(2)
                ]
                await asyncio.sleep(0.5)
                client = openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="x", max_retries=1)
                try:
                    await client.completions.create(
                        model="tiny", prompt="hi", max_tokens=2, extra_headers={"x-request-tier": "background"}
                    )
                except openai.RateLimitError as exc:
                    error = exc
                else:
                    error = None
                return error, await asyncio.gather(*held)

        deadline = time.monotonic() + 20
        while mesh.admin_status()["queue_depth"]["background"] and time.monotonic() < deadline:
            time.sleep(0.2)
        error, held = asyncio.run(hold_queue())
        assert all(r.status == 200 for r in held)
        assert isinstance(error, openai.RateLimitError)
        assert error.response.headers["Retry-After"]
    finally:
        mesh.stop()
