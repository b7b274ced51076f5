"""A TP transition's pre-copy as Nuska stage-M flows (issue #6 item 6), driven by an old group's leader.

When a prepare comes back `pending` (NodeRuntime pre-copies between decode steps: shared memory between
workers of one host, the TCP data plane across hosts), the leader of the old group submits one flow per
(source worker, destination worker) pair of its group to the flow-scheduler -- stage "M", its bytes,
deadline = the planned cutover (prepare start + NITSUM_TP_MIGRATION_BUDGET_MS) -- and runs each flow's
chunks only under its permit, through the worker's TransferAgent: strict priority against this worker's
P2D and reuse flows, completion reported so the scheduler frees it. Each chunk is one `session.call`, i.e.
it runs in the step thread at a step boundary, between two decode steps of the old group. Copies inside one
worker (old cache -> its own new cache) involve no link: they run without a permit.

The scheduler is advice, never a gate: silent (TransferAgent.permits times out) or pruning, the flows
still run at the lowest level (logged, counted in nitsum_flow_fallbacks_total / here). A transition
never waits on it.

On the wire (ALGORITHMS.md §2.4): the agent calls a flow's `send(level)` with the level its permit (or a
later promotion) grants; the flow's chunks to another host then go over the pair's TCP connection of that
level's class, `agent.dscp[level]` (IP_TOS = tos_for_dscp of it; nitsum.transfer.kv_tcp opens one connection
per class), handed to the step thread with `backend.allow`. A flow without a permit runs at the lowest level,
so in its DSCP. The commit's delta is not a flow here: it runs inside the commit, in STAGE_M_DSCP. The final prepare ack (the one the coordinator gets) comes when every chunk is done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from opentelemetry import trace
from prometheus_client import Counter

from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum.wire.messages import FlowPermit, FlowSubmit, TopologyPrepare

log = logging.getLogger("nitsum.worker.migration")


def _counter(metrics: Metrics, key: str, name: str, doc: str, labels: list[str]) -> Counter:
    return metrics.get(key, lambda: Counter(name, doc, labels, registry=metrics.registry))


class MigrationDriver:
    def __init__(self, session, agent, worker_id: str, metrics: Metrics, budget_ms: float) -> None:
        self.session = session
        self.agent = agent
        self.worker_id = worker_id
        self.metrics = metrics
        self.budget_ms = budget_ms
        self.num_flows = 0  # stage-M flows submitted (tests, stats)
        self.num_unpermitted = 0  # of them, run without a permit (scheduler silent or pruning)

    def count_bytes(self, path: str, size_bytes: int) -> None:
        """KV bytes a transition moved into other workers' caches, by path (shm | tcp | p2p)."""
        if size_bytes:
            _counter(
                self.metrics,
                "kvmig_path",
                "nitsum_kv_migration_path_bytes_total",
                "KV bytes TP transitions moved into other workers' caches, by path (shm | tcp | p2p)",
                ["path"],
            ).labels(path=path).inc(size_bytes)

    async def drive(self, msg: TopologyPrepare, pending):
        """Run the pre-copy of a pending prepare to its end; returns the final prepare ack."""
        loop = asyncio.get_running_loop()
        backend = self.session.backend
        epoch = msg.epoch
        drive_start_unix_ms = time.time() * 1000.0
        started_unix_ms = drive_start_unix_ms - pending.duration_ms  # (a step later at most: close enough)
        deadline_unix_ms = started_unix_ms + self.budget_ms
        worker_of = {g.start + i: wid for g in msg.groups for i, wid in enumerate(g.worker_ids)}
        flows = backend.precopy_flows()
        remote = [f for f in flows if not f.local]
        local = [f for f in flows if f.local]
        unit = f"tp-migration-{msg.node_id}-e{epoch}"
        submits = [
            FlowSubmit(
                flow_id=f"{unit}-w{f.src_worker}-w{f.dst_worker}",
                request_id=unit,
                unit_id=unit,
                stage="M",
                # `src` is the agent that holds the flow and gets its promotions (this leader, which runs
                # its peers' chunks too); the pair itself is in the flow id.
                size_bytes=f.size_bytes,
                src=self.worker_id,
                dst=worker_of.get(f.dst_worker, str(f.dst_worker)),
                deadline_unix_ms=deadline_unix_ms,
            )
            for f in remote
        ]
        t_permits = time.perf_counter()
        permits = await self.agent.permits(submits) if submits else []
        permits_ms = (time.perf_counter() - t_permits) * 1000.0
        self.num_flows += len(submits)
        lowest = self.agent.num_levels
        for i, permit in enumerate(permits):
            if permit.pruned or permit.reason:  # refused or no scheduler: still runs, at the lowest level
                self.num_unpermitted += 1
                _counter(
                    self.metrics,
                    "kvmig_unpermitted",
                    "nitsum_kv_migration_unpermitted_flows_total",
                    "stage-M flows run without a flow-scheduler permit (silent or pruning)",
                    [],
                ).inc()
                log.info("migration flow %s runs without a permit (%s)", submits[i].flow_id, permit.reason or "pruned")
                permits[i] = FlowPermit(
                    permit.flow_id, lowest, self.agent.dscp[lowest], reason=permit.reason or "pruned"
                )
        acks = []

        async def run_flow(flow, dscp: int | None = None) -> int:
            """Allow the flow in the step thread (one chunk per step from now on, across hosts in class `dscp`)
            and wait for its end."""
            future = loop.create_future()

            def on_done(_index: int, result: tuple) -> None:  # step thread
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

            backend.allow(flow.index, on_done, dscp)
            self.session.wake()
            ok, ack, error = await future
            if ack is not None:
                acks.append(ack)
            if not ok:
                raise TransferError(ErrorCode.CLOSED, error, f"w{flow.src_worker}-w{flow.dst_worker}")
            return flow.size_bytes

        def send_of(flow):
            async def send(level: int) -> int:
                return await run_flow(flow, self.agent.dscp[min(max(level, 1), lowest)])

            return send

        tasks = [self.agent.run(s.flow_id, p, send_of(f)) for f, s, p in zip(remote, submits, permits)]
        tasks += [run_flow(f) for f in local]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        span = trace.get_current_span()
        span.set_attribute("nitsum.migration_flows", len(submits))
        span.set_attribute("nitsum.migration_chunks", sum(len(f.chunks) for f in flows))
        span.set_attribute("nitsum.permits_ms", round(permits_ms, 3))
        timings = getattr(backend.runtime, "last_prepare_timings_ms", {})
        span.set_attribute("nitsum.prepare_step_ms", round(pending.duration_ms, 3))
        final = next((a for a in acks if a.epoch == epoch), None)
        by_path = ", ".join(f"{p} {n}" for p, n in final.bytes_by_path) if final is not None else ""
        log.info(
            "epoch %d: prepare step %.1f ms (%s), then pre-copy of %d flow(s) + %d local copy(ies), %d chunk(s), "
            "%d bytes, done %.1f ms after the pending prepare ack (permits %.1f ms)%s%s",
            epoch,
            pending.duration_ms,
            ", ".join(f"{k} {v:.0f}" for k, v in timings.items()),
            len(remote),
            len(local),
            sum(len(f.chunks) for f in flows),
            sum(f.size_bytes for f in flows),
            time.time() * 1000.0 - drive_start_unix_ms,
            permits_ms,
            f"; this worker's bytes by path: {by_path}" if by_path else "",
            f"; errors: {errors[:3]}" if errors else "",
        )
        if final is None:
            why = "; ".join(f"{type(e).__name__}: {e}" for e in errors[:3]) or "no final ack"
            return dataclasses.replace(pending, ok=False, pending=False, reason=f"pre-copy did not complete: {why}")
        return final
