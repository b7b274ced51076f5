"""A TP transition's pre-copy as Nuska stage-M flows (issue #6 item 6), driven by an old group's leader.

When a prepare comes back `pending` (NodeRuntime pre-copies between decode steps, shm path), the leader of
the old group submits one flow per (source worker, destination worker) pair of its group to the
flow-scheduler -- stage "M", its bytes, deadline = the planned cutover (prepare start +
NITSUM_TP_MIGRATION_BUDGET_MS) -- and runs each flow's chunks only under its permit, through the
worker's TransferAgent: strict priority against this worker's P2D and reuse flows, completion reported
so the scheduler frees it. Each chunk is one `session.call`, i.e. it runs in the step thread at a step
boundary, between two decode steps of the old group. Copies inside one worker (old cache -> its own new
cache) involve no link: they run without a permit.

The scheduler is advice, never a gate: silent (TransferAgent.permits times out) or pruning, the flows
still run at the lowest level (logged, counted in nitsum_flow_fallbacks_total / here). A transition
never waits on it. The final prepare ack (the one the coordinator gets) comes when every chunk is done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from prometheus_client import Counter

from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum.wire.messages import FlowPermit, FlowSubmit, TopologyPrepare

log = logging.getLogger("nitsum.worker.migration")


def _counter(metrics: Metrics, key: str, name: str, doc: str, labels: list[str]) -> Counter:
    return metrics._get(key, lambda: Counter(name, doc, labels, registry=metrics.registry))


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
        """KV bytes a transition moved into other workers' caches, by path (shm | p2p)."""
        if size_bytes:
            _counter(self.metrics, "kvmig_path", "nitsum_kv_migration_path_bytes_total",
                     "KV bytes TP transitions moved into other workers' caches, by path (shm | p2p)", ["path"]
                     ).labels(path=path).inc(size_bytes)

    async def drive(self, msg: TopologyPrepare, pending):
        """Run the pre-copy of a pending prepare to its end; returns the final prepare ack."""
        epoch = msg.epoch
        started_unix_ms = time.time() * 1000.0 - pending.duration_ms
        deadline_unix_ms = started_unix_ms + self.budget_ms
        worker_of = {g.start + i: wid for g in msg.groups for i, wid in enumerate(g.worker_ids)}
        flows = await self.session.call(lambda backend: backend.precopy_flows())
        remote = [f for f in flows if not f.local]
        local = [f for f in flows if f.local]
        unit = f"tp-migration-{msg.node_id}-e{epoch}"
        submits = [
            FlowSubmit(
                flow_id=f"{unit}-w{f.src_worker}-w{f.dst_worker}", request_id=unit, unit_id=unit, stage="M",
                size_bytes=f.size_bytes, src=worker_of.get(f.src_worker, str(f.src_worker)),
                dst=worker_of.get(f.dst_worker, str(f.dst_worker)), deadline_unix_ms=deadline_unix_ms,
            )
            for f in remote
        ]
        permits = await self.agent.permits(submits) if submits else []
        self.num_flows += len(submits)
        lowest = self.agent.num_levels
        for i, permit in enumerate(permits):
            if permit.pruned or permit.reason:  # refused or no scheduler: still runs, at the lowest level
                self.num_unpermitted += 1
                _counter(self.metrics, "kvmig_unpermitted", "nitsum_kv_migration_unpermitted_flows_total",
                         "stage-M flows run without a flow-scheduler permit (silent or pruning)", []).inc()
                log.info("migration flow %s runs without a permit (%s)", submits[i].flow_id,
                         permit.reason or "pruned")
                permits[i] = FlowPermit(permit.flow_id, lowest, self.agent.dscp[lowest], reason=permit.reason or "pruned")

        async def run_chunks(flow) -> int:
            sent = 0
            for c in range(len(flow.chunks)):
                n = await self.session.call(lambda backend, c=c: backend.precopy([(flow.index, c)]))
                if n is None:  # committed or aborted meanwhile: nothing of it is left to copy here
                    raise TransferError(ErrorCode.CLOSED, f"pre-copy of epoch {epoch} ended", f"w{flow.src_worker}-w{flow.dst_worker}")
                sent += n
            return sent

        def send_of(flow):
            async def send(_level: int) -> int:
                return await run_chunks(flow)
            return send

        tasks = [self.agent.run(s.flow_id, p, send_of(f)) for f, s, p in zip(remote, submits, permits)]
        tasks += [run_chunks(f) for f in local]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        ack = await self.session.call(lambda backend: backend.take_prepare_ack())
        if ack is None or ack.epoch != epoch:
            why = "; ".join(f"{type(e).__name__}: {e}" for e in errors[:3]) or "no final ack"
            return dataclasses.replace(pending, ok=False, pending=False, reason=f"pre-copy did not complete: {why}")
        return ack
