"""A request re-routed back to the worker it left (a one-worker mesh) ignores that worker's late frames of the
earlier attempt: they used to look like a new gap and re-route it again until the gateway gave up."""

from __future__ import annotations

from nitsum.bus import Bus
from nitsum.config import CommonConfig
from nitsum.wire.messages import SamplingSpec, SubmitReply, SubmitRequest, TokenChunk
from nitsum_services.gateway.generation import Generation, GenerationRegistry


async def test_late_frames_of_an_earlier_attempt_are_not_a_gap(nats_server):
    cfg = CommonConfig(nats_url=nats_server.url)
    coordinator = await Bus.connect(cfg, "coordinator")
    gateway = await Bus.connect(cfg, "gateway")
    worker = await Bus.connect(cfg, "worker")
    attempts: list[int] = []

    async def on_submit(req: SubmitRequest, _delivery):  # one worker: every attempt lands on w0
        attempts.append(req.attempt)
        return SubmitReply(req.request_id, True, worker_id="w0")

    try:
        await coordinator.subscribe(coordinator.subjects.submit, on_submit, expected=SubmitRequest, concurrent=True)
        await coordinator.flush()
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
