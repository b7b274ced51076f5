"""`nitsum serve prefill-worker|decode-worker`: one engine per device, driven over NATS.

Subscriptions: `worker.<id>.run` (RunRequest → RunAck), the abort broadcast, `coordinator_up` (answer with
fresh stats at once). Heartbeats: WorkerStats every NITSUM_HEARTBEAT_INTERVAL_MS. SIGTERM: report
`draining` (no new work is routed here), let running requests finish, hand the rest back, exit.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import torch

from nitsum.config import WorkerConfig
from nitsum.modelpath import resolve_model_dir
from nitsum.service import ServiceContext, run_service
from nitsum.wire.messages import AbortRequest, RunAck, RunRequest, WorkerStats
from nitsum_services.worker.session import WorkerSession

log = logging.getLogger("nitsum.worker")

DRAIN_TIMEOUT_S = 30.0


def build_engine(config: WorkerConfig, role: str):
    from nitsum.engine import Engine, EngineConfig

    torch.set_num_threads(config.torch_threads)
    model_dir = resolve_model_dir(config.model)
    return Engine(
        EngineConfig(
            model_dir=str(model_dir),
            device=config.device if config.device == "cpu" else f"cuda:{config.device_index}",
            dtype=config.dtype,
            block_size=config.block_size,
            kv_cache_mb=config.kv_cache_mb,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            role=role,
        )
    )


def make_body(service_name: str):
    async def body(ctx: ServiceContext) -> None:
        config: WorkerConfig = ctx.config
        role = config.role or ("prefill" if service_name == "prefill-worker" else "decode")
        # On CPU one worker process stands for one device; a lone worker serves whole requests (hybrid).
        engine_role = "hybrid"
        worker_id = config.resolved_worker_id()
        instance_id = uuid.uuid4().hex[:12]
        engine = await asyncio.to_thread(build_engine, config, engine_role)
        bus = ctx.bus
        session = WorkerSession(engine, bus, worker_id, ctx.metrics, ctx.tracer)
        state = {"value": "ready"}
        ctx.metrics.current_tp_level().labels(worker=worker_id).set(1)

        def stats_message() -> WorkerStats:
            s = session.stats()
            return WorkerStats(
                worker_id=worker_id,
                node_id=config.node_id,
                device_index=config.device_index,
                device=config.device,
                role=engine_role,
                state=state["value"],
                group_id=worker_id,
                tp=1,
                model_name=engine.model_name,
                max_model_len=engine.max_model_len,
                num_running=len(session.running),
                num_waiting=s.num_waiting,
                kv_blocks_free=s.num_kv_blocks_free,
                kv_blocks_total=s.num_kv_blocks_total,
                running_request_ids=tuple(session.running),
                cached_block_hashes=tuple(s.cached_block_hashes[:256]),
                sent_unix_ms=time.time() * 1000.0,
                step_ms_ewma=session.step_ms_ewma,
                num_prefill_tokens_computed=s.num_prefill_tokens_computed,
                num_cached_prompt_tokens=s.num_cached_prompt_tokens,
                num_aborted=session.num_aborted,
                instance_id=instance_id,
            )

        async def publish_stats() -> None:
            ctx.metrics.worker_requests_running().labels(worker=worker_id).set(len(session.running))
            ctx.metrics.kv_blocks_free().labels(worker=worker_id).set(session.stats().num_kv_blocks_free)
            try:
                await bus.publish(bus.subjects.worker_stats, stats_message())
            except Exception as exc:  # NATS may be restarting; the next beat retries
                log.debug("stats not sent: %s", exc)

        async def on_run(run: RunRequest, _delivery) -> RunAck:
            rid = run.request.request_id
            if state["value"] != "ready":
                return RunAck(rid, worker_id, False, f"worker is {state['value']}")
            problem = session.validate(run)
            if problem:
                return RunAck(rid, worker_id, False, problem)
            session.submit(run)
            return RunAck(rid, worker_id, True)

        async def on_abort(msg: AbortRequest, _delivery) -> None:
            if msg.worker_id and msg.worker_id != worker_id:
                return
            if session.abort(msg.request_id, msg.reason):
                log.info("aborted %s (%s)", msg.request_id, msg.reason)

        async def heartbeat() -> None:
            period_s = config.heartbeat_interval_ms / 1000.0
            while not ctx.stop.is_set():
                await publish_stats()
                try:
                    await asyncio.wait_for(ctx.stop.wait(), timeout=period_s)
                except asyncio.TimeoutError:
                    pass

        await bus.subscribe(bus.subjects.worker_run(worker_id), on_run, expected=RunRequest)
        await bus.subscribe(bus.subjects.abort, on_abort, expected=AbortRequest)
        async def on_coordinator_up_raw(_msg) -> None:
            await publish_stats()

        await bus.nc.subscribe(bus.subjects.coordinator_up, cb=on_coordinator_up_raw)
        engine_stop = asyncio.Event()
        loop_task = asyncio.create_task(session.run(engine_stop))
        beat_task = asyncio.create_task(heartbeat())
        await publish_stats()

        async def drain() -> None:
            state["value"] = "draining"
            await publish_stats()
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while not session.idle and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not session.idle:
                # Hand the rest back: the gateway re-routes them with the tokens they already have.
                await session._fail_all("worker_stopping", "the worker is shutting down")
            state["value"] = "stopped"
            await publish_stats()
            engine_stop.set()
            await asyncio.wait({loop_task, beat_task}, timeout=5.0)

        ctx.drain_hooks.append(drain)

    return body


def main(argv: list[str]) -> int:
    service_name = argv[0] if argv and argv[0] in ("prefill-worker", "decode-worker") else "decode-worker"
    return run_service(service_name, WorkerConfig, argv[1:] if argv and argv[0] == service_name else argv, make_body(service_name))
