"""The worker's async half: feeds requests into the engine, steps it in a thread, streams tokens out.

The engine is not thread-safe, so the event loop never touches it while a step runs: adds, aborts and
topology commands go into an inbox that the step thread applies right before each step. A worker that
is a peer in a TP>1 group takes no requests: its thread follows the group leader's step plans. A
topology commit can turn a leader into a peer (its requests now live with the new leader) or a peer into
a leader (it adopts the requests moved to it and streams their tokens from the next index on).

P/D: on a prefill worker (engine role "prefill") a request with a decode worker ends its run here after the
first token; the session publishes that token as not finished and hands the request to `on_handoff` (the
KV mover ships it). On the decode worker the mover `adopt`s it and this session streams it from index 1.
`call` runs a function on the backend in the step thread (KV exports and imports), between steps.
A TP transition's pre-copy (node backend) also runs in the step thread: before each step, one chunk of
every migration flow that has its permit (`backend.precopy_tick`), so the old group keeps decoding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from opentelemetry import trace

from nitsum.bus import Bus
from nitsum.telemetry.metrics import Metrics
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import RunRequest, SubmitRequest
from nitsum_services.worker.holds import StepHolds
from nitsum_services.worker.prefill_admission import PrefillCost
from nitsum_services.worker.publisher import FramePublisher
from nitsum_services.worker.running import Running, outputs_by_request
from nitsum_services.worker.step_thread import StepInbox, StepThread

log = logging.getLogger("nitsum.worker")

# Streams ended and not yet reported after which the worker's heartbeat goes out early: far below any queue
# bound (the coordinator counts a request until it hears its stream ended), and a light load never reaches it.
ENDED_REPORT_AT = 32


class WorkerSession:
    # Aborts for these reasons end the stream with an error chunk (the client must hear why); the others
    # (client gone, request moved elsewhere) end it silently.
    TOLD_REASONS = ("shed", "admin")

    def __init__(
        self, backend, bus: Bus, worker_id: str, metrics: Metrics, tracer: trace.Tracer, decode_turn_ms: float = 0.0
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.metrics = metrics
        self.tracer = tracer
        self.running: dict[str, Running] = {}
        self._wake = asyncio.Event()
        self.inbox = StepInbox(self._wake)
        self.step_ms_ewma = 0.0
        # Measured prefill cost (the turns that computed prompt tokens): the prefill-admission report's estimate
        self.prefill_cost = PrefillCost()
        self.holds = StepHolds()
        self.num_aborted = 0
        self._ended: list[tuple[str, int]] = []  # (request id, attempt) ended here since the last heartbeat
        # set once ENDED_REPORT_AT of them wait: the heartbeat then goes out early (WorkerService.heartbeat)
        self.many_ended = asyncio.Event()
        self._stats = backend.stats()
        self.step_thread = StepThread(backend, self.inbox, self.holds, decode_turn_ms)
        self.backend = backend
        self.on_topology_change = None  # async callback after a commit changed this worker's group
        self.on_handoff = None  # P/D: callback(Running) once a prefill finished; it owns the request then
        # callback(request id) once a request's prefill is over here: its first token went out, or it ended or
        # was aborted before that (the prefill-admission report: it is no longer pending at the flow-scheduler)
        self.on_prefill_over = None
        self._held: dict[str, SubmitRequest] = {}  # accepted, waiting for a stage-1 prefix fetch
        # Request id -> tokens it had streamed when it was re-submitted (its engine counts from there): an
        # adopted one continues its stream at engine count + offset (StreamOffset from the coordinator).
        self.stream_offsets: OrderedDict[str, int] = OrderedDict()
        self._handoffs: set[asyncio.Task] = set()
        self.publisher = FramePublisher(bus, worker_id)  # token frames go out from its task, not the step loop

    # ---- called from the event loop -------------------------------------------------------------

    @property
    def backend(self):
        return self._backend

    @backend.setter
    def backend(self, backend) -> None:
        """The worker's backend, replaced when it joins or leaves a node world: the step thread takes the new one."""
        self._backend = backend
        self.step_thread.backend = backend

    @property
    def prefill_role(self) -> bool:
        """The engine pins every finished request (release it after its hand-off)."""
        engine = self.backend.engine
        return engine is not None and engine.role == "prefill"

    @property
    def world_prefill(self) -> bool:
        """A prefill group of a node world: every request it pins at its first token goes to a decode group of
        the world (the coordinator's choice when it named one, else the node's)."""
        return self.backend.in_world and self.prefill_role

    def validate(self, run: RunRequest) -> str:
        """Why this request cannot run here ("" when it can)."""
        req = run.request
        if not self.backend.is_leader:
            return "not a group leader"
        if req.request_id in self.running:
            return "duplicate request id"
        total = len(req.prompt_token_ids) + len(req.output_token_ids) + req.sampling.max_tokens
        if total > self.backend.max_model_len:
            return f"prompt + max_tokens = {total} exceeds the model context of {self.backend.max_model_len}"
        if not req.prompt_token_ids:
            return "empty prompt"
        return ""

    def submit(self, run: RunRequest, hold: bool = False) -> None:
        """Accept a request; with `hold` it waits (listed as running) until `start_held` (a prefix fetch)."""
        req = run.request
        span = self.tracer.start_span(
            "worker.generate",
            attributes={
                "nitsum.request_id": req.request_id,
                "nitsum.worker": self.worker_id,
                "nitsum.tier": req.tier,
                "nitsum.prompt_tokens": len(req.prompt_token_ids),
                "nitsum.resumed_tokens": len(req.output_token_ids),
                "nitsum.attempt": req.attempt,
            },
        )
        self.running[req.request_id] = Running(
            req.request_id,
            self.stream_subject(req.request_id, req.stream_subject),
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            span,
            decode_worker=run.decode_worker,
            max_tokens=len(req.output_token_ids) + req.sampling.max_tokens,  # in stream indices, as next_index
            tpot_ms=req.tpot_ms,
            attempt=req.attempt,
            since=self.inbox.put_count,
        )
        if hold:
            self._held[req.request_id] = req
        else:
            self.inbox.put(("add", req))

    def start_held(self, request_id: str) -> None:
        req = self._held.pop(request_id, None)
        if req is not None and request_id in self.running:
            self.running[request_id].since = self.inbox.put_count
            self.inbox.put(("add", req))

    def call(self, fn) -> asyncio.Future:
        """Run `fn(backend)` in the step thread at the next step boundary; the future gets its result."""
        future = asyncio.get_running_loop().create_future()
        self.inbox.put(("call", (fn, future)))
        return future

    def release_pinned(self, request_id: str) -> None:
        self.inbox.put(("release", request_id))

    def _ended_here(self, request_id: str, attempt: int) -> None:
        self._ended.append((request_id, attempt))
        if len(self._ended) >= ENDED_REPORT_AT:
            self.many_ended.set()

    def take_ended(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The (request ids, attempts) whose streams ended here since the last call (WorkerStats.finished_*)."""
        ended, self._ended = self._ended, []
        self.many_ended.clear()
        return tuple(r for r, _ in ended), tuple(a for _, a in ended)

    def handed_off(self, request_id: str) -> None:
        """P/D: the decode worker owns the request now; this worker stops tracking it."""
        state = self.running.pop(request_id, None)
        if state is not None:
            state.span.end()

    async def fail(self, request_id: str, code: str, message: str) -> None:
        await self._finish_error(request_id, code, message)

    def adopt(self, request_id: str, stream_subject: str, prompt_len: int, produced: int, attempt: int = -1) -> None:
        """P/D decode side: stream an imported request from output index `produced` on, its frames marked with
        the attempt the prefill worker served (so a gateway that re-routed it meanwhile drops them)."""
        span = self.tracer.start_span(
            "worker.generate",
            attributes={"nitsum.request_id": request_id, "nitsum.worker": self.worker_id, "nitsum.imported": True},
        )
        self.running[request_id] = Running(
            request_id,
            self.stream_subject(request_id, stream_subject),
            prompt_len,
            produced,
            span,
            attempt=attempt,
            since=self.inbox.put_count,  # its import is put next
        )

    def stream_subject(self, request_id: str, given: str) -> str:
        """Where this worker sends a request's frames: always under its own id (its NATS identity may publish
        only there), to the gateway's batched frames subject when `given` (the request's stream subject) names
        one, else to the request's own stream subject."""
        gateway = self.bus.subjects.frames_gateway(given)
        if gateway:
            return self.bus.subjects.gateway_frames(gateway, self.worker_id)
        return self.bus.subjects.stream(request_id, self.worker_id)

    def forget(self, request_id: str) -> None:
        state = self.running.pop(request_id, None)
        if state is not None:
            mark_error(state.span, "import failed")
            state.span.end()
            self._prefill_over(request_id)

    def control(self, command) -> asyncio.Future:
        """Queue a topology command for the next step boundary; the future resolves to its ack."""
        future = asyncio.get_running_loop().create_future()
        self.inbox.put(("control", (command, future)))
        return future

    def wake(self) -> None:
        """Event loop: run an iteration soon even if idle (e.g. a pre-copy flow was just allowed)."""
        self._wake.set()

    def abort(self, request_id: str, reason: str) -> bool:
        state = self.running.get(request_id)
        if state is None:
            return False
        if reason.split(":")[0] == "shed" and state.first_token_s is not None:
            # The coordinator hears of first tokens a heartbeat late: a request already streaming is never shed.
            return False
        if reason.split(":")[0] in self.TOLD_REASONS:
            chunk = state.error_chunk(self.worker_id, reason, f"the request was {reason}: it cannot meet its SLO")
            self.publisher.send(state.stream_subject, chunk)
        self._drop(state, reason)
        return True

    def prune(self, request_id: str, reason: str) -> bool:
        """The flow-scheduler pruned this request before its prefill (its TTFT deadline cannot be met here): end
        its stream with the retryable `overload_pruned` (the gateway re-submits it, the coordinator re-plans it)
        and drop it from the engine. False (nothing changes) once its first token went out, or if it is not here."""
        state = self.running.get(request_id)
        if state is None or state.first_token_s is not None:
            return False
        message = f"overload_pruned: {reason}"
        self.publisher.send(state.stream_subject, state.error_chunk(self.worker_id, "overload_pruned", message))
        self._drop(state, "overload_pruned")
        return True

    def _drop(self, state: Running, reason: str) -> None:
        request_id = state.request_id
        self.running.pop(request_id, None)
        self._ended_here(request_id, state.attempt)
        self._held.pop(request_id, None)
        self.inbox.put(("abort", request_id))
        self.num_aborted += 1
        self.metrics.aborted_requests_total().labels(reason=reason.split(":")[0]).inc()
        mark_error(state.span, f"aborted: {reason}")
        state.span.end()
        self._prefill_over(request_id)

    def _prefill_over(self, request_id: str) -> None:
        if self.on_prefill_over is not None:
            self.on_prefill_over(request_id)

    def progress(self, now_s: float) -> tuple[tuple[str, ...], tuple[int, ...], tuple[float, ...]]:
        """(running request ids, tokens each has streamed, ms since each one's first token or -1), aligned:
        what WorkerStats carries so the coordinator's snapshot knows decode progress and first-token times."""
        states = list(self.running.values())
        return (
            tuple(r.request_id for r in states),
            tuple(r.next_index for r in states),
            tuple(-1.0 if r.first_token_s is None else (now_s - r.first_token_s) * 1000.0 for r in states),
        )

    def stats(self):
        return self._stats

    @property
    def idle(self) -> bool:
        return not self.running and not self.inbox and not self._handoffs

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            if (
                self.backend.is_leader
                and not self.inbox
                and not self.backend.has_unfinished()
                and not self.backend.precopy_active
            ):
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                except TimeoutError:
                    if getattr(self.backend, "in_world", False):
                        await loop.run_in_executor(None, self.backend.idle_tick)
                    continue
            leader_before = self.backend.is_leader
            engine = getattr(self.backend, "engine", None)  # (a bare NodeBackend has none)
            prefilled = engine.num_prefill_tokens_computed if engine is not None else 0
            t0 = time.perf_counter()
            try:
                outputs, rejected, self._stats, acks, _kind, calls = await loop.run_in_executor(
                    None, self.step_thread.turn
                )
            except Exception as exc:  # an engine failure fails the requests in flight, loudly
                log.exception("engine step failed")
                await self.fail_all("engine_error", f"{type(exc).__name__}: {exc}")
                continue
            # per engine step (a turn may run several decode steps back to back: NITSUM_DECODE_TURN_MS)
            step_ms = (time.perf_counter() - t0) * 1000.0 / max(1, self.step_thread.last_turn_steps)
            if outputs:
                self.step_ms_ewma = step_ms if self.step_ms_ewma == 0 else 0.9 * self.step_ms_ewma + 0.1 * step_ms
                self.holds.recent_step_ms.append(step_ms)
            same = engine is not None and engine is getattr(self.backend, "engine", None)
            computed = engine.num_prefill_tokens_computed - prefilled if same else 0
            if computed > 0:
                self.prefill_cost.add(computed, (time.perf_counter() - t0) * 1000.0)
            for future, ack in acks:
                if future is not None and not future.done():
                    future.set_result(ack)
            for future, result, error in calls:
                if not future.done():
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(result)
            if acks and any(a.phase == "commit" and a.ok for _, a in acks):
                await self._after_commit(leader_before)
            if acks and any(a.phase == "prepare" and a.pending for _, a in acks):
                await self.holds.await_permits(self.backend, self._wake)
            if self.step_thread.hold_for_commit:
                self.step_thread.hold_for_commit = False
                await self.holds.await_command(self.inbox, self._wake)
            for request_id, reason in rejected:
                await self._finish_error(request_id, "invalid_request", reason)
            for outs in outputs_by_request(outputs):
                await self._publish(outs)
            if not self.backend.is_leader:
                self.inbox.refuse_controls("not a group leader any more")
        await self.publisher.flush()

    async def _after_commit(self, was_leader: bool) -> None:
        """Reconcile the streams this worker publishes with the requests its engine now holds."""
        self.holds.recent_step_ms.clear()  # the new group's steps are another length: its holds learn them afresh
        held, self.step_thread.held_at_commit = self.step_thread.held_at_commit, {}
        limits, self.step_thread.limits_at_commit = self.step_thread.limits_at_commit, {}
        for request_id in [r for r in self.running if r not in held]:
            state = self.running.pop(request_id)
            state.span.add_event("migrated", {"nitsum.group": str(self.backend.group)})
            state.span.end()
            self._prefill_over(request_id)  # its new leader computes what is left of it
        for request_id, produced in held.items():
            if request_id not in self.running:
                span = self.tracer.start_span(
                    "worker.generate",
                    attributes={
                        "nitsum.request_id": request_id,
                        "nitsum.worker": self.worker_id,
                        "nitsum.adopted": True,
                    },
                )
                offset = self.stream_offsets.get(request_id, 0)
                # Its limits as the engine runs it, in stream indices: a prefill group's adopted request is
                # handed off at its first token only while it has tokens left (without max_tokens it "ended"
                # there, a stream cut short as if done).
                prompt, max_tokens, tpot_ms = limits.get(request_id, (offset, 0, 0.0))
                self.running[request_id] = Running(
                    request_id,
                    self.bus.subjects.stream(request_id, self.worker_id),
                    prompt - offset,
                    produced + offset,
                    span,
                    max_tokens=offset + max_tokens,
                    tpot_ms=tpot_ms,
                )
        if self.on_topology_change is not None:
            await self.on_topology_change()

    async def _publish(self, outs: list) -> None:
        """One request's outputs of a turn (one per step it ran, in order; only the last can be finished)."""
        out = outs[-1]
        state = self.running.get(out.request_id)
        if state is None or state.since >= self.step_thread.turn_taken:
            # aborted while the step ran, or re-submitted under the same id meanwhile: the engine stepped the
            # earlier incarnation (its abort and the new add wait in the inbox), whose token is not this stream's
            return
        tokens = tuple(t for o in outs for t in o.new_token_ids)
        # P/D: a prefill worker's run ends at the first token; unless the request itself is done then
        # (a stop token, or max_tokens reached), it continues on the decode worker.
        handoff = bool(
            (state.decode_worker or self.world_prefill)
            and out.finished
            and out.finish_reason == "length"
            and state.next_index + len(tokens) < state.max_tokens
        )
        finished = out.finished and not handoff
        chunk = state.output_chunk(outs, self.worker_id, finished)
        state.next_index += len(tokens)
        if tokens and state.first_token_s is None:
            state.first_token_s = time.monotonic()
            self._prefill_over(out.request_id)
        self.metrics.generated_tokens_total().labels(worker=self.worker_id).inc(len(tokens))
        if finished:
            self.running.pop(out.request_id, None)
            self._ended_here(out.request_id, state.attempt)
            state.span.set_attribute("nitsum.output_tokens", state.next_index)
            state.span.set_attribute("nitsum.finish_reason", out.finish_reason or "")
            state.span.end()
            if self.prefill_role:
                self.release_pinned(out.request_id)
        self.publisher.send(state.stream_subject, chunk)  # sent while the next step runs
        if handoff:
            if self.on_handoff is None:
                await self._finish_error(out.request_id, "engine_error", "this worker cannot hand requests off")
                self.release_pinned(out.request_id)
            else:
                task = asyncio.create_task(self.on_handoff(state))
                self._handoffs.add(task)
                task.add_done_callback(self._handoffs.discard)

    async def _finish_error(self, request_id: str, code: str, message: str) -> None:
        state = self.running.pop(request_id, None)
        if state is None:
            return
        self._ended_here(request_id, state.attempt)
        mark_error(state.span, f"{code}: {message}")
        state.span.end()
        self.publisher.send(state.stream_subject, state.error_chunk(self.worker_id, code, message))
        self._prefill_over(request_id)

    async def fail_all(self, code: str, message: str) -> None:
        for request_id in list(self.running):
            self.inbox.put(("abort", request_id))
            await self._finish_error(request_id, code, message)
