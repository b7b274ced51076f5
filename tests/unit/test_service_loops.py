"""A service's standing loops are supervised: one that dies before the stop stops the service with exit 1 (so
`nitsum up` or Docker restarts it) instead of leaving it up and crippled; loops that end at the stop are fine."""

from __future__ import annotations

import asyncio

from nitsum.config import FlowSchedulerConfig
from nitsum.service import ServiceContext, run_service


def _run(monkeypatch, tmp_path, body) -> int:
    policy = asyncio.get_event_loop_policy()  # run_service installs uvloop's policy: the other tests keep theirs
    try:
        return _run_service(monkeypatch, tmp_path, body)
    finally:
        asyncio.set_event_loop_policy(policy)


def _run_service(monkeypatch, tmp_path, body) -> int:
    monkeypatch.setenv("NITSUM_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("NITSUM_METRICS_PORT", "0")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    return run_service("loop-test", FlowSchedulerConfig, [], body, needs_bus=False)


def test_a_loop_that_dies_stops_the_service_with_exit_1(monkeypatch, tmp_path, caplog):
    async def body(ctx: ServiceContext) -> None:
        async def broken() -> None:
            await asyncio.sleep(0.05)
            raise ValueError("policy bug")

        ctx.spawn(broken(), "policy epoch")

    assert _run(monkeypatch, tmp_path, body) == 1
    assert any("policy epoch loop died (ValueError: policy bug)" in r.getMessage() for r in caplog.records)


def test_loops_that_end_at_the_stop_exit_0(monkeypatch, tmp_path):
    async def body(ctx: ServiceContext) -> None:
        async def loop() -> None:
            await ctx.stop.wait()
            raise RuntimeError("raised while stopping: not a crash")

        ctx.spawn(loop(), "tick")
        asyncio.get_running_loop().call_later(0.05, ctx.stop.set)

    assert (
        _run(monkeypatch, tmp_path, body) == 0
    )  # (beside the tests above: the same loop, raising before the stop, exits 1)


def test_a_loop_that_returns_before_the_stop_stops_the_service_too(monkeypatch, tmp_path, caplog):
    async def body(ctx: ServiceContext) -> None:
        async def quits() -> None:
            await asyncio.sleep(0.05)

        ctx.spawn(quits(), "heartbeat")

    assert _run(monkeypatch, tmp_path, body) == 1
    assert any("heartbeat loop ended before the stop" in r.getMessage() for r in caplog.records)


def test_a_started_service_keeps_what_it_made_out_of_the_cyclic_collector(monkeypatch, tmp_path):
    """After the start, the objects made so far are frozen (gc.freeze): a full collection no longer walks them."""
    import gc

    seen = {}

    async def body(ctx: ServiceContext) -> None:
        seen["before"] = gc.get_freeze_count()

        async def look() -> None:
            await asyncio.sleep(0.05)
            seen["after"] = gc.get_freeze_count()
            ctx.stop.set()

        ctx.spawn(look(), "look")

    try:
        assert _run(monkeypatch, tmp_path, body) == 0
    finally:
        gc.unfreeze()  # the rest of the test session gets its collector back
    assert seen["after"] > seen["before"]
