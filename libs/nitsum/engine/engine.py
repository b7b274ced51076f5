"""The worker's engine: scheduler + model runner + sampler + detokenizer, one `step()` at a time.

Threading: the engine is not thread-safe. `step()` may run in a worker thread, but `add_request`,
`abort` and `release` must not run while a `step()` is in progress (serialise them, e.g. with one lock
or an inbox drained between steps). Everything else is plain single-threaded state.

TP>1: the leader (rank 0) constructs `Engine(cfg, group)`; every other rank runs `run_peer(cfg, group)`,
which executes the plans the leader broadcasts until `Engine.shutdown()`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence as SequenceABC
from pathlib import Path

from nitsum.engine import migration, request_state
from nitsum.engine.guided import Guides, allowed
from nitsum.engine.migration import KVExport
from nitsum.engine.params import EngineConfig, EngineStats, RequestOutput, SamplingParams
from nitsum.engine.plan import PLAN_KIND_SHUTDOWN, PLAN_KIND_STEP, ChunkPlan, StepPlan
from nitsum.engine.runner import ModelRunner
from nitsum.engine.sampling import Sampled, make_generator, sample_detailed
from nitsum.engine.scheduler import Scheduler, SchedulerOutput
from nitsum.engine.sequence import Sequence, Status
from nitsum.engine.slo import RequestSlo
from nitsum.kv import KVCacheManager
from nitsum.kv.reshard import Placement, RequestKV
from nitsum.model.loader import read_raw_config
from nitsum.model.tokenizer import IncrementalDetokenizer, Tokenizer
from nitsum.parallel import TPGroup
from nitsum.topology import Group

MAX_REPORTED_HASHES = 1024


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        group: TPGroup | None = None,
        runner: ModelRunner | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`runner` and `tokenizer` may be handed in (a TP change builds the runner from weight views and
        keeps the tokenizer), so that constructing an engine reads nothing from disk."""
        self.cfg = cfg
        self.group = group or TPGroup.single(cfg.device)
        assert self.group.is_leader, "only rank 0 constructs the Engine; peers call run_peer"
        self.runner = runner or _make_runner(cfg, self.group)
        assert self.runner.group.size == self.group.size, "the runner is cut for another TP size"
        self.tokenizer = tokenizer or Tokenizer(cfg.model_dir, read_raw_config(cfg.model_dir))
        self._eos_token_id = self.tokenizer.eos_token_id
        self.model_name = Path(cfg.model_dir).resolve().name
        self.max_model_len = self.runner.max_model_len
        self.block_size = cfg.block_size
        self.kv = KVCacheManager(self.runner.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.role)
        self._seqs: dict[str, Sequence] = {}
        self._rng = random.Random(cfg.seed)
        self._arrivals = 0
        self._step_id = 0
        self._num_prefill_tokens_computed = 0
        self.guides = Guides(cfg.model_dir, self.runner.config.vocab_size, self._eos_token_id)

    # -- requests -----------------------------------------------------------------------------------
    @staticmethod
    def now_ms() -> float:
        """The engine clock (monotonic ms): `RequestSlo.arrival_ms` and the scheduler's deadlines use it."""
        return time.monotonic() * 1000.0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, slo: RequestSlo | None = None
    ) -> None:
        """`slo`: the request's tier and targets; once any request has one the scheduler follows the
        tier-aware order (engine/tiered.py)."""
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.runner.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {request_id!r}: prompt token ids must be integers in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                f"= {total} exceeds the model's maximum context of {self.max_model_len} tokens"
            )
        if self.kv.blocks_for(total) > self.kv.pool.num_blocks:
            raise ValueError(
                f"request {request_id!r}: needs {self.kv.blocks_for(total)} KV blocks, the cache has "
                f"{self.kv.pool.num_blocks}"
            )
        seq = Sequence(request_id, prompt, params, arrival_index=self._arrivals)
        seq.slo = slo
        self._arrivals += 1
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            seq.generator = make_generator(seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
        if params.guide:
            seq.matcher = self.guides.matcher(params.guide)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks now. True if it existed."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def release(self, request_id: str) -> bool:
        """Prefill role: free the pinned KV of a finished request (after its transfer)."""
        self._seqs.pop(request_id, None)
        return self.scheduler.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- moving a request between engines (P/D; TP changes use the same code, see nitsum.node.runtime) -----
    def export_kv(self, request_id: str) -> KVExport:
        """The request's state and its computed KV; the request stays here until `release`/`abort`. TP=1."""
        assert self.group.size == 1, "export_kv reads one rank's cache: TP=1 engines only for now"
        seq = self._seqs.get(request_id)
        if seq is None or not self.kv.has(request_id):
            raise KeyError(f"request {request_id!r} holds no KV here")
        blocks = self.kv.block_table(request_id)[: self.kv.blocks_for(seq.num_computed_tokens)]
        kv = migration.gather_blocks(self.runner.kv_cache, blocks)
        return KVExport(self._state_of(seq), seq.num_computed_tokens, (0, self.runner.config.num_kv_heads), kv)

    def import_request(self, export: KVExport) -> bool:
        """Adopt a request exported by another engine (prompt + first token, KV of the prompt) and decode
        it from there. False when the KV pool has no room now. TP=1 engines."""
        assert self.group.size == 1, "import_request writes one rank's cache: TP=1 engines only for now"
        state = dict(export.state)
        rid = state["id"]
        if rid in self._seqs:
            raise ValueError(f"duplicate request id {rid!r}")
        assert export.heads == (0, self.runner.config.num_kv_heads), "the export must hold every KV head"
        block_ids = self.kv.allocate(rid, export.num_tokens)
        if block_ids is None:
            return False
        migration.scatter_blocks(self.runner.kv_cache, block_ids, export.kv)
        # Whatever the source did with it (a prefill worker pins it), it now decodes from its first token.
        state.update(status=Status.RUNNING.value, computed=export.num_tokens, prefill_target=export.num_tokens)
        group = Group(0, 1)
        placement = Placement(rid, group, group, tuple(block_ids), export.num_tokens)
        self.install_state(state, placement, kv_adopted=True)
        return True

    # -- P/D between groups of one node world (any TP: the KV moves cache to cache, nitsum.node.handoff) ---
    def handoff_source(self, request_id: str) -> tuple[dict, int, list[int]]:
        """(state, KV tokens, the blocks holding them) of a pinned request about to be handed off; any TP."""
        seq = self._seqs.get(request_id)
        if seq is None or not self.kv.has(request_id):
            raise KeyError(f"request {request_id!r} holds no KV here")
        blocks = self.kv.block_table(request_id)[: self.kv.blocks_for(seq.num_computed_tokens)]
        return self._state_of(seq), seq.num_computed_tokens, list(blocks)

    def reserve_handoff(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for a request handed here (its KV is written into them from outside); None: no room now."""
        if request_id in self._seqs or self.kv.has(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        return self.kv.allocate(request_id, num_tokens)

    def drop_handoff(self, request_id: str) -> bool:
        """Free a reservation whose hand-off did not complete. False when there is none."""
        if request_id in self._seqs:
            return False
        return self.kv.free(request_id)

    def adopt_handoff(self, state: dict, num_tokens: int) -> None:
        """Decode a handed-off request whose KV was written into its reserved blocks, from its first token on."""
        rid = state["id"]
        if rid in self._seqs or not self.kv.has(rid):
            raise ValueError(f"request {rid!r} has no reservation here")
        state = {**state, "status": Status.RUNNING.value, "computed": num_tokens, "prefill_target": num_tokens}
        group = Group(0, 1)
        placement = Placement(rid, group, group, tuple(self.kv.block_table(rid)), num_tokens)
        self.install_state(state, placement, kv_adopted=True)

    # -- request state: what a TP change reads and installs (nothing outside engine/ reads its fields) --------
    @property
    def role(self) -> str:
        """ "prefill" (pin each request after its first token), "decode" or "hybrid"."""
        return self.cfg.role

    def set_role(self, role: str) -> None:
        """At a step boundary: requests already admitted finish under the rules they started with."""
        self.cfg = dataclasses.replace(self.cfg, role=role)
        self.scheduler.role = role

    @property
    def step_id(self) -> int:
        """The id of the last step plan this engine broadcast (its peers run plans in this order)."""
        return self._step_id

    def resume_at_step(self, step_id: int) -> None:
        """A new group's engine carries on the step ids of the groups it replaces."""
        self._step_id = step_id

    def _in_order(self) -> list[Sequence]:
        """Running (in scheduling order), then waiting (queue order), then pinned."""
        sched = self.scheduler
        return [*sched.running, *sched.waiting, *sched.pinned.values()]

    def _state_of(self, seq: Sequence) -> dict:
        return request_state.state_of(seq, self.scheduler.prefill_target(seq.request_id), self.now_ms())

    def request_ids(self) -> list[str]:
        """Every request this engine holds (running, waiting or pinned)."""
        return list(self._seqs)

    def num_output_tokens(self) -> dict[str, int]:
        """request id -> tokens it has generated so far."""
        return {rid: seq.num_output_tokens for rid, seq in self._seqs.items()}

    def request_limits(self) -> dict[str, tuple[int, int, float]]:
        """request id -> (prompt tokens, max_tokens, TPOT target ms or 0.0) as this engine runs it (a re-submitted
        request's prompt holds the tokens it had streamed before; its max_tokens is what was left then)."""
        return {
            rid: (len(seq.prompt_token_ids), seq.params.max_tokens, seq.slo.tpot_ms if seq.slo is not None else 0.0)
            for rid, seq in self._seqs.items()
        }

    def num_preemptions(self, request_id: str) -> int | None:
        """How often the request was preempted; None when this engine does not hold it."""
        seq = self._seqs.get(request_id)
        return seq.num_preemptions if seq is not None else None

    def preemption_counts(self) -> dict[str, int]:
        """request id -> preemptions, for every request in scheduling order."""
        return {s.request_id: s.num_preemptions for s in self._in_order()}

    def export_state(self, request_id: str) -> dict:
        """One request's full state (a msgpack-ready dict: `request_state.state_of`). KeyError if not here."""
        return self._state_of(self._seqs[request_id])

    def export_states(self) -> list[dict]:
        """Every request's full state, in scheduling order."""
        return [self._state_of(s) for s in self._in_order()]

    def snapshot_kv(self, group: Group) -> list[RequestKV]:
        """Every request's block table and computed tokens, as `group` holds them, in scheduling order."""
        kv = self.kv
        return [
            RequestKV(
                s.request_id,
                group,
                s.num_computed_tokens if kv.has(s.request_id) else 0,
                tuple(kv.block_table(s.request_id)) if kv.has(s.request_id) else (),
            )
            for s in self._in_order()
        ]

    def install_states(self, states: SequenceABC[dict], placements: dict[str, Placement]) -> None:
        """Adopt moved requests (`export_states` of the old engines), in order, with the tables the plan chose.
        A request placed with `recompute` re-queues like a preempted one."""
        for state in states:
            self.install_state(state, placements.get(state["id"]))

    def install_state(self, state: dict, placement: Placement | None, kv_adopted: bool = False) -> None:
        """Adopt one request; `kv_adopted`: its table is already allocated in `self.kv`."""
        rid = state["id"]
        if rid in self._seqs:
            raise ValueError(f"duplicate request id {rid!r}")
        seq = request_state.sequence_of(state, self._arrivals, self.tokenizer, self.guides, self.now_ms())
        self._arrivals += 1
        status = Status(state["status"])
        has_kv = placement is not None and not placement.recompute and bool(placement.dst_block_ids)
        if status in (Status.RUNNING, Status.PINNED) and has_kv:
            assert placement is not None
            assert placement.num_moved_tokens == state["computed"], (
                f"{rid}: {placement.num_moved_tokens} KV tokens moved but {state['computed']} computed"
            )
            if not kv_adopted:
                self.kv.adopt(rid, placement.dst_block_ids)
            seq.num_computed_tokens = state["computed"]
            self.kv.commit(rid, seq.token_ids, seq.num_computed_tokens)
            seq.status = status
        elif status is Status.WAITING:
            seq.status = Status.WAITING
        else:
            # No KV came along (no room in the new pool): recompute, as after a preemption.
            seq.num_computed_tokens = 0
            seq.num_preemptions += 1
            seq.status = Status.WAITING
        self._seqs[rid] = seq
        self.scheduler.adopt(seq, state["prefill_target"])

    # -- stage-1 KV reuse: cached prefix blocks between engines ------------------------------------------
    def export_cached_blocks(self, block_hashes: list[int]):
        """(hashes found, KV [layers, K/V, n, block_size, kv_heads, head_dim] on CPU) for the longest leading
        run of `block_hashes` this engine has cached. TP=1 engines."""
        assert self.group.size == 1, "export_cached_blocks reads one rank's cache: TP=1 engines only"
        block_ids = self.kv.cached_prefix(block_hashes)
        return list(block_hashes[: len(block_ids)]), migration.gather_blocks(self.runner.kv_cache, block_ids)

    def import_cached_blocks(self, block_hashes: list[int], kv) -> int:
        """Adopt another engine's cached prefix blocks (`kv` as `export_cached_blocks` returns it) into this
        engine's prefix cache, so a later request with that prefix computes only the rest. Blocks already
        cached here are skipped; stops when the pool is full. Returns the number of blocks written."""
        assert self.group.size == 1, "import_cached_blocks writes one rank's cache: TP=1 engines only"
        assert kv.shape[2] == len(block_hashes), f"{kv.shape[2]} blocks of KV for {len(block_hashes)} hashes"
        reserved = self.kv.reserve_import(block_hashes)
        if not reserved:
            return 0
        migration.scatter_blocks(self.runner.kv_cache, [b for _, b in reserved], kv, [p for p, _ in reserved])
        self.kv.finish_import([b for _, b in reserved])
        return len(reserved)

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. Returns an output for every request that got a new token (or finished)."""
        started_ms = self.now_ms()
        scheduled = self.scheduler.schedule(started_ms)
        if not scheduled.chunks:
            return []
        plan = self._plan(scheduled)
        if self.group.size > 1:
            self.group.broadcast_bytes(plan.encode())
        logits = self.runner.execute(plan)
        sampled = [c.seq for c in scheduled.chunks if c.sample]
        histories = [(s.token_ids, s.num_prompt_tokens) if s.params.processes_logits else None for s in sampled]
        masks = [self._mask(s, logits.shape[-1]) for s in sampled]
        tokens = sample_detailed(logits, [s.params for s in sampled], [s.generator for s in sampled], histories, masks)
        self.scheduler.step_cost.observe(scheduled.num_tokens, self.now_ms() - started_ms)

        self.scheduler.update_after_step(scheduled)
        self._num_prefill_tokens_computed += sum(c.num_prefill_tokens for c in scheduled.chunks)
        return [self._append_token(seq, token) for seq, token in zip(sampled, tokens)]

    def _mask(self, seq: Sequence, vocab: int):
        """Bool [vocab] of the tokens this request may take next (None: any): its grammar's, less EOS and its
        stop tokens while it has fewer than min_tokens."""
        mask = allowed(seq.matcher, vocab) if seq.matcher is not None else None
        if seq.params.min_tokens and seq.num_output_tokens < seq.params.min_tokens:
            import torch

            mask = torch.ones(vocab, dtype=torch.bool) if mask is None else mask.clone()
            for token in (self._eos_token_id, *seq.params.stop_token_ids):
                if token is not None and token < vocab:
                    mask[token] = False
        return mask

    def _plan(self, scheduled: SchedulerOutput) -> StepPlan:
        self._step_id += 1
        chunks = tuple(
            ChunkPlan(
                token_ids=tuple(c.seq.token_ids[c.start_pos : c.start_pos + c.num_tokens]),
                start_pos=c.start_pos,
                block_table=tuple(self.kv.block_table(c.seq.request_id)),
                sample=c.sample,
            )
            for c in scheduled.chunks
        )
        return StepPlan(kind=PLAN_KIND_STEP, step_id=self._step_id, chunks=chunks)

    def _append_token(self, seq: Sequence, sampled: Sampled) -> RequestOutput:
        token = sampled.token
        params = seq.params
        seq.token_ids.append(token)
        finish = None
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
        if token in params.stop_token_ids or (token == self._eos_token_id and not params.ignore_eos):
            finish = "stop"  # the stop token's id is returned, its text is not
        else:
            delta = seq.detokenizer.add(token)
            if delta:
                seq.text += delta
                if params.stop and self._cut_stop_string(seq, len(delta)):
                    finish = "stop"
        if finish is None and seq.matcher is not None and seq.matcher.is_stopped():
            finish = "stop"  # the document is complete: the grammar allows nothing but its end
        if finish is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            finish = "length"
            tail = seq.detokenizer.flush()
            if tail:
                seq.text += tail
                if params.stop and self._cut_stop_string(seq, len(tail)):
                    finish = "stop"

        # Only at a request's first token here: one that was past it when its group turned prefill (a role
        # change) finishes under the rules it started with.
        pin = self.cfg.role == "prefill" and seq.num_output_tokens == 1
        if pin and finish is None:
            finish = "length"  # a prefill worker's request ends at its first token
        finished = finish is not None
        if finished:
            emit_to = len(seq.text)
        else:
            # Hold back what could still become a stop string.
            hold = max(len(s) for s in params.stop) - 1 if params.stop else 0
            emit_to = max(seq.num_text_emitted, len(seq.text) - hold)
        text_delta = seq.text[seq.num_text_emitted : emit_to]
        seq.num_text_emitted = emit_to
        if finished:
            seq.finish_reason = finish  # type: ignore[assignment]
            if pin:
                self.scheduler.pin(seq)
            else:
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=(token,),
            text_delta=text_delta,
            finished=finished,
            finish_reason=finish,  # type: ignore[arg-type]
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            logprob=sampled.logprob,
            top_logprobs=sampled.top,
        )

    @staticmethod
    def _cut_stop_string(seq: Sequence, delta_len: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(seq.text) - delta_len - longest + 1)
        hits = [i for i in (seq.text.find(s, search_from) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        seq.num_text_emitted = min(seq.num_text_emitted, len(seq.text))
        return True

    # -- introspection ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=self.kv.pool.num_blocks,
            num_kv_blocks_free=self.kv.num_free_blocks,
            num_prefill_tokens_computed=self._num_prefill_tokens_computed,
            num_cached_prompt_tokens=self.scheduler.num_cached_prompt_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_pinned=len(self.scheduler.pinned),
            cached_block_hashes=self.kv.pool.cached_hashes(MAX_REPORTED_HASHES),
        )

    def check_integrity(self, quick: bool = False) -> None:
        self.scheduler.check_integrity(quick)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | SequenceABC[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; returns each one's generated token ids, in prompt order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        assert len(per_prompt) == len(prompts), "one SamplingParams per prompt"
        base = f"generate-{self._arrivals}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, per_prompt):
            self.add_request(rid, prompt, p)
        pending = set(ids)
        while pending:
            outputs = self.step()
            assert outputs or self.has_unfinished(), "engine stalled with requests pending"
            for out in outputs:
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
                        if self.cfg.role == "prefill":
                            self.release(out.request_id)
        return [results[rid] for rid in ids]

    def shutdown(self) -> None:
        """Tell TP peers to stop (no-op at TP=1)."""
        if self.group.size > 1:
            self.group.broadcast_bytes(StepPlan(kind=PLAN_KIND_SHUTDOWN, step_id=self._step_id + 1).encode())


def _make_runner(cfg: EngineConfig, group: TPGroup) -> ModelRunner:
    return ModelRunner(
        cfg.model_dir,
        group,
        device=cfg.device,
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks,
        kv_cache_mb=cfg.kv_cache_mb,
        decode_attention=cfg.decode_attention,
    )


def run_peer(cfg: EngineConfig, group: TPGroup, runner: ModelRunner | None = None) -> int:
    """A non-leader rank: run every plan the leader broadcasts until it says shutdown. Returns steps run."""
    assert not group.is_leader, "rank 0 leads; it constructs Engine instead"
    runner = runner or _make_runner(cfg, group)
    num_steps = 0
    while True:
        plan = StepPlan.decode(group.broadcast_bytes(None))
        if plan.kind == PLAN_KIND_SHUTDOWN:
            return num_steps
        runner.execute(plan)
        num_steps += 1
