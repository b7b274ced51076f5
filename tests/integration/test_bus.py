"""The bus against a real nats-server: request/reply, queue groups, trace headers, bad frames, reconnect."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace

from nitsum.bus import Bus, BusTimeout, NoResponders, RemoteError
from nitsum.config import CommonConfig
from nitsum.natsserver import NatsServer
from nitsum.telemetry.metrics import Metrics
from nitsum.wire.messages import AbortRequest, ErrorReply, RunAck
from tests.integration.interest import until_answered


def _config(url: str) -> CommonConfig:
    return CommonConfig(nats_url=url)


async def _until_answered(bus: Bus, subject: str) -> None:
    await until_answered(bus, subject, AbortRequest("probe"))


async def test_request_reply_and_errors(nats_server):
    a = await Bus.connect(_config(nats_server.url), "a")
    b = await Bus.connect(_config(nats_server.url), "b", metrics=Metrics("b"))
    try:

        async def answer(msg: AbortRequest, _d):
            if msg.request_id == "boom":
                raise RuntimeError("handler bug")
            if msg.request_id == "refuse":
                return ErrorReply("nope", "refused on purpose")
            return RunAck(msg.request_id, "w1", True)

        await b.subscribe("t.req", answer, expected=AbortRequest, concurrent=True)
        await b.flush()
        await _until_answered(a, "t.req")
        ack = await a.request("t.req", AbortRequest("r1"), 2.0, expected=RunAck)
        assert ack == RunAck("r1", "w1", True)
        with pytest.raises(RemoteError) as info:
            await a.request("t.req", AbortRequest("refuse"), 2.0)
        assert info.value.code == "nope"
        with pytest.raises(RemoteError) as info:
            await a.request("t.req", AbortRequest("boom"), 2.0)
        assert info.value.code == "internal" and "handler bug" in str(info.value)
        # a frame that is not a message is answered with a coded error and counted
        msg = await a.nc.request("t.req", b"\x00garbage", timeout=2.0)
        from nitsum.wire import decode

        reply = decode(msg.data)
        assert isinstance(reply, ErrorReply) and reply.code == "bad_frame"
        rendered = b.metrics.render()[0].decode()
        assert 'nitsum_dropped_frames_total{code="malformed",subject="t.req"} 1.0' in rendered
        with pytest.raises(NoResponders):
            await a.request("t.nobody", AbortRequest("x"), 0.5)
    finally:
        await a.drain()
        await b.drain()


async def test_timeout_is_typed(nats_server):
    a = await Bus.connect(_config(nats_server.url), "a")
    try:

        async def slow(_m, _d):
            await asyncio.sleep(1.0)

        await a.subscribe("t.slow", slow, concurrent=True)
        with pytest.raises(BusTimeout):
            await a.request("t.slow", AbortRequest("x"), 0.2)
    finally:
        await a.drain()


async def test_queue_group_spreads_work(nats_server):
    sender = await Bus.connect(_config(nats_server.url), "s")
    workers = [await Bus.connect(_config(nats_server.url), f"w{i}") for i in range(2)]
    seen = {0: 0, 1: 0}
    try:
        for i, w in enumerate(workers):

            async def handler(msg, _d, i=i):
                seen[i] += 1
                return RunAck(msg.request_id, f"w{i}", True)

            await w.subscribe("t.pool", handler, queue="pool")
            await w.flush()
        answers = [await sender.request("t.pool", AbortRequest(str(n)), 2.0) for n in range(40)]
        assert len(answers) == 40
        assert seen[0] + seen[1] == 40  # each request handled exactly once
        assert seen[0] > 0 and seen[1] > 0
    finally:
        for bus in [sender, *workers]:
            await bus.drain()


async def test_trace_context_rides_in_headers(nats_server):
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    a = await Bus.connect(_config(nats_server.url), "a")
    b = await Bus.connect(_config(nats_server.url), "b")
    got = asyncio.get_running_loop().create_future()
    try:

        async def handler(msg, delivery):
            got.set_result(
                (delivery.headers.get("traceparent", ""), trace.get_current_span().get_span_context().trace_id)
            )

        await b.subscribe("t.trace", handler)
        await b.flush()
        with tracer.start_as_current_span("root") as span:
            await a.publish("t.trace", AbortRequest("x"))
            trace_id = span.get_span_context().trace_id
        # The server has it (a PING after it came back): in two fresh-clone runs out of many, the message had not
        # arrived 2 s, then 20 s later, with the server and both connections up and nothing logged -- what this
        # test checks is the trace context, so it makes sure the frame left the publisher's buffer.
        await a.flush()
        header, remote_trace_id = await asyncio.wait_for(got, 20.0)  # a hang guard
        assert header.split("-")[1] == format(trace_id, "032x")
        assert remote_trace_id == trace_id
    finally:
        await a.drain()
        await b.drain()


async def test_reconnects_after_server_restart(tmp_path):
    from nitsum.natsserver import free_port

    port = free_port()
    server = NatsServer(port=port, config_path=None).start()
    a = await Bus.connect(_config(server.url), "a")
    b = await Bus.connect(_config(server.url), "b")
    try:

        async def echo(msg, _d):
            return RunAck(msg.request_id, "b", True)

        await b.subscribe("t.echo", echo)
        await b.flush()
        await _until_answered(a, "t.echo")  # the same no-responders race, seen here once in CI
        assert (await a.request("t.echo", AbortRequest("1"), 2.0)).accepted
        server.stop()
        await asyncio.sleep(0.3)
        server = NatsServer(port=port, config_path=None).start()
        deadline = asyncio.get_running_loop().time() + 10.0
        while True:
            try:
                ack = await a.request("t.echo", AbortRequest("2"), 0.5)
                break
            except (BusTimeout, NoResponders, Exception):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert ack.request_id == "2"
        assert a.reconnects >= 1 and b.reconnects >= 1
    finally:
        await a.drain()
        await b.drain()
        server.stop()


async def test_round_trip_hears_what_came_before_and_survives_a_stalled_server(nats_server):
    """`round_trip` returns only once the messages sent before it were handled; one that times out while the
    server is stopped leaves the connection reading (nats-py's own flush would kill its reader on the late PONG)."""
    import signal

    a = await Bus.connect(_config(nats_server.url), "a")
    b = await Bus.connect(_config(nats_server.url), "b")
    seen: list[str] = []
    try:

        async def record(msg: AbortRequest, _d):
            seen.append(msg.request_id)

        await b.subscribe("t.beats", record, expected=AbortRequest)
        await b.round_trip(2.0)  # b's subscription is known to the server
        for i in range(20):
            await a.publish("t.beats", AbortRequest(f"r{i}"))
        await a.round_trip(2.0)  # the server has a's messages ...
        await b.round_trip(2.0)  # ... and b has handled every one the server routed to it before the echo
        assert seen == [f"r{i}" for i in range(20)]

        nats_server.process.send_signal(signal.SIGSTOP)
        try:
            _until_stopped(nats_server.process.pid)
            with pytest.raises(BusTimeout):
                await b.round_trip(0.3)
        finally:
            nats_server.process.send_signal(signal.SIGCONT)
        await b.round_trip(2.0)
        await a.publish("t.beats", AbortRequest("after"))
        await a.round_trip(2.0)
        await b.round_trip(2.0)
        assert seen[-1] == "after"
    finally:
        await a.drain()
        await b.drain()


def _until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP takes a moment to stop every thread of a process (the server may still answer meanwhile)."""
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue
        if states and all(s in "Tt" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.01)
