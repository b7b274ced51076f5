"""One lifecycle for every nitsum service.

config (env + CLI, bad value → exit 2 naming the setting)
→ exit stack: telemetry, bus, /metrics, the service's core
→ serve until SIGTERM / SIGINT
→ drain (the core finishes or hands off its work), close the stack in reverse order.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from nitsum.bus import Bus, BusError
from nitsum.config import CommonConfig, ConfigError, load
from nitsum.cpus import parse_cpu_list, pin_process
from nitsum.httpauth import auth_middleware
from nitsum.telemetry.metrics import Metrics
from nitsum.telemetry.tracing import setup_tracing, shutdown_tracing, tracer

log = logging.getLogger("nitsum.service")


@dataclass
class ServiceContext:
    name: str
    config: Any
    metrics: Metrics
    stack: AsyncExitStack
    stop: asyncio.Event
    bus: Bus | None = None
    drain_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    state: dict = field(default_factory=dict)  # facts the service hands back to its main() after the run

    @property
    def tracer(self):
        return tracer(f"nitsum.{self.name}")

    def spawn(self, coro: Awaitable[None], what: str) -> asyncio.Task:
        """Run one of the service's standing loops. A loop that ends with an exception before the stop is a
        bug that would leave the service up but crippled (heartbeats going out, nothing decided or served):
        the service logs it and stops with exit code 1, so its supervisor (`nitsum up`, Docker's restart
        policy) starts it again."""
        task = asyncio.ensure_future(coro)

        def done(t: asyncio.Task) -> None:
            if t.cancelled():
                return
            exc = t.exception()  # (fetched in every case: no "exception was never retrieved" at exit)
            if self.stop.is_set():
                return
            if exc is None:  # a standing loop ends only at the stop
                log.critical("%s: its %s loop ended before the stop; stopping so that it is restarted", self.name, what)
            else:
                log.critical(
                    "%s: its %s loop died (%s: %s); stopping so that it is restarted",
                    self.name,
                    what,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
            self.state["loop_failed"] = what
            self.stop.set()

        task.add_done_callback(done)
        return task


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def serve_metrics(ctx: ServiceContext, port: int, host: str = "0.0.0.0") -> web.AppRunner | None:
    """/metrics and /health on their own port for services that have no HTTP API."""
    if port <= 0:
        return None
    keys = ctx.config.resolved_api_keys()
    app = web.Application(middlewares=[auth_middleware(keys)])

    async def metrics(_request: web.Request) -> web.Response:
        body, content_type = ctx.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "service": ctx.name})

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    ctx.stack.push_async_callback(runner.cleanup)
    return runner


def run_service(
    name: str,
    config_cls: type,
    argv: list[str],
    body: Callable[[ServiceContext], Awaitable[None]],
    *,
    needs_bus: bool = True,
    metrics_port: Callable[[Any], int] | None = None,
    state: dict | None = None,
) -> int:
    """Parse config, then run `body(ctx)` (which registers its work) until a stop signal; return an exit code."""
    try:
        config = load(config_cls, argv, prog=f"nitsum serve {name}")
        if isinstance(config, CommonConfig):
            config.resolved_api_keys()
    except ConfigError as exc:
        sys.stderr.write(f"nitsum {name}: configuration error: {exc}\n")
        return 2
    if isinstance(config, CommonConfig) and config.cpus:
        try:
            pin_process(parse_cpu_list(config.cpus))
        except ValueError as exc:
            sys.stderr.write(f"nitsum {name}: configuration error: NITSUM_CPUS={config.cpus!r}: {exc}\n")
            return 2
    configure_logging(config.log_level, name)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is a dependency; plain asyncio still works without it
        pass
    return asyncio.run(_main(name, config, body, needs_bus, metrics_port, {} if state is None else state))


async def _main(name, config, body, needs_bus, metrics_port, state) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    run_dir = config.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_tracing(name, run_dir, instance=f"{name}-{os.getpid()}")
    metrics = Metrics(name)
    # Counted when /metrics is scraped (on this loop's thread: the services serve /metrics from aiohttp), so a
    # leak of tasks shows as growth over time without a sampling task of its own.
    metrics.asyncio_tasks().set_function(lambda: len(asyncio.all_tasks(loop)))
    async with AsyncExitStack() as stack:
        ctx = ServiceContext(name=name, config=config, metrics=metrics, stack=stack, stop=stop, state=state)
        stack.callback(shutdown_tracing)
        try:
            if needs_bus:
                ctx.bus = await Bus.connect(config, name=name, metrics=metrics)
                stack.push_async_callback(ctx.bus.drain)
            port = metrics_port(config) if metrics_port else config.metrics_port
            await serve_metrics(ctx, port)
            await body(ctx)
        except (BusError, ConfigError, OSError) as exc:
            log.error("%s could not start: %s", name, exc)
            return 1
        # What the start made (imports, clients, tables: ~50k objects even without torch) lives as long as the
        # process: out of the cyclic collector's sight from now on. A full collection over it is 15 ms or more,
        # a stall of this service whenever the long-lived threshold trips -- in the coordinator, between a TP
        # change's prepare and commit; in the gateway, in every stream it serves.
        gc.collect()
        gc.freeze()
        log.info("%s running (pid %d)", name, os.getpid())
        await stop.wait()
        log.info("%s stopping: draining", name)
        for hook in ctx.drain_hooks:
            try:
                await hook()
            except Exception:  # one failed hook must not keep the others from running
                log.exception("%s: drain hook failed", name)
    if state.get("loop_failed"):
        log.error("%s stopped: its %s loop had died", name, state["loop_failed"])
        return 1
    log.info("%s stopped", name)
    return 0
