"""Two ends of a token stream over the real nitsum Bus, for the NATS cluster failover tests.

`publish`: a worker identity publishes TokenChunk frames 0..N-1 to one request's stream subject, one every
`interval_s`, and says (on stdout, as JSON lines) where it is connected, when it reaches `mark`, and at the
end which frames it published while it knew its server was gone. `collect`: a gateway identity receives them.
Run in-process (loopback) or as `python tests/net/stream_peer.py ...` inside a network namespace (the connection
from NITSUM_NATS_URL, NITSUM_NATS_USER, NITSUM_NATS_PASSWORD).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from nitsum.bus import Bus
from nitsum.config import CommonConfig, load
from nitsum.wire.messages import TokenChunk

REQUEST_ID = "r-failover"
PROBE = "probe"


def config(url: str, user: str, password: str) -> CommonConfig:
    return CommonConfig(nats_url=url, nats_user=user, nats_password=password, metrics_port=0)


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def publish(bus: Bus, count: int, interval_s: float, mark: int, on_mark=None) -> dict:
    """Publish; returns {published_blind: frames published after the loss was noticed, before the reconnect}."""
    subject = bus.subjects.stream(REQUEST_ID)
    first_server = bus.server
    noticed: list[int] = []  # frames published while the bus knew it had no server (buffered for the next one)
    first_after_notice = -1
    for i in range(count):
        if i == mark:
            await bus.flush(5.0)  # frames before the mark have reached the server (a loaded machine may lag)
            say(event="mark", index=i, server=bus.server)
            if on_mark is not None:
                on_mark()
        if bus.disconnects and first_after_notice < 0:
            first_after_notice = i
        if not bus.connected:
            noticed.append(i)
        await bus.publish(subject, TokenChunk(REQUEST_ID, "w0", i, (i,), finished=i == count - 1))
        await asyncio.sleep(interval_s)
    deadline = time.monotonic() + 20
    while not bus.connected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await bus.flush(5.0)
    return {
        "first_server": first_server,
        "server": bus.server,
        "reconnects": bus.reconnects,
        "disconnects": bus.disconnects,
        "published_disconnected": noticed,
        "first_after_notice": first_after_notice,
    }


async def collect(bus: Bus, count: int, timeout_s: float, ready=None) -> list[int]:
    got: list[int] = []
    done = asyncio.Event()

    probed = False

    async def on_chunk(chunk: TokenChunk, _delivery) -> None:
        nonlocal probed
        if chunk.text == PROBE:  # the publisher's "can you hear me" before the stream (see _main)
            if not probed:
                probed = True
                say(event="probed")
            return
        got.append(chunk.index)
        if chunk.finished:
            done.set()

    await bus.subscribe(bus.subjects.stream(REQUEST_ID), on_chunk, expected=TokenChunk)
    await bus.flush(5.0)  # the server has the subscription
    if ready is not None:
        ready()
    try:
        await asyncio.wait_for(done.wait(), timeout=timeout_s)
    except TimeoutError:
        pass
    await asyncio.sleep(0.3)  # frames after a lost "finished" one would still come in
    return got


async def _main(args) -> None:
    bus = await Bus.connect(load(CommonConfig, [], None), args.role)  # NITSUM_NATS_URL/USER/PASSWORD
    try:
        if args.role == "publish":
            say(event="connected", server=bus.server)
            # Probe frames until told to go: the test says go once the collector heard one, so the collector's
            # interest has crossed the cluster route (a fixed sleep was not always enough on a loaded machine).
            go = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            while not go.done():
                await bus.publish(bus.subjects.stream(REQUEST_ID), TokenChunk(REQUEST_ID, "w0", 0, (), PROBE))
                await asyncio.wait([go], timeout=0.05)
            say(event="done", **(await publish(bus, args.count, args.interval, args.mark)))
        else:
            got = await collect(bus, args.count, args.timeout, ready=lambda: say(event="ready", server=bus.server))
            say(event="done", got=got, server=bus.server, reconnects=bus.reconnects)
    finally:
        await bus.drain(2.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("publish", "collect"))
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--interval", type=float, default=0.01)
    p.add_argument("--mark", type=int, default=50)
    p.add_argument("--timeout", type=float, default=30.0)
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
