"""Batched token frames (issue 23) on a real nats-server with per-worker identities: a worker's FramePublisher
sends one TokenBatch per step for every request of a gateway; that gateway's FrameDispatcher hands each chunk to
its request's Generation, which checks it exactly as a chunk on the request's own stream subject."""

from __future__ import annotations

import asyncio

import pytest

from nitsum.bus import Bus
from nitsum.config import CommonConfig
from nitsum.natsserver import NatsServer, free_port, new_passwords, render_config, worker_identity, write_secure
from nitsum.wire.messages import SamplingSpec, SubmitReply, SubmitRequest, TokenBatch, TokenChunk
from nitsum_services.gateway.frames import FrameDispatcher
from nitsum_services.gateway.generation import Generation, GenerationRegistry
from nitsum_services.worker.publisher import FramePublisher
from tests.integration.interest import until_answered

PLACED, OTHER = "n1-0", "n2-0"
GATEWAY_ID = "gw-test"


@pytest.fixture
def worker_nats(tmp_path):
    port = free_port()
    passwords = new_passwords((PLACED, OTHER))
    config = tmp_path / "nats.conf"
    write_secure(config, render_config(port, passwords, worker_ids=(PLACED, OTHER)))
    server = NatsServer(port=port, config_path=config).start(log_path=tmp_path / "nats.log")
    yield server, passwords
    server.stop()


def _request(rid: str, subject: str) -> SubmitRequest:
    return SubmitRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=3), "interactive", 200.0, 25.0, 10.0, 0.0, subject)


def _chunk(rid, index, tokens, worker=PLACED, attempt=0, finished=False):
    return TokenChunk(
        rid,
        worker,
        index,
        tokens,
        "x" * len(tokens),
        finished=finished,
        finish_reason="length" if finished else "",
        num_prompt_tokens=3,
        num_cached_prompt_tokens=2,
        attempt=attempt,
    )


async def test_one_frame_per_step_reaches_every_request_of_the_gateway(worker_nats):
    server, passwords = worker_nats

    def config(user: str) -> CommonConfig:
        return CommonConfig(nats_url=server.url, nats_user=user, nats_password=passwords[user])

    async def on_submit(req: SubmitRequest, _delivery):
        return SubmitReply(req.request_id, True, worker_id=PLACED)

    coordinator = await Bus.connect(config("coordinator"), "coordinator")
    gateway = await Bus.connect(config("gateway"), "gateway")
    worker = await Bus.connect(config(worker_identity(PLACED)), "worker")
    other = await Bus.connect(config(worker_identity(OTHER)), "other")
    dropped: list[str] = []
    try:
        await coordinator.subscribe(coordinator.subjects.submit, on_submit, expected=SubmitRequest, concurrent=True)
        await coordinator.flush()
        # The no-responders race of test_bus.py, seen here once in CI: the first submit right after the flush.
        await until_answered(
            gateway, gateway.subjects.submit, _request("probe", gateway.subjects.gateway_frames(GATEWAY_ID))
        )
        registry = GenerationRegistry()
        dispatcher = FrameDispatcher(gateway, registry, GATEWAY_ID, dropped.append)
        await dispatcher.start()
        frames = gateway.subjects.gateway_frames(GATEWAY_ID)
        gens = [Generation(gateway, _request(rid, frames), 10.0, 0, 5.0, registry) for rid in ("cmpl-a", "cmpl-b")]
        for gen in gens:
            gen.on_foreign_frame = dropped.append
            await gen.start()
        await gateway.flush()
        # The worker sends under its own id to the subject the request named.
        subject = worker.subjects.gateway_frames(worker.subjects.frames_gateway(gens[0].request.stream_subject), PLACED)
        publisher = FramePublisher(worker, PLACED)
        # Another worker: a batch under its own id claiming the placed worker is dropped; the placed worker's
        # frames subject is refused to it by NATS.
        forged = TokenBatch(PLACED, (_chunk("cmpl-a", 0, (66,), worker=PLACED),))
        await other.publish(other.subjects.gateway_frames(GATEWAY_ID, OTHER), forged)
        await other.nc.publish(subject, b"x")
        await other.flush()
        await asyncio.sleep(0.3)
        # Step 1: both requests' first tokens, queued without awaiting NATS -> one frame.
        publisher.send(subject, _chunk("cmpl-a", 0, (7,)))
        publisher.send(subject, _chunk("cmpl-b", 0, (17,)))
        await publisher.flush()
        streams = [gen.deltas() for gen in gens]
        assert [(await anext(s)).token_ids for s in streams] == [[7], [17]]
        assert publisher.frames_sent == 1 and dispatcher.batches == 2  # the forged one and step 1
        # Step 2 and 3 in one flush (the publisher fell behind): a's chunks keep their order; a late chunk of
        # an earlier attempt is ignored; b ends.
        publisher.send(subject, _chunk("cmpl-a", 1, (8,)))
        publisher.send(subject, _chunk("cmpl-b", 1, (99,), attempt=-1))  # attempt not known (an adopted stream): taken
        publisher.send(subject, _chunk("cmpl-b", 2, (98,), attempt=3))  # an older/other attempt: ignored
        publisher.send(subject, _chunk("cmpl-a", 2, (9,), finished=True))
        publisher.send(subject, _chunk("cmpl-b", 2, (18,), finished=True))
        await publisher.close()
        rest_a = [d async for d in streams[0]]
        rest_b = [d async for d in streams[1]]
        assert [t for d in rest_a for t in d.token_ids] == [8, 9]
        assert [t for d in rest_b for t in d.token_ids] == [99, 18]
        assert gens[0].finish_reason == "length" and gens[0].num_cached_prompt_tokens == 2
        assert dropped == [OTHER]  # the forged batch's claimed sender does not match its subject's worker
        for gen in gens:
            await gen.close()
        assert publisher.frames_sent == 2
    finally:
        for bus in (coordinator, gateway, worker, other):
            await bus.drain()


async def test_a_request_on_its_own_stream_subject_still_gets_single_frames(nats_server):
    """A per-request stream subject (a stream adopted in a TP change, an older gateway): chunks go one by one."""
    cfg = CommonConfig(nats_url=nats_server.url)
    bus = await Bus.connect(cfg, "worker")
    got: list[TokenChunk] = []

    async def on_chunk(chunk: TokenChunk, _delivery) -> None:
        got.append(chunk)

    try:
        await bus.subscribe(bus.subjects.stream("cmpl-x"), on_chunk, expected=TokenChunk)
        await bus.flush()
        publisher = FramePublisher(bus, "w0")
        for i in range(3):
            publisher.send(bus.subjects.stream("cmpl-x", "w0"), _chunk("cmpl-x", i, (i,), worker="w0"))
        await publisher.close()
        await bus.round_trip(2.0)
        assert [c.index for c in got] == [0, 1, 2] and publisher.frames_sent == 3
    finally:
        await bus.drain()
