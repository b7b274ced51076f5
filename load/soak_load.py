"""The soak benchmark's load: Poisson requests, the open-loop dispatch that keeps each request's end time,
and the capacity ramp."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nitsum.metrics import summarize
from nitsum_load.client import ClientConfig, RequestSpec, RequestTracker, send
from nitsum_load.runner import run_open_loop
from nitsum_load.workload import Shaping, shape, synthetic


async def fire_timed(
    specs: Sequence[RequestSpec],
    cfg: ClientConfig,
    t0: float,
    drain_timeout_s: float,
) -> list[tuple[RequestTracker, float | None]]:
    """Open-loop dispatch like `run_open_loop`, but every request's end time is kept: a RequestTracker has no
    time for an error, and the soak must place each failure inside or outside the fault windows."""
    import aiohttp

    loop = asyncio.get_running_loop()

    def clock() -> float:
        return (loop.time() - t0) * 1000.0

    rows: list[list[Any]] = []

    async def one(row: list[Any], index: int) -> None:
        await send(session, cfg, row[0], clock, seed_index=index)
        row[1] = clock()

    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            for index, spec in enumerate(sorted(specs, key=lambda s: s.arrival_ms)):
                delay_s = spec.arrival_ms / 1000.0 - (loop.time() - t0)
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                row = [RequestTracker(spec), None]
                rows.append(row)
                tasks.append(asyncio.create_task(one(row, index), name=spec.request_id))
            pending = [t for t in tasks if not t.done()]
            if pending:
                await asyncio.wait(pending, timeout=drain_timeout_s)
        finally:
            for t in tasks:
                t.cancel()  # what is still running now is lost; its tracker keeps what was seen
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r
    return [(row[0], row[1]) for row in rows]


def poisson_specs(
    rate_per_s: float, duration_s: float, prompt_tokens: int, output_tokens: int, seed: int
) -> list[RequestSpec]:
    reqs = synthetic(
        "poisson",
        rate_per_s,
        num_requests=None,
        duration_s=duration_s,
        seed=seed,
        lengths=None,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
    )
    return shape(reqs, Shaping(seed=seed))


@dataclass(frozen=True)
class RampStep:
    rate_per_s: float
    sent: int
    completed: int
    failed: int
    ttft_p90_ms: float | None
    sustained: bool


async def measure_capacity(cfg: ClientConfig, args: argparse.Namespace) -> tuple[float, list[RampStep]]:
    """Poisson steps at rising rates (x1.5) until one is not sustained: an error, a request not done within
    2 s of the step's end, or TTFT p90 above --ramp-ttft-ms (a queue is building). Capacity = the last
    sustained rate."""
    steps: list[RampStep] = []
    rate = args.ramp_start_rate
    for i in range(args.ramp_max_steps):
        specs = poisson_specs(rate, args.ramp_step_s, args.prompt_tokens, args.output_tokens, seed=args.seed + 1 + i)
        result = await run_open_loop(specs, cfg, duration_s=args.ramp_step_s, drain_timeout_s=2.0)
        report = summarize([t.to_record() for t in result.trackers]).overall
        p90 = report.ttft_ms.p90
        ok = (
            report.failed == 0
            and report.succeeded == len(result.trackers)
            and p90 is not None
            and p90 <= args.ramp_ttft_ms
        )
        steps.append(RampStep(rate, len(result.trackers), report.succeeded, report.failed, p90, ok))
        print(
            f"  ramp {rate:7.2f} req/s: {report.succeeded}/{len(result.trackers)} done, "
            f"TTFT p90 {'-' if p90 is None else f'{p90:.0f}'} ms -> {'sustained' if ok else 'not sustained'}",
            flush=True,
        )
        if not ok:
            break
        rate *= 1.5
        await asyncio.sleep(2.0)  # let any tail finish before the next step
    sustained = [s.rate_per_s for s in steps if s.sustained]
    if steps[-1].sustained:
        print(
            f"  the ramp ran out of steps before overload: capacity is at least {steps[-1].rate_per_s:.2f} req/s "
            "(raise --ramp-max-steps to find it)",
            flush=True,
        )
    return (max(sustained) if sustained else steps[0].rate_per_s / 1.5), steps
