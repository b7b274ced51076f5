"""One tier-aware scheduler step (no torch, no clock): the order the scheduler follows once any of its
requests carries an SLO (`Sequence.slo`).

1. Decodes first, interactive before background: a background prefill never delays an interactive token.
2. The step's token budget fits the tightest TPOT among the decoding requests (`StepCostModel`, fitted to
   the engine's measured steps): prefill chunks shrink so that the step stays under that target. The
   decodes of the tightest tier always run; background decodes beyond the cap wait one step.
3. Prefill by TTFT deadline: part-prefilled running requests and waiting ones in one earliest-deadline-
   first order, so an interactive arrival overtakes a background prompt's remaining chunks.
4. An interactive request that cannot be admitted (no KV room, or `max_num_seqs` running) preempts the
   newest background request (one already scheduled in this step loses its chunk) when waiting would miss its TTFT deadline: the soonest a running request
   can finish (its remaining `max_tokens` at the current step time) plus its own prefill ends after the
   deadline. Without a fitted step cost it preempts at once. A background request never preempts an
   interactive one; a KV shortage inside the running set preempts background requests first.
Without SLOs the scheduler keeps its plain order (scheduler.py), so requests that carry none (tests,
in-process benchmarks) are scheduled exactly as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nitsum.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from nitsum.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

# A step is sized to this share of the tightest TPOT: the rest is sampling, streaming and noise.
TPOT_HEADROOM = 0.8


def _decode_order(seq: Sequence) -> tuple[int, int]:
    return (0 if seq.interactive else 1, seq.arrival_index)


def _deadline_order(seq: Sequence) -> tuple[float, int]:
    return (seq.deadline_ms, seq.arrival_index)


class TieredStep:
    """The decisions of one step; `run()` once."""

    def __init__(self, scheduler: Scheduler, now_ms: float | None) -> None:
        self.sched = scheduler
        self.now_ms = now_ms
        self.budget = scheduler.max_num_batched_tokens
        self.chunks: list[ScheduledChunk] = []
        self.preempted: list[Sequence] = []
        self.scheduled: set[str] = set()

    def run(self) -> SchedulerOutput:
        from nitsum.engine.scheduler import SchedulerOutput

        running = list(self.sched.running)
        decodes = sorted((q for q in running if q.num_uncomputed_tokens == 1), key=_decode_order)
        prefills = [q for q in running if q.num_uncomputed_tokens > 1]
        self._cap_budget(decodes)
        for seq in decodes:
            if self.budget <= 0:
                break  # background decodes past the TPOT cap wait one step
            if seq.status is Status.RUNNING:
                self._compute(seq, 1)
        # As in the plain order: nothing new is admitted in a step that had to preempt for KV room.
        waiting = list(self.sched.waiting) if not self.preempted else []
        for seq in sorted(prefills + waiting, key=_deadline_order):
            if self.budget <= 0:
                break
            if seq.status is Status.RUNNING and seq.request_id not in self.scheduled:
                self._compute(seq, min(seq.num_uncomputed_tokens, self.budget))
            elif seq.status is Status.WAITING and seq not in self.preempted:
                self._admit(seq)
        return SchedulerOutput(tuple(self.chunks), tuple(self.preempted))

    # -- budget ---------------------------------------------------------------------------------------
    def _cap_budget(self, decodes: list[Sequence]) -> None:
        targets = [q.slo.tpot_ms for q in self.sched.running if q.slo is not None and q.num_output_tokens > 0]
        if not targets:
            return
        cap = self.sched.step_cost.max_tokens_within(min(targets) * TPOT_HEADROOM)
        if cap is None:
            return
        interactive = sum(1 for q in decodes if q.interactive)
        floor = interactive if interactive else len(decodes)
        self.budget = min(self.budget, max(cap, floor, 1))

    # -- computing a running request ----------------------------------------------------------------------
    def _compute(self, seq: Sequence, num_new: int) -> None:
        kv = self.sched.kv
        rid = seq.request_id
        need = seq.num_computed_tokens + num_new
        if not kv.has(rid) or need > len(kv.block_table(rid)) * kv.block_size:
            while kv.allocate(rid, need) is None:
                victim = self._victim_for(seq)
                self._preempt(victim)
                if victim is seq:
                    return
        self.chunks.append(self.sched._chunk(seq, num_new))
        self.scheduled.add(rid)
        self.budget -= num_new

    def _background_victim(self, seq: Sequence) -> Sequence | None:
        """The newest background request other than `seq`, one not yet scheduled this step first (a
        scheduled one loses its chunk)."""
        background = [q for q in reversed(self.sched.running) if q is not seq and not q.interactive]
        background.sort(key=lambda q: q.request_id in self.scheduled)  # stable: newest first within each
        return background[0] if background else None

    def _victim_for(self, seq: Sequence) -> Sequence:
        """A background request; for an interactive one, else the newest unscheduled interactive one;
        otherwise the request gives up its own place."""
        victim = self._background_victim(seq)
        if victim is not None:
            return victim
        others = [q for q in reversed(self.sched.running) if q is not seq and q.request_id not in self.scheduled]
        if seq.interactive and others:
            return others[0]
        return seq

    def _preempt(self, victim: Sequence) -> None:
        if victim.request_id in self.scheduled:
            self.scheduled.discard(victim.request_id)
            for chunk in [c for c in self.chunks if c.seq is victim]:
                self.chunks.remove(chunk)
                self.budget += chunk.num_tokens
        self.sched.preempt(victim)
        self.preempted.append(victim)

    # -- admitting a waiting request ----------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        sched = self.sched
        if len(sched.running) >= sched.max_num_seqs and not self._make_room(seq):
            return
        prefix = sched.kv.find_prefix(seq.token_ids)
        num_cached = len(prefix) * sched.kv.block_size
        if sched.role == "decode" and not sched._decode_ready(seq, num_cached, self.chunks):
            return
        num_new = min(seq.num_tokens - num_cached, self.budget)
        while sched.kv.allocate(seq.request_id, num_cached + num_new, prefix) is None:
            if not self._make_room(seq):
                return  # it waits
        sched.waiting.remove(seq)
        sched.start(seq, num_cached)
        self.chunks.append(sched._chunk(seq, num_new))
        self.scheduled.add(seq.request_id)
        self.budget -= num_new

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt the newest unscheduled background request for an interactive one that would otherwise
        miss its TTFT deadline. True if one was preempted."""
        if not seq.interactive or not self._would_miss(seq):
            return False
        victim = self._background_victim(seq)
        if victim is None:
            return False
        self._preempt(victim)
        return True

    def _would_miss(self, seq: Sequence) -> bool:
        fit = self.sched.step_cost.fit()
        if self.now_ms is None or fit is None:
            return True
        base_ms, per_token_ms = fit
        running = self.sched.running
        step_ms = base_ms + per_token_ms * max(1, len(running))
        soonest_tokens = min((q.params.max_tokens - q.num_output_tokens for q in running), default=0)
        wait_ms = max(0, soonest_tokens) * step_ms
        prefill_ms = base_ms + per_token_ms * seq.num_uncomputed_tokens
        return self.now_ms + wait_ms + prefill_ms > seq.deadline_ms
