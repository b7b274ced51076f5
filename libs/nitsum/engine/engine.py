"""The worker's engine: scheduler + model runner + sampler + detokenizer, one `step()` at a time.

Threading: the engine is not thread-safe. `step()` may run in a worker thread, but `add_request`,
`abort` and `release` must not run while a `step()` is in progress (serialise them, e.g. with one lock
or an inbox drained between steps). Everything else is plain single-threaded state.

TP>1: the leader (rank 0) constructs `Engine(cfg, group)`; every other rank runs `run_peer(cfg, group)`,
which executes the plans the leader broadcasts until `Engine.shutdown()`.

Moving requests between engines (P/D, hand-offs, TP changes, cached prefix blocks) is the `RequestMoves`
mixin in moves.py.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence as SequenceABC
from pathlib import Path

from nitsum.engine.guided import Guides, allowed
from nitsum.engine.moves import RequestMoves
from nitsum.engine.params import EngineConfig, EngineStats, RequestOutput, SamplingParams
from nitsum.engine.plan import PLAN_KIND_SHUTDOWN, PLAN_KIND_STEP, ChunkPlan, StepPlan
from nitsum.engine.runner import ModelRunner
from nitsum.engine.sampling import Sampled, make_generator, sample_detailed
from nitsum.engine.scheduler import Scheduler, SchedulerOutput
from nitsum.engine.sequence import Sequence
from nitsum.engine.slo import RequestSlo
from nitsum.kv import KVCacheManager
from nitsum.model.loader import read_raw_config
from nitsum.model.tokenizer import IncrementalDetokenizer, Tokenizer
from nitsum.parallel import TPGroup

MAX_REPORTED_HASHES = 1024


class Engine(RequestMoves):
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

    @property
    def num_prefill_tokens_computed(self) -> int:
        """Prompt (and recomputed) tokens run through the model so far (cumulative)."""
        return self._num_prefill_tokens_computed

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
