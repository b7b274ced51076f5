"""`nitsum serve coordinator`: membership, admission, routing, policy epochs, worker-loss handling, node
world re-formation, admin.

Owns no GPU and no durable state: on start it asks every worker for fresh stats (`coordinator_up`) and
rebuilds its tables from them, so streams in flight keep going across a coordinator restart.
"""

from __future__ import annotations

import asyncio
import logging

from nitsum.config import ConfigError, CoordinatorConfig
from nitsum.policy.registry import make_policy
from nitsum.service import ServiceContext, run_service
from nitsum.wire.messages import SubmitRequest, WorkerStats
from nitsum_services.coordinator.admin import AdminPlane
from nitsum_services.coordinator.core import Coordinator, policy_config
from nitsum_services.coordinator.steps import StepTableError, step_table_for

log = logging.getLogger("nitsum.coordinator")
STOP_LOOPS_TIMEOUT_S = 2.0


async def body(ctx: ServiceContext) -> None:
    try:
        config = policy_config(ctx.config)
    except StepTableError as exc:
        raise ConfigError(f"NITSUM_DEVICE_TABLE={ctx.config.device_table!r}: {exc}") from None
    log.info("step times: %s", step_table_for(ctx.config.device_table, ctx.config.device_kind, config.model)[1])
    try:
        make_policy(ctx.config.policy, config)
    except ValueError as exc:
        raise ConfigError(f"NITSUM_POLICY={ctx.config.policy!r}: {exc}") from None
    coordinator = Coordinator(ctx)
    bus = ctx.bus
    admin = AdminPlane(coordinator)
    await bus.subscribe(
        bus.subjects.submit, coordinator.on_submit, queue="coordinator", expected=SubmitRequest, concurrent=True
    )
    await bus.subscribe(bus.subjects.worker_stats, coordinator.on_stats, expected=WorkerStats)
    await admin.subscribe()
    # Ask every worker for its state now, so that a restarted coordinator rebuilds its tables at once.
    await bus.publish_raw(bus.subjects.coordinator_up, b"")
    tasks = {
        ctx.spawn(coordinator.watch(), "membership"),
        ctx.spawn(coordinator.epochs(), "policy epoch"),
        ctx.spawn(coordinator.reforms.run(ctx.stop), "node re-formation"),
    }

    async def stop_loops() -> None:
        _done, pending = await asyncio.wait(tasks, timeout=STOP_LOOPS_TIMEOUT_S)
        for task in pending:  # a loop that does not watch ctx.stop: a bug, said out loud
            log.warning(
                "coordinator: %s did not stop within %.0f s of the stop; cancelled",
                task.get_coro().__qualname__,
                STOP_LOOPS_TIMEOUT_S,
            )
            task.cancel()

    ctx.drain_hooks.append(stop_loops)


def main(argv: list[str]) -> int:
    return run_service("coordinator", CoordinatorConfig, argv[1:] if argv[:1] == ["coordinator"] else argv, body)
