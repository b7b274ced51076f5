"""The overload check on batch arrival, the worker's half (paper §4.4.2; docs/SIMULATOR.md rule 33).

A request a worker will hand off after its prefill (P/D: a decode worker named, or a prefill group of a node
world) is reported to the flow-scheduler when it is admitted, before it sends anything: a PrefillAdmission on
`flow.progress` with its TTFT deadline (arrival + TTFT target) and the compute its prefill takes here, its
prompt tokens it will compute (less its cached and fetched prefix) at this worker's measured prefill cost
(`PrefillCost`, a fixed cost per turn plus one per token fitted to its recent turns; 0 until a turn was
measured, so a worker that has measured nothing never gets a request pruned for its compute). When its
prefill is over (its first token went out, or it ended or was aborted before that) a second report says it
`left`. The flow-scheduler walks each worker's pending requests in σ and prunes those whose deadline cannot be
met; the FlowPruned it sends to this worker's permit subject ends the request's stream with the retryable
`overload_pruned` (the gateway re-submits it, the coordinator runs it hybrid), if it is still prefilling here.
Reports are advice: one that is lost costs only the check's view of this worker (never a request).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from nitsum.bus import Bus
from nitsum.kv.prefix import block_hashes
from nitsum.wire.messages import FlowPruned, PrefillAdmission, RunRequest

log = logging.getLogger("nitsum.worker.admission")


class PrefillCost:
    """This worker's prefill cost as measured: the turns that computed prompt tokens (after the first, which
    warms the engine up), each (tokens computed, wall ms), the last WINDOW of them, fitted as a fixed cost per
    turn plus a cost per token (least squares, both >= 0; through the origin where the fit's fixed cost comes
    out negative, or where all turns computed as many tokens). `estimate_ms(tokens)`: 0 until a turn was
    measured, so nothing is pruned on a guess."""

    WINDOW = 64

    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)
        self.turns = 0
        self._fit: tuple[float, float] = (0.0, 0.0)

    def add(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or not ms >= 0.0:
            return
        self.turns += 1
        if self.turns == 1:
            return  # the warm-up turn
        self.samples.append((tokens, ms))
        self._fit = self._refit()

    def _refit(self) -> tuple[float, float]:
        n = len(self.samples)
        st = sum(t for t, _ in self.samples)
        sm = sum(m for _, m in self.samples)
        stt = sum(t * t for t, _ in self.samples)
        stm = sum(t * m for t, m in self.samples)
        var = stt - st * st / n
        if var > 1e-9:
            b = (stm - st * sm / n) / var
            a = (sm - b * st) / n
            if a >= 0.0 and b >= 0.0:
                return a, b
        return 0.0, max(stm / stt, 0.0)  # through the origin: ms per token

    def estimate_ms(self, tokens: int) -> float:
        """One turn computing `tokens` prompt tokens alone."""
        return self.turn_ms + self.token_ms(tokens)

    @property
    def turn_ms(self) -> float:
        """The fixed cost of a turn (a request admitted now shares its turn with those queued with it)."""
        return self._fit[0] if self.samples else 0.0

    def token_ms(self, tokens: int) -> float:
        return self._fit[1] * max(tokens, 0) if self.samples else 0.0


class PrefillAdmissions:
    def __init__(self, session, bus: Bus, worker_id: str, instance: str = "", block_size: int = 16) -> None:
        self.session = session
        self.bus = bus
        self.worker_id = worker_id
        self.instance = instance  # this process (WorkerService.instance_id)
        self.block_size = block_size
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
        cost = self.session.prefill_cost
        compute_ms = cost.token_ms(self.uncached_tokens(run))
        deadline = req.arrival_unix_ms + req.ttft_ms
        msg = PrefillAdmission(self.worker_id, (rid,), (deadline,), (compute_ms,), (), self.instance, cost.turn_ms)
        self._publish(msg)

    def uncached_tokens(self, run: RunRequest) -> int:
        """The prompt tokens this worker will compute: less the leading blocks its prefix cache held at the last
        step (the engine's latest report of them) or that a stage-1 fetch brings; the last token at least."""
        tokens = run.request.prompt_token_ids
        bs = max(self.block_size, 1)
        cached = set(self.session.stats().cached_block_hashes or ())
        held = 0
        for h in block_hashes(list(tokens[: len(tokens) - 1]), bs) if cached else ():
            if h not in cached:
                break
            held += 1
        return max(len(tokens) - bs * max(held, len(run.reuse_hashes)), 1)

    def prefill_over(self, request_id: str) -> None:
        """The session's callback: this request's prefill is over here (first token, end, abort)."""
        if request_id in self.pending:
            self.pending.discard(request_id)
            self._publish(PrefillAdmission(self.worker_id, left=(request_id,), instance=self.instance))

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
