"""The overload check on batch arrival, the worker's half (paper §4.4.2; docs/SIMULATOR.md rule 33).

A request a worker will hand off after its prefill (P/D: a decode worker named, or a prefill group of a node
world) is reported to the flow-scheduler when it is admitted, before it sends anything: a PrefillAdmission on
`flow.progress` with its TTFT deadline (arrival + TTFT target) and the compute its prefill takes here, its
prompt at this worker's measured prefill rate (`WorkerSession.prefill_ms_per_token`; 0 until a turn computed
prompt tokens, so a worker that has measured nothing never gets a request pruned for its compute). When its
prefill is over (its first token went out, or it ended or was aborted before that) a second report says it
`left`. The flow-scheduler walks each worker's pending requests in σ and prunes those whose deadline cannot be
met; the FlowPruned it sends to this worker's permit subject ends the request's stream with the retryable
`overload_pruned` (the gateway re-submits it, the coordinator runs it hybrid), if it is still prefilling here.
Reports are advice: one that is lost costs only the check's view of this worker (never a request).
"""

from __future__ import annotations

import asyncio
import logging

from nitsum.bus import Bus
from nitsum.wire.messages import FlowPruned, PrefillAdmission, RunRequest

log = logging.getLogger("nitsum.worker.admission")


class PrefillAdmissions:
    def __init__(self, session, bus: Bus, worker_id: str) -> None:
        self.session = session
        self.bus = bus
        self.worker_id = worker_id
        self.pending: set[str] = set()  # reported, prefill not over yet
        self.num_pruned = 0
        self._background: set[asyncio.Task] = set()

    def admitted(self, run: RunRequest) -> None:
        """`run` was accepted here (`WorkerService.on_run`): report it if it hands off and has a TTFT deadline."""
        req = run.request
        hands_off = bool(run.decode_worker) or self.session.world_prefill
        if not hands_off or req.arrival_unix_ms <= 0 or req.ttft_ms <= 0 or req.output_token_ids:
            return  # a re-submission that streamed already is past its first token
        rid = req.request_id
        self.pending.add(rid)
        compute_ms = self.session.prefill_ms_per_token * len(req.prompt_token_ids)
        self._publish(PrefillAdmission(self.worker_id, (rid,), (req.arrival_unix_ms + req.ttft_ms,), (compute_ms,)))

    def prefill_over(self, request_id: str) -> None:
        """The session's callback: this request's prefill is over here (first token, end, abort)."""
        if request_id in self.pending:
            self.pending.discard(request_id)
            self._publish(PrefillAdmission(self.worker_id, left=(request_id,)))

    def on_pruned(self, msg: FlowPruned) -> None:
        """The flow-scheduler pruned a request of this worker before its prefill."""
        if self.session.prune(msg.request_id, msg.reason):
            self.num_pruned += 1
            log.info("pruned %s before its prefill: %s", msg.request_id, msg.reason)

    def _publish(self, msg: PrefillAdmission) -> None:
        async def publish() -> None:
            try:
                await self.bus.publish(self.bus.subjects.flow_progress, msg)
            except Exception as exc:  # advice only
                log.debug("prefill admission report not sent: %s", exc)

        task = asyncio.create_task(publish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
