"""Open-loop runner: fires each request at its arrival time, whatever the earlier ones are doing.

Bounded three ways: the request list (already cut to --max-requests), `duration_s` (no arrival at or after
it is sent) and `drain_timeout_s` (how long in-flight requests may run after the last arrival). A `stop`
event (Ctrl-C) ends the run early; requests still running then are cancelled and reported as unfinished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from nitsum_load.client import ClientConfig, RequestSpec, RequestTracker, send


@dataclass
class Counters:
    """Live totals for the progress bar (mutated only by the runner's tasks, on one event loop)."""

    planned: int = 0
    sent: int = 0
    in_flight: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    duration_s: float | None = None


@dataclass(frozen=True)
class RunResult:
    trackers: list[RequestTracker]  # in arrival order; only requests that were dispatched or due
    elapsed_s: float
    interrupted: bool  # stopped by the stop event rather than by running out of requests / time


async def run_open_loop(
    specs: Sequence[RequestSpec],
    cfg: ClientConfig,
    *,
    duration_s: float | None = None,
    concurrency_limit: int | None = None,
    drain_timeout_s: float = 60.0,
    stop: asyncio.Event | None = None,
    counters: Counters | None = None,
) -> RunResult:
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return (loop.time() - t0) * 1000.0

    ordered = sorted(specs, key=lambda s: s.arrival_ms)
    if duration_s is not None:
        ordered = [s for s in ordered if s.arrival_ms < duration_s * 1000.0]
    c = counters if counters is not None else Counters()
    c.planned, c.duration_s = len(ordered), duration_s
    stop = stop if stop is not None else asyncio.Event()
    gate = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
    trackers: list[RequestTracker] = []
    tasks: list[asyncio.Task[None]] = []

    async def one(tracker: RequestTracker, index: int) -> None:
        if gate is not None:
            async with gate:
                await _tracked(tracker, index)
        else:
            await _tracked(tracker, index)

    async def _tracked(tracker: RequestTracker, index: int) -> None:
        c.in_flight += 1
        try:
            await send(session, cfg, tracker, clock, seed_index=index)
        finally:
            c.in_flight -= 1
            c.done += 1
            c.failed += tracker.error is not None
            c.tokens += len(tracker.token_times_ms)

    # limit=0: the connector does not queue requests behind a pool limit (the semaphore is the only gate).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            for index, spec in enumerate(ordered):
                delay_s = spec.arrival_ms / 1000.0 - (loop.time() - t0)
                if delay_s > 0:
                    await asyncio.wait({stop_wait}, timeout=delay_s)
                if stop.is_set():
                    break
                tracker = RequestTracker(spec)
                trackers.append(tracker)
                tasks.append(asyncio.create_task(one(tracker, index), name=spec.request_id))
                c.sent += 1
                c.elapsed_s = loop.time() - t0
            # Drain: wake on every finished request or on stop, until none is left or the budget is spent.
            deadline = loop.time() + drain_timeout_s
            while not stop.is_set():
                pending = {t for t in tasks if not t.done()}
                left = deadline - loop.time()
                if not pending or left <= 0:
                    break
                await asyncio.wait(pending | {stop_wait}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            for t in tasks:
                if not t.done():
                    t.cancel()
            # Cancelled requests keep their trackers; a cancelled task's CancelledError is expected here.
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r
    c.elapsed_s = loop.time() - t0
    return RunResult(trackers=trackers, elapsed_s=c.elapsed_s, interrupted=stop.is_set())
