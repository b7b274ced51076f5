"""One request's life at the gateway: submit, receive token chunks, re-route on worker loss.

Chunks carry the output index of their first token, so the gateway keeps exactly one copy of every
token: duplicates (a chunk replayed after a re-route) are cut, and a gap (a lost chunk) re-submits the
request from the last token it holds. A worker that is lost, stops, or goes silent for
NITSUM_STREAM_TIMEOUT_S gets the request re-submitted with the prompt and the tokens so far, to
another worker, up to NITSUM_MAX_REROUTES times; after that the client gets a clear error.

Frames are taken only from the worker the coordinator placed the request on, or from one of the
successors it named (the P/D decode worker, the workers of those nodes: a TP change's new group leader),
and only when the frame's subject names the same worker as its `worker_id` (with per-worker NATS
identities a worker can publish under its own id only). Anything else is dropped and counted in
nitsum_dropped_frames_total{code="foreign_stream_frame"}.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from nitsum.bus import Bus, BusError, NoResponders
from nitsum.wire.messages import AbortRequest, SamplingSpec, SubmitReply, SubmitRequest, TokenChunk

log = logging.getLogger("nitsum.gateway")

# overload_pruned: the flow-scheduler pruned the request before its prefill (its TTFT cannot be met there)
RETRYABLE_CODES = frozenset({"worker_stopping", "engine_error", "worker_lost", "overload_pruned"})


class GenerationError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    # When logprobs were asked: one (token id, logprob, ((id, logprob), ...)) per token in token_ids.
    logprobs: list | None = None


@dataclass
class Generation:
    bus: Bus
    request: SubmitRequest
    stream_timeout_s: float
    max_reroutes: int
    submit_timeout_s: float
    registry: GenerationRegistry
    tokens: list[int] = field(default_factory=list)
    worker_id: str = ""
    reroutes: int = 0
    left_workers: set[str] = field(default_factory=set)
    successors: set[str] = field(default_factory=set)
    on_foreign_frame: object = None  # called with the sender of a frame that is not taken
    on_single_frame: object = None  # called (no argument) for each frame on the request's own stream subject
    num_cached_prompt_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    # Called with the silence (ms) a stream saw across a hand-off to another worker (TP change, P/D).
    on_handoff_gap: object = None
    finished: bool = False
    finish_reason: str = ""
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _sub: object = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def start(self) -> None:
        """Subscribe to the stream, then submit; raises GenerationError when the mesh refuses."""

        async def on_chunk(chunk: TokenChunk, delivery) -> None:
            if self.on_single_frame is not None:
                self.on_single_frame()
            self.take(chunk, self.bus.subjects.stream_sender(delivery.subject) or delivery.subject)

        self._sub = await self.bus.subscribe(self.bus.subjects.stream(self.request_id), on_chunk, expected=TokenChunk)
        self.registry.add(self)
        try:
            await self._submit(self.request)
        except GenerationError:
            await self.close()
            raise

    def take(self, chunk: TokenChunk, sender: str) -> None:
        """A chunk from `sender` (the worker its subject names): on its own stream subject, or in a batch
        on the gateway's frames subject (FrameDispatcher). Both see the same checks."""
        if sender != chunk.worker_id or chunk.request_id != self.request_id:
            self._foreign(sender)
            return
        self._queue.put_nowait(chunk)

    async def _submit(self, request: SubmitRequest, ride_out: bool = False) -> None:
        """Place `request` through the coordinator. With `ride_out` (a re-route of a stream already under way)
        a moment with no coordinator listening (it is reconnecting to another NATS server of the cluster, or
        restarting) is waited out, up to submit_timeout_s in all, instead of failing a started stream."""
        deadline = time.monotonic() + self.submit_timeout_s
        pause = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                reply: SubmitReply = await self.bus.request(
                    self.bus.subjects.submit, request, max(0.1, left), expected=SubmitReply
                )
                break
            except NoResponders as exc:
                if not ride_out or left <= pause:
                    raise GenerationError(
                        503, "coordinator_unavailable", f"the coordinator did not answer: {exc}", retry_after_s=1.0
                    ) from None
                log.info("%s: no coordinator listens (failover?); submitting again in %.2f s", self.request_id, pause)
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)
            except BusError as exc:
                raise GenerationError(
                    503, "coordinator_unavailable", f"the coordinator did not answer: {exc}", retry_after_s=1.0
                ) from None
        if not reply.accepted:
            code = {429: "rate_limited", 503: "no_capacity", 400: "invalid_request"}.get(reply.status, "rejected")
            raise GenerationError(reply.status or 503, code, reply.reason, retry_after_s=reply.retry_after_s)
        self.worker_id = reply.worker_id
        # A stream may come back to the worker it left (merged into a TP group, then split again).
        self.successors = set(reply.successors) | {reply.worker_id}
        self.registry.moved(self)

    def _foreign(self, sender: str) -> None:
        log.warning(
            "%s: dropped a stream frame from %s (not the worker placed on or its successor)", self.request_id, sender
        )
        if self.on_foreign_frame is not None:
            self.on_foreign_frame(sender)

    def worker_lost(self) -> None:
        self._queue.put_nowait("worker_lost")

    async def deltas(self):
        """Yield Delta objects until the request finishes; raises GenerationError on a final failure."""
        while not self.finished:
            try:
                item = await self._next_item()
            except TimeoutError:
                await self._reroute(
                    "worker_silent", f"no token from {self.worker_id} for {self.stream_timeout_s:.0f} s"
                )
                continue
            if item == "worker_lost":
                await self._reroute("worker_lost", f"worker {self.worker_id} was lost")
                continue
            chunk: TokenChunk = item
            if chunk.attempt >= 0 and chunk.attempt != self.reroutes:
                continue  # a late frame of an earlier attempt (re-routed, possibly to the same worker)
            if chunk.worker_id != self.worker_id:
                # A worker this request was re-routed away from may still send late chunks: never take them.
                # Any other worker continuing exactly where we are is a hand-off (a TP change moved the
                # request to its new group leader): follow it.
                if chunk.worker_id not in self.successors:
                    self._foreign(chunk.worker_id)
                    continue
                if chunk.worker_id in self.left_workers or chunk.index != len(self.tokens):
                    continue
                self.worker_id = chunk.worker_id
                self.registry.moved(self)
                if self.last_token_s is not None and self.on_handoff_gap is not None:
                    self.on_handoff_gap((time.monotonic() - self.last_token_s) * 1000.0)
                trace.get_current_span().add_event(
                    "handed_off", {"nitsum.to_worker": chunk.worker_id, "nitsum.tokens_so_far": len(self.tokens)}
                )
            if chunk.error_code:
                if chunk.error_code in RETRYABLE_CODES:
                    await self._reroute(chunk.error_code, chunk.error_message)
                    continue
                self.finished = True
                status = {"invalid_request": 400, "shed": 503}.get(chunk.error_code, 500)
                raise GenerationError(
                    status, chunk.error_code, chunk.error_message, retry_after_s=1.0 if status == 503 else 0.0
                )
            have = len(self.tokens)
            if chunk.index > have:
                await self._reroute("stream_gap", f"tokens {have}..{chunk.index - 1} were lost in transit")
                continue
            skip = have - chunk.index
            fresh = list(chunk.token_ids[skip:])
            logprobs = _logprob_entries(chunk, skip) if self.request.sampling.logprobs >= 0 else None
            self.num_cached_prompt_tokens = max(self.num_cached_prompt_tokens, chunk.num_cached_prompt_tokens)
            if fresh and self.first_token_s is None:
                self.first_token_s = time.monotonic()
            if fresh:
                self.last_token_s = time.monotonic()
            self.tokens.extend(fresh)
            text = chunk.text if chunk.index == have else ""
            if chunk.finished:
                self.finished = True
                self.finish_reason = chunk.finish_reason or "stop"
            if fresh or chunk.finished:
                yield Delta(fresh, text, self.finish_reason if chunk.finished else None, logprobs)

    async def _next_item(self):
        """The next chunk (or "worker_lost"); TimeoutError after stream_timeout_s of silence. A chunk already
        queued is taken at once, and the wait is a timeout scope, not wait_for's extra task per token."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            async with asyncio.timeout(self.stream_timeout_s):
                return await self._queue.get()

    async def _reroute(self, code: str, why: str) -> None:
        old = self.worker_id
        self.left_workers.add(old)
        await self._abort_at(old, f"rerouted: {code}")
        if self.reroutes >= self.max_reroutes:
            self.finished = True
            raise GenerationError(503, code, f"{why}; gave up after {self.reroutes} re-route(s)", retry_after_s=1.0)
        if self.request.sampling.guide and self.tokens:
            # Another worker would start the grammar afresh on prompt + output: the document could not be valid.
            self.finished = True
            raise GenerationError(
                503,
                code,
                f"{why}; a response_format request cannot resume on another worker after {len(self.tokens)} token(s)",
                retry_after_s=1.0,
            )
        self.reroutes += 1
        remaining = self.request.sampling.max_tokens - len(self.tokens)
        if remaining <= 0:
            self.finished = True
            self.finish_reason = "length"
            return
        log.warning("re-routing %s (%s): %s", self.request_id, code, why)
        trace.get_current_span().add_event(
            "rerouted",
            {
                "nitsum.reason": code,
                "nitsum.detail": why,
                "nitsum.from_worker": old,
                "nitsum.tokens_so_far": len(self.tokens),
            },
        )
        resubmit = replace(
            self.request,
            sampling=replace(
                self.request.sampling,
                max_tokens=remaining,
                min_tokens=max(0, self.request.sampling.min_tokens - len(self.tokens)),
            ),
            output_token_ids=tuple(self.tokens),
            attempt=self.reroutes,
            exclude_workers=(old,) if old else (),
        )
        try:
            await self._submit(resubmit, ride_out=True)
        except GenerationError as exc:
            if exc.status == 503 and old and exc.code != "coordinator_unavailable":
                # The only other choice may be the worker we left (it came back): allow it.
                await self._submit(replace(resubmit, exclude_workers=()), ride_out=True)
            else:
                raise

    async def _abort_at(self, worker_id: str, reason: str) -> None:
        if not worker_id:
            return
        try:
            # Aimed at the worker we leave, so that it cannot hit the request's new home.
            await self.bus.publish(
                self.bus.subjects.abort,
                AbortRequest(self.request_id, reason, worker_id=worker_id if worker_id != "?" else ""),
            )
        except Exception as exc:  # best effort: the worker also stops when its stream has no reader
            log.debug("abort of %s not sent: %s", self.request_id, exc)

    async def abort(self, reason: str) -> None:
        if not self.finished:
            self.finished = True
            # Shielded: a second cancellation of the handler (client gone) must not lose the abort.
            await asyncio.shield(self._abort_at(self.worker_id or "?", reason))

    async def close(self) -> None:
        self.registry.remove(self)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # the connection may be closing
                log.debug("unsubscribe failed: %s", exc)
            self._sub = None


class GenerationRegistry:
    """Which generations run on which worker, so that a WorkerLost event reaches them."""

    def __init__(self) -> None:
        self.by_id: dict[str, Generation] = {}

    def add(self, gen: Generation) -> None:
        self.by_id[gen.request_id] = gen

    def moved(self, gen: Generation) -> None:
        self.by_id[gen.request_id] = gen

    def remove(self, gen: Generation) -> None:
        self.by_id.pop(gen.request_id, None)

    def on_worker_lost(self, worker_id: str) -> int:
        hit = 0
        for gen in list(self.by_id.values()):
            if gen.worker_id == worker_id and not gen.finished:
                gen.worker_lost()
                hit += 1
        return hit

    def __len__(self) -> int:
        return len(self.by_id)


def _logprob_entries(chunk: TokenChunk, skip: int) -> list:
    k = chunk.top_k
    entries = []
    for i in range(skip, len(chunk.token_ids)):
        logprob = chunk.logprobs[i] if i < len(chunk.logprobs) else None
        if logprob is None:
            raise GenerationError(
                500, "engine_error", f"worker {chunk.worker_id} sent tokens without the logprobs asked for"
            )
        top = tuple(zip(chunk.top_logprob_ids[i * k : (i + 1) * k], chunk.top_logprob_values[i * k : (i + 1) * k]))
        entries.append((chunk.token_ids[i], logprob, top))
    return entries


def make_sampling(spec: SamplingSpec, max_tokens: int) -> SamplingSpec:
    return replace(spec, max_tokens=max_tokens)
