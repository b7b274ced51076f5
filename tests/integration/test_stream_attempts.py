"""A request re-routed back to the worker it left (a one-worker mesh) ignores that worker's late frames of the
earlier attempt: they used to look like a new gap and re-route it again until the gateway gave up."""

from __future__ import annotations

import asyncio

import pytest

from nitsum.bus import Bus, BusTimeout, NoResponders
from nitsum.config import CommonConfig
from nitsum.wire.messages import SamplingSpec, SubmitReply, SubmitRequest, TokenChunk
from nitsum_services.gateway.generation import Generation, GenerationError, GenerationRegistry


def _probe(gateway: Bus) -> SubmitRequest:
    return SubmitRequest(
        "probe",
        (1,),
        SamplingSpec(max_tokens=1),
        "interactive",
        200.0,
        25.0,
        10.0,
        0.0,
        gateway.subjects.stream("probe"),
    )


async def _until_listening(gateway: Bus) -> None:
    """nats-server routes a connection's publishes by a cache that learns of another connection's new
    subscription a moment late (a request right after it may meet "no responders"): ask until answered."""
    for _ in range(200):
        try:
            await gateway.request(gateway.subjects.submit, _probe(gateway), 0.2)
            return
        except (NoResponders, BusTimeout):
            await asyncio.sleep(0.01)
    raise AssertionError("the coordinator's subscription never reached the gateway's connection")


async def test_late_frames_of_an_earlier_attempt_are_not_a_gap(nats_server):
    cfg = CommonConfig(nats_url=nats_server.url)
    coordinator = await Bus.connect(cfg, "coordinator")
    gateway = await Bus.connect(cfg, "gateway")
    worker = await Bus.connect(cfg, "worker")
    attempts: list[int] = []

    async def on_submit(req: SubmitRequest, _delivery):  # one worker: every attempt lands on w0
        if req.request_id != "probe":
            attempts.append(req.attempt)
        return SubmitReply(req.request_id, True, worker_id="w0")

    try:
        await coordinator.subscribe(coordinator.subjects.submit, on_submit, expected=SubmitRequest, concurrent=True)
        await coordinator.flush()
        await _until_listening(gateway)
        rid = "cmpl-retry"
        request = SubmitRequest(
            rid,
            (1, 2, 3),
            SamplingSpec(max_tokens=4),
            "interactive",
            200.0,
            25.0,
            10.0,
            0.0,
            gateway.subjects.stream(rid),
        )
        gen = Generation(gateway, request, 10.0, 1, 5.0, GenerationRegistry())  # at most one re-route
        await gen.start()
        subject = worker.subjects.stream(rid, "w0")

        async def send(index, tokens, attempt, finished=False):
            await worker.publish(
                subject,
                TokenChunk(
                    rid,
                    "w0",
                    index,
                    tokens,
                    "x" * len(tokens),
                    finished=finished,
                    finish_reason="length" if finished else "",
                    attempt=attempt,
                ),
            )
            await worker.flush()

        stream = gen.deltas()
        await send(0, (11,), 0)
        assert (await anext(stream)).token_ids == [11]
        await send(2, (13,), 0)  # token 1 was lost: the gateway re-routes (attempt 1, to w0 again)
        await send(3, (14,), 0)  # a late frame of attempt 0, after the re-route
        await send(1, (12, 13, 14), 1, finished=True)
        rest = [d async for d in stream]
        assert [t for d in rest for t in d.token_ids] == [12, 13, 14]
        assert gen.tokens == [11, 12, 13, 14] and gen.reroutes == 1 and attempts == [0, 1]
        await gen.close()
    finally:
        for bus in (coordinator, gateway, worker):
            await bus.drain()


async def test_reroute_rides_out_a_moment_with_no_coordinator(nats_server):
    """A NATS failover: the stream's worker is lost while the coordinator is still reconnecting (nobody listens on
    the submit subject). The re-route waits for it instead of failing a started stream; a first submission with no
    coordinator is refused at once (503, Retry-After)."""
    cfg = CommonConfig(nats_url=nats_server.url)
    gateway = await Bus.connect(cfg, "gateway")
    worker = await Bus.connect(cfg, "worker")
    coordinator = await Bus.connect(cfg, "coordinator")
    attempts: list[int] = []

    async def on_submit(req: SubmitRequest, _delivery):
        if req.request_id != "probe":
            attempts.append(req.attempt)
        return SubmitReply(req.request_id, True, worker_id=f"w{req.attempt}")

    def request(rid: str) -> SubmitRequest:
        return SubmitRequest(
            rid,
            (1, 2, 3),
            SamplingSpec(max_tokens=3),
            "interactive",
            200.0,
            25.0,
            10.0,
            0.0,
            gateway.subjects.stream(rid),
        )

    try:
        lonely = Generation(gateway, request("cmpl-nobody"), 10.0, 1, 5.0, GenerationRegistry())
        with pytest.raises(GenerationError) as refused:
            await lonely.start()
        assert refused.value.status == 503 and refused.value.code == "coordinator_unavailable"

        sub = await coordinator.subscribe(
            coordinator.subjects.submit, on_submit, expected=SubmitRequest, concurrent=True
        )
        await coordinator.flush()
        await _until_listening(gateway)
        rid = "cmpl-failover"
        gen = Generation(gateway, request(rid), 10.0, 1, 5.0, GenerationRegistry())
        await gen.start()
        stream = gen.deltas()
        await worker.publish(worker.subjects.stream(rid, "w0"), TokenChunk(rid, "w0", 0, (11,), "x", attempt=0))
        await worker.flush()
        assert (await anext(stream)).token_ids == [11]
        await sub.unsubscribe()  # the coordinator is gone for a moment (reconnecting elsewhere)
        await coordinator.flush()
        # nats-server routes a connection's publishes by a cache that sees another connection's UNSUB a moment
        # late: wait until the gateway's own connection is told that nobody listens.
        for _ in range(100):
            try:
                await gateway.request(gateway.subjects.submit, request("cmpl-probe"), 0.2)
            except NoResponders:
                break
            except BusTimeout:
                continue

        async def come_back():
            await asyncio.sleep(0.6)
            await coordinator.subscribe(coordinator.subjects.submit, on_submit, expected=SubmitRequest, concurrent=True)
            await coordinator.flush()
            await asyncio.sleep(0.2)
            await worker.publish(
                worker.subjects.stream(rid, "w1"),
                TokenChunk(rid, "w1", 1, (12, 13), "xx", finished=True, finish_reason="length", attempt=1),
            )
            await worker.flush()

        back = asyncio.create_task(come_back())
        gen.worker_lost()  # the re-route meets no coordinator at first
        rest = [d async for d in stream]
        await back
        assert [t for d in rest for t in d.token_ids] == [12, 13]
        assert gen.tokens == [11, 12, 13] and gen.reroutes == 1 and attempts == [0, 1]
        await gen.close()
    finally:
        for bus in (coordinator, gateway, worker):
            await bus.drain()
