"""Continuous batching with chunked prefill under a per-step token budget (no torch).

Each `schedule()` picks, for this step, how many tokens of which sequences to compute:
1. Running sequences first, oldest first: one token for a decode, the next chunk for a prefill in
   progress. If the KV pool has no room, the *newest* running sequence is preempted (its blocks freed,
   put back at the head of the queue to be recomputed later; its full blocks stay in the prefix cache,
   so the recompute is mostly a cache hit) until the allocation fits.
2. Then waiting sequences in arrival order while budget, KV room and `max_num_seqs` allow, each first
   matched against the prefix cache. Nothing new is admitted in a step that had to preempt.

Once any request carries an SLO (`Sequence.slo`) the step follows the tier-aware order of
`nitsum.engine.tiered` instead (decodes first, TPOT-sized steps, prefill by TTFT deadline, background
preempted for an interactive request that would otherwise miss); the role rules below hold in both.

Roles (admission rules):
- hybrid: the above.
- prefill: a sequence leaves the running set after its first sampled token; the engine pins it (KV kept
  for the P/D transfer) until `release()`. No decode steps ever run.
- decode: a waiting sequence whose prompt KV is already present (prefix-cache hit leaving at most one
  block to compute, e.g. KV imported from a prefill worker) is admitted at once; one that would need a
  real prefill is admitted only when nothing is running, so decodes are never slowed by a prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nitsum.engine.sequence import Sequence, Status
from nitsum.engine.slo import StepCostModel
from nitsum.engine.tiered import TieredStep
from nitsum.kv import KVCacheManager


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start_pos: int  # tokens already in the KV cache
    num_tokens: int  # tokens computed this step: positions [start_pos, start_pos + num_tokens)
    num_prefill_tokens: int  # of which prompt/recompute tokens (the rest is the decode token)

    @property
    def sample(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its last logits pick a token."""
        return self.start_pos + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        role: str = "hybrid",
        step_cost: StepCostModel | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.role = role
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pinned: dict[str, Sequence] = {}
        # Tokens each sequence had when last admitted: everything below is prefill (or recompute).
        self._prefill_target: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0  # cumulative prefix-cache hits, first admissions only
        # Measured step times (the engine feeds them): sizes tier-aware steps to the tightest TPOT.
        self.step_cost = step_cost or StepCostModel()
        self.tier_aware = False  # set once a request with an SLO arrives

    # -- queue management ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.status is Status.WAITING, f"{seq.request_id} must be new"
        self.tier_aware = self.tier_aware or seq.slo is not None
        self.waiting.append(seq)

    def adopt(self, seq: Sequence, prefill_target: int | None = None) -> None:
        """Take over a sequence moved from another engine, in the state it had there (its KV blocks, if
        any, already adopted by the KV manager). Appended after the sequences of the same status."""
        self.tier_aware = self.tier_aware or seq.slo is not None
        if seq.status is Status.RUNNING:
            self.running.append(seq)
            self._prefill_target[seq.request_id] = prefill_target or seq.num_tokens
        elif seq.status is Status.PINNED:
            self.pinned[seq.request_id] = seq
        else:
            assert seq.status is Status.WAITING, f"{seq.request_id}: cannot adopt a {seq.status} sequence"
            self.waiting.append(seq)

    def prefill_target(self, request_id: str) -> int | None:
        return self._prefill_target.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a running sequence for good and free its KV."""
        self.running.remove(seq)
        seq.status = Status.FINISHED
        self.kv.free(seq.request_id)
        self._prefill_target.pop(seq.request_id, None)

    def pin(self, seq: Sequence) -> None:
        """Prefill role: the sequence is done but its KV stays allocated until `release`."""
        self.running.remove(seq)
        seq.status = Status.PINNED
        self.pinned[seq.request_id] = seq
        self._prefill_target.pop(seq.request_id, None)

    def release(self, request_id: str) -> bool:
        seq = self.pinned.pop(request_id, None)
        if seq is None:
            return False
        seq.status = Status.FINISHED
        self.kv.free(request_id)
        return True

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = Status.FINISHED
                self.kv.free(request_id)  # a preempted sequence holds none; harmless
                return seq
        if request_id in self.pinned:
            seq = self.pinned[request_id]
            self.release(request_id)
            return seq
        return None

    def _preempt_newest(self) -> Sequence:
        victim = self.running[-1]
        self.preempt(victim)
        return victim

    def preempt(self, victim: Sequence) -> None:
        """Free a running sequence's KV and put it back at the head of the queue (recomputed later)."""
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    # -- the step decision --------------------------------------------------------------------------
    def schedule(self, now_ms: float | None = None) -> SchedulerOutput:
        """`now_ms`: the engine clock, for the tier-aware order's deadline checks (unused without SLOs)."""
        if self.tier_aware:
            return TieredStep(self, now_ms).run()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        block_size = self.kv.block_size

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            assert num_new > 0, f"{seq.request_id} is running with nothing to compute"
            # Most decode steps land in a block the sequence already holds: then there is nothing to
            # allocate (allocate would only confirm that), so the pool is not consulted.
            rid = seq.request_id
            if not self.kv.has(rid) or seq.num_computed_tokens + num_new > len(self.kv.block_table(rid)) * block_size:
                while self.kv.allocate(seq.request_id, seq.num_computed_tokens + num_new) is None:
                    victim = self._preempt_newest()
                    preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    break  # it preempted itself: everything after it is gone too
            chunks.append(self._chunk(seq, num_new))
            budget -= num_new
            index += 1

        if not preempted:
            budget = self._admit(chunks, budget)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> int:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.kv.find_prefix(seq.token_ids)
            num_cached = len(prefix) * self.kv.block_size
            if self.role == "decode" and not self._decode_ready(seq, num_cached, chunks):
                skipped.append(self.waiting.popleft())
                continue
            num_new = min(seq.num_tokens - num_cached, budget)
            if self.kv.allocate(seq.request_id, num_cached + num_new, prefix) is None:
                break  # no room now: it waits (nothing is preempted for a newcomer)
            self.waiting.popleft()
            self.start(seq, num_cached)
            chunks.append(self._chunk(seq, num_new))
            budget -= num_new
        # Skipped sequences keep their place at the head of the queue, in order.
        self.waiting.extendleft(reversed(skipped))
        return budget

    def start(self, seq: Sequence, num_cached: int) -> None:
        """A waiting sequence whose KV was just allocated joins the running set."""
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
            self.num_cached_prompt_tokens += seq.num_cached_prompt_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._prefill_target[seq.request_id] = seq.num_tokens

    def _decode_ready(self, seq: Sequence, num_cached: int, chunks: list[ScheduledChunk]) -> bool:
        if seq.num_tokens - num_cached <= self.kv.block_size:
            return True
        return not self.running and not chunks

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        target = self._prefill_target.get(seq.request_id, seq.num_tokens)
        num_prefill = max(0, min(start + num_new, target) - start)
        # The last token of a prefill is sampled from but is itself a prompt token; a decode step's
        # single token is the newest output, computed after it was sampled.
        return ScheduledChunk(seq=seq, start_pos=start, num_tokens=num_new, num_prefill_tokens=num_prefill)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache."""
        for chunk in output.chunks:
            seq = chunk.seq
            assert seq.num_computed_tokens == chunk.start_pos, f"{seq.request_id} advanced twice"
            seq.num_computed_tokens += chunk.num_tokens
            self.kv.commit(seq.request_id, seq.token_ids, seq.num_computed_tokens)

    def check_integrity(self, quick: bool = False) -> None:
        """Scheduler and KV bookkeeping agree; `quick`: the KV side only in the blocks the tables hold
        (KVCacheManager.check_tables), O(blocks in use) instead of O(pool)."""
        if quick:
            self.kv.check_tables()
        else:
            self.kv.check_integrity()
        holders = {s.request_id for s in self.running} | set(self.pinned)
        for seq in self.running:
            assert seq.status is Status.RUNNING, f"{seq.request_id} in running with status {seq.status}"
            assert self.kv.has(seq.request_id), f"running {seq.request_id} holds no blocks"
        for seq in self.waiting:
            assert seq.status is Status.WAITING, f"{seq.request_id} waiting with status {seq.status}"
            assert not self.kv.has(seq.request_id), f"waiting {seq.request_id} holds blocks"
        if not holders:
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks, "idle engine with blocks in use"
