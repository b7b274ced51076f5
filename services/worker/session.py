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
import statistics
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from opentelemetry import trace

from nitsum.bus import Bus
from nitsum.engine.engine import Engine
from nitsum.engine.slo import RequestSlo
from nitsum.telemetry.metrics import Metrics
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import RunRequest, SubmitRequest, TokenChunk
from nitsum_services.worker.publisher import FramePublisher

log = logging.getLogger("nitsum.worker")

# After a prepare came back pending, the old group's next step waits this long at most for its pre-copy flows to
# be permitted (one flow-scheduler round trip: 2-5 ms here, up to ~10 when four old leaders ask at once), so that
# their first round runs before that step rather than after it -- a whole step sooner (and the final prepare
# ack with it). Never more than this fraction of a steady step: the streams lose at most that, once (a quarter
# was too short for merges of four groups: mid model, 20 ms steps, 0.5 -> totals 44-66 ms vs 48-76).
PRECOPY_HOLD_MAX_S = 0.025
PRECOPY_HOLD_STEP_FRACTION = 0.5
# Below this steady step the hold is not worth it: a fraction of it is shorter than the permits' round trip, and
# holding stacks the prepare step, the hold, the first round and the next step into one gap that streams see.
PRECOPY_HOLD_MIN_STEP_MS = 8.0
# ... and for the commit after the final prepare ack only from this step time on: that wait lies inside the
# streams' cutover gap (hold + commit + the new group's first step), where a 9-10 ms group's half-step hold
# made the pause 2.0-2.3 steps; with longer steps the hold is worth it (the commit comes at this boundary,
# not after the slowest old leader's next step).
COMMIT_HOLD_MIN_STEP_MS = 12.0
STEADY_STEPS = 16  # steps a steady step time is the median of (`steady_step_ms`)
# A peer's turn of the step thread follows the leader's plans for at most this long (see `_iteration`).
FOLLOW_BATCH_S = 0.25


def request_slo(req: SubmitRequest) -> RequestSlo | None:
    """The request's tier and targets on the engine clock (the gateway stamped its arrival in wall time), so
    the engine schedules it tier-aware; None for a tier the engine does not know (plain order)."""
    try:
        return RequestSlo.from_unix(
            req.tier, req.ttft_ms, req.tpot_ms, req.arrival_unix_ms, time.time() * 1000.0, Engine.now_ms()
        )
    except ValueError:
        return None


# Streams ended and not yet reported after which the worker's heartbeat goes out early: far below any queue
# bound (the coordinator counts a request until it hears its stream ended), and a light load never reaches it.
ENDED_REPORT_AT = 32


@dataclass
class Running:
    request_id: str
    stream_subject: str
    prompt_len: int
    next_index: int
    span: trace.Span
    started_s: float = field(default_factory=time.monotonic)
    decode_worker: str = ""  # P/D: hand the request to this worker after its first token
    max_tokens: int = 0
    tpot_ms: float = 0.0
    attempt: int = -1  # the SubmitRequest.attempt being served (an adopted stream: the one its prefill served)
    # When its first token came out (time.monotonic()); None: still prefilling here. A request adopted past
    # its first token (P/D, TP change) counts from its adoption: the coordinator keeps the earlier time it
    # heard of, if any (WorkerStats.running_first_token_age_ms).
    first_token_s: float | None = None

    def __post_init__(self) -> None:
        if self.next_index > 0 and self.first_token_s is None:
            self.first_token_s = time.monotonic()


class WorkerSession:
    # Aborts for these reasons end the stream with an error chunk (the client must hear why); the others
    # (client gone, request moved elsewhere) end it silently.
    TOLD_REASONS = ("shed", "admin")

    def __init__(self, backend, bus: Bus, worker_id: str, metrics: Metrics, tracer: trace.Tracer) -> None:
        self.backend = backend
        self.bus = bus
        self.worker_id = worker_id
        self.metrics = metrics
        self.tracer = tracer
        self.running: dict[str, Running] = {}
        self._inbox: deque[tuple[str, object]] = deque()
        self._inbox_lock = threading.Lock()
        self._wake = asyncio.Event()
        self.step_ms_ewma = 0.0
        self.recent_step_ms: deque[float] = deque(maxlen=STEADY_STEPS)  # the last steps that produced tokens
        self.num_aborted = 0
        self._ended: list[tuple[str, int]] = []  # (request id, attempt) ended here since the last heartbeat
        # set once ENDED_REPORT_AT of them wait: the heartbeat then goes out early (WorkerService.heartbeat)
        self.many_ended = asyncio.Event()
        self._stats = backend.stats()
        self._held_at_commit: dict[str, int] = {}
        self._hold_for_commit = False  # the last turn sent a prepare's final ack: wait a little for the commit
        self.on_topology_change = None  # async callback after a commit changed this worker's group
        self.on_handoff = None  # P/D: callback(Running) once a prefill finished; it owns the request then
        self._held: dict[str, SubmitRequest] = {}  # accepted, waiting for a stage-1 prefix fetch
        # Request id -> tokens it had streamed when it was re-submitted (its engine counts from there): an
        # adopted one continues its stream at engine count + offset (StreamOffset from the coordinator).
        self.stream_offsets: OrderedDict[str, int] = OrderedDict()
        self._handoffs: set[asyncio.Task] = set()
        self.publisher = FramePublisher(bus, worker_id)  # token frames go out from its task, not the step loop

    # ---- called from the event loop -------------------------------------------------------------
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
            max_tokens=req.sampling.max_tokens,
            tpot_ms=req.tpot_ms,
            attempt=req.attempt,
        )
        if hold:
            self._held[req.request_id] = req
        else:
            self._put(("add", req))

    def start_held(self, request_id: str) -> None:
        req = self._held.pop(request_id, None)
        if req is not None and request_id in self.running:
            self._put(("add", req))

    def call(self, fn) -> asyncio.Future:
        """Run `fn(backend)` in the step thread at the next step boundary; the future gets its result."""
        future = asyncio.get_running_loop().create_future()
        self._put(("call", (fn, future)))
        return future

    def release_pinned(self, request_id: str) -> None:
        self._put(("release", request_id))

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

    def control(self, command) -> asyncio.Future:
        """Queue a topology command for the next step boundary; the future resolves to its ack."""
        future = asyncio.get_running_loop().create_future()
        self._put(("control", (command, future)))
        return future

    def wake(self) -> None:
        """Event loop: run an iteration soon even if idle (e.g. a pre-copy flow was just allowed)."""
        self._wake.set()

    def _put(self, item) -> None:
        with self._inbox_lock:
            self._inbox.append(item)
        self._wake.set()

    def abort(self, request_id: str, reason: str) -> bool:
        state = self.running.get(request_id)
        if state is None:
            return False
        if reason.split(":")[0] == "shed" and state.first_token_s is not None:
            # The coordinator hears of first tokens a heartbeat late: a request already streaming is never shed.
            return False
        if reason.split(":")[0] in self.TOLD_REASONS:
            chunk = TokenChunk(
                request_id,
                self.worker_id,
                state.next_index,
                (),
                finished=True,
                finish_reason="error",
                error_code=reason,
                error_message=f"the request was {reason}: it cannot meet its SLO",
                attempt=state.attempt,
            )
            self.publisher.send(state.stream_subject, chunk)
        self.running.pop(request_id, None)
        self._ended_here(request_id, state.attempt)
        self._held.pop(request_id, None)
        self._put(("abort", request_id))
        self.num_aborted += 1
        self.metrics.aborted_requests_total().labels(reason=reason.split(":")[0]).inc()
        mark_error(state.span, f"aborted: {reason}")
        state.span.end()
        return True

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
        return not self.running and not self._inbox and not self._handoffs

    # ---- the step thread ----------------------------------------------------------------------------
    def _iteration(self):
        """One turn of the step thread: (outputs, rejected, stats, control results, followed plan kind, call results)."""
        from nitsum.engine import SamplingParams

        backend = self.backend
        if not backend.is_leader:
            # A peer follows the leader's plans here, in a row: going back to the event loop after each one (a
            # thread hand-off both ways, and the loop's turn for the GIL) made every TP step of the group wait
            # for its slowest peer's trip, and a pre-copy round right after a prepare for the peers to come
            # back. Only a commit (a promoted peer starts publishing), a shutdown, or FOLLOW_BATCH_S of plans
            # (the loop checks its stop and refreshes stats) end the turn.
            deadline = time.monotonic() + FOLLOW_BATCH_S
            acks = []
            while True:
                kind = backend.follow()  # blocks until the leader's next plan
                if kind == "control":
                    ack = backend.runtime.last_ack
                    acks.append((None, ack))
                    if ack.phase == "commit":
                        if ack.ok:
                            self._held_at_commit = backend.output_counts()  # a promoted peer adopts from here
                        break
                if kind == "shutdown" or backend.is_leader or time.monotonic() > deadline:
                    break
            return [], [], backend.stats(), acks, kind, []
        rejected: list[tuple[str, str]] = []
        acks = []
        calls: list[tuple[asyncio.Future, object, BaseException | None]] = []
        with self._inbox_lock:
            items = list(self._inbox)
            self._inbox.clear()
        for op, payload in items:
            if op == "add":
                req: SubmitRequest = payload
                s = req.sampling
                try:
                    params = SamplingParams(
                        max_tokens=s.max_tokens,
                        temperature=s.temperature,
                        top_p=s.top_p,
                        top_k=s.top_k,
                        seed=s.seed,
                        stop=s.stop,
                        stop_token_ids=s.stop_token_ids,
                        ignore_eos=s.ignore_eos,
                        presence_penalty=s.presence_penalty,
                        frequency_penalty=s.frequency_penalty,
                        repetition_penalty=s.repetition_penalty,
                        logit_bias=tuple(zip(s.logit_bias_ids, s.logit_bias_values)),
                        logprobs=s.logprobs if s.logprobs >= 0 else None,
                        guide=s.guide,
                        min_tokens=s.min_tokens,
                        min_p=s.min_p,
                    )
                    backend.add_request(
                        req.request_id,
                        list(req.prompt_token_ids) + list(req.output_token_ids),
                        params,
                        request_slo(req),
                    )
                except (ValueError, AssertionError) as exc:
                    rejected.append((req.request_id, str(exc)))
            elif op == "abort":
                backend.abort(payload)
            elif op == "release":
                backend.engine.release(payload)
            elif op == "call":
                fn, future = payload
                try:
                    calls.append((future, fn(backend), None))
                except Exception as exc:  # handed to the caller, which reports it
                    calls.append((future, None, exc))
            else:
                command, future = payload
                ack = backend.command(command)
                acks.append((future, ack))
                if ack.phase == "commit" and ack.ok:
                    # What this worker holds right at the cutover, before the next step samples more:
                    # adopted streams continue from exactly these indices.
                    self._held_at_commit = backend.output_counts()
                if not backend.is_leader:
                    break  # this worker became a peer: the rest of the inbox is answered by the loop
        if any((ack.phase == "commit" and ack.ok) or (ack.phase == "prepare" and ack.pending) for _future, ack in acks):
            # The commit ack (and the adopted streams' bookkeeping) goes out now; the new group's first step
            # is the next turn. Otherwise the coordinator's pause would include a step at the new TP.
            # A pending prepare's ack too: its pre-copy flows get their permits meanwhile (`_await_permits`).
            return [], rejected, backend.stats(), acks, "step", calls
        if backend.is_leader and backend.precopy_tick() and self._hold_s(COMMIT_HOLD_MIN_STEP_MS) > 0:
            # A transition's KV pre-copy (one chunk per allowed flow, then the step) just sent the prepare's
            # final ack: the coordinator's commit is one round trip away. This turn ends before the step so that
            # the loop can wait that long (`_await_command`) and the commit comes at this step boundary rather
            # than after the next step -- a merge's commit otherwise waits for the slowest old leader's step.
            self._hold_for_commit = True
            return [], rejected, backend.stats(), acks, "step", calls
        outputs = backend.step() if backend.is_leader and backend.has_unfinished() else []
        if not outputs and backend.is_leader and not backend.has_unfinished():
            backend.idle_tick()
        return outputs, rejected, backend.stats(), acks, "step", calls

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            if (
                self.backend.is_leader
                and not self._inbox
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
            t0 = time.perf_counter()
            try:
                outputs, rejected, self._stats, acks, _kind, calls = await loop.run_in_executor(None, self._iteration)
            except Exception as exc:  # an engine failure fails the requests in flight, loudly
                log.exception("engine step failed")
                await self.fail_all("engine_error", f"{type(exc).__name__}: {exc}")
                continue
            step_ms = (time.perf_counter() - t0) * 1000.0
            if outputs:
                self.step_ms_ewma = step_ms if self.step_ms_ewma == 0 else 0.9 * self.step_ms_ewma + 0.1 * step_ms
                self.recent_step_ms.append(step_ms)
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
                await self._await_permits()
            if self._hold_for_commit:
                self._hold_for_commit = False
                await self._await_command()
            for request_id, reason in rejected:
                await self._finish_error(request_id, "invalid_request", reason)
            for out in outputs:
                await self._publish(out)
            if not self.backend.is_leader:
                self._refuse_queued("not a group leader any more")
        await self.publisher.flush()

    def steady_step_ms(self) -> float:
        """A steady step of this group: the median of its last STEADY_STEPS steps that produced tokens. A few
        long steps (prefills, a stream's first steps) do not move it; the EWMA did, for ~25 steps after one,
        and a change in that time held the old group's steps for nothing (a 4-7 ms tiny-model group kept no
        token out for a whole merge, 50-60 ms)."""
        return statistics.median(self.recent_step_ms) if self.recent_step_ms else 0.0

    def _hold_s(self, min_step_ms: float = 0.0) -> float:
        """How long the old group's next step may wait for a transition's next message (0: not at all): for
        the pre-copy's permits from PRECOPY_HOLD_MIN_STEP_MS steps on, for the commit from `min_step_ms`."""
        step_ms = self.steady_step_ms()
        if step_ms < max(PRECOPY_HOLD_MIN_STEP_MS, min_step_ms):
            return 0.0
        return min(PRECOPY_HOLD_MAX_S, PRECOPY_HOLD_STEP_FRACTION * step_ms / 1000.0)

    async def _await_command(self) -> None:
        """The prepare's final ack went out: wait for the next inbox item (the commit, normally) at most
        `_hold_s`; the next iteration applies it before any step."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._hold_s(COMMIT_HOLD_MIN_STEP_MS)
        while not self._inbox:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                return

    async def _await_permits(self) -> None:
        """A prepare came back pending: the migration driver (the prepare's handler, which runs while this
        waits) is getting its pre-copy flows' permits. Wait until every flow is allowed, at most
        PRECOPY_HOLD_STEP_FRACTION of a steady step (capped at PRECOPY_HOLD_MAX_S; not at all below
        PRECOPY_HOLD_MIN_STEP_MS); the next iteration then runs their first round before its step."""
        hold_s = self._hold_s()
        if hold_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        await asyncio.sleep(0)  # the prepare's handler takes its ack and starts the driver
        while not self.backend.precopy_all_allowed():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()  # `allow` wakes it (MigrationDriver); the loop re-reads the inbox anyway
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                return

    async def _after_commit(self, was_leader: bool) -> None:
        """Reconcile the streams this worker publishes with the requests its engine now holds."""
        self.recent_step_ms.clear()  # the new group's steps are another length: its holds learn them afresh
        held, self._held_at_commit = self._held_at_commit, {}
        for request_id in [r for r in self.running if r not in held]:
            state = self.running.pop(request_id)
            state.span.add_event("migrated", {"nitsum.group": str(self.backend.group)})
            state.span.end()
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
                self.running[request_id] = Running(
                    request_id, self.bus.subjects.stream(request_id, self.worker_id), 0, produced + offset, span
                )
        if self.on_topology_change is not None:
            await self.on_topology_change()

    def _refuse_queued(self, reason: str) -> None:
        with self._inbox_lock:
            items = list(self._inbox)
            self._inbox.clear()
        for op, payload in items:
            if op == "control":
                _command, future = payload
                if not future.done():
                    future.set_exception(RuntimeError(reason))

    async def _publish(self, out) -> None:
        state = self.running.get(out.request_id)
        if state is None:  # aborted while the step ran
            return
        tokens = tuple(out.new_token_ids)
        # P/D: a prefill worker's run ends at the first token; unless the request itself is done then
        # (a stop token, or max_tokens reached), it continues on the decode worker.
        handoff = bool(
            (state.decode_worker or self.world_prefill)
            and out.finished
            and out.finish_reason == "length"
            and state.next_index + len(tokens) < state.max_tokens
        )
        finished = out.finished and not handoff
        chunk = TokenChunk(
            request_id=out.request_id,
            worker_id=self.worker_id,
            index=state.next_index,
            token_ids=tokens,
            text=out.text_delta,
            finished=finished,
            finish_reason=(out.finish_reason or "") if finished else "",
            num_prompt_tokens=state.prompt_len,
            num_cached_prompt_tokens=out.num_cached_prompt_tokens,
            logprobs=(out.logprob,) if out.logprob is not None else (),
            top_k=len(out.top_logprobs),
            top_logprob_ids=tuple(t for t, _ in out.top_logprobs),
            top_logprob_values=tuple(v for _, v in out.top_logprobs),
            attempt=state.attempt,
        )
        state.next_index += len(tokens)
        if tokens and state.first_token_s is None:
            state.first_token_s = time.monotonic()
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
        chunk = TokenChunk(
            request_id=request_id,
            worker_id=self.worker_id,
            index=state.next_index,
            token_ids=(),
            finished=True,
            finish_reason="error",
            error_code=code,
            error_message=message,
            attempt=state.attempt,
        )
        self.publisher.send(state.stream_subject, chunk)

    async def fail_all(self, code: str, message: str) -> None:
        for request_id in list(self.running):
            self._put(("abort", request_id))
            await self._finish_error(request_id, code, message)
