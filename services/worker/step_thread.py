"""The worker's step thread: it alone touches the engine. The event loop puts adds, aborts, calls and topology
commands into the `StepInbox`; each `StepThread.turn` applies them right before the engine's step. A peer of a
TP>1 group takes no requests: its turn follows the group leader's step plans."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from nitsum.engine import SamplingParams
from nitsum.engine.engine import Engine
from nitsum.engine.slo import RequestSlo
from nitsum.wire.messages import SamplingSpec, SubmitRequest
from nitsum_services.worker.holds import COMMIT_HOLD_MIN_STEP_MS, StepHolds

# A peer's turn of the step thread follows the leader's plans for at most this long (see `StepThread._follow`).
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


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    """The engine's sampling parameters for a request's SamplingSpec (ValueError: ones it cannot take)."""
    return SamplingParams(
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed,
        stop=spec.stop,
        stop_token_ids=spec.stop_token_ids,
        ignore_eos=spec.ignore_eos,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        logit_bias=tuple(zip(spec.logit_bias_ids, spec.logit_bias_values)),
        logprobs=spec.logprobs if spec.logprobs >= 0 else None,
        guide=spec.guide,
        min_tokens=spec.min_tokens,
        min_p=spec.min_p,
    )


class StepInbox:
    """What the event loop hands the step thread, in order; every put wakes the loop's idle wait (`wake`)."""

    def __init__(self, wake: asyncio.Event) -> None:
        self._items: deque[tuple[str, object]] = deque()
        self._lock = threading.Lock()
        self._wake = wake
        self.put_count = 0  # items put so far (an item's serial is the count right after its put)
        self.taken_count = 0  # items taken so far: FIFO, so every serial up to it was taken

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item) -> None:
        with self._lock:
            self._items.append(item)
            self.put_count += 1
        self._wake.set()

    def take(self) -> list[tuple[str, object]]:
        """Everything put so far, emptying the inbox."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self.taken_count += len(items)
        return items

    def refuse_controls(self, reason: str) -> None:
        """Empty the inbox; its topology commands fail with `reason` (this worker is no leader any more)."""
        for op, payload in self.take():
            if op == "control":
                _command, future = payload
                if not future.done():
                    future.set_exception(RuntimeError(reason))


class StepThread:
    def __init__(self, backend, inbox: StepInbox, holds: StepHolds, decode_turn_ms: float = 0.0) -> None:
        self.backend = backend
        self.inbox = inbox
        self.holds = holds
        self.prefill_delay_s = 0.0  # fault injection (NITSUM_FAULT_PREFILL_DELAY_MS): a slow device's prefill
        # What this worker holds right at a commit (request id -> output count): the loop adopts streams from it.
        self.held_at_commit: dict[str, int] = {}
        # ... and what each of them runs under there (prompt tokens, max_tokens, TPOT ms): Engine.request_limits.
        self.limits_at_commit: dict[str, tuple[int, int, float]] = {}
        self.hold_for_commit = False  # the last turn sent a prepare's final ack: wait a little for the commit
        self.turn_taken = 0  # StepInbox.taken_count when the last leader turn took the inbox
        # Decode-only steps run back to back for up to this long in one turn (NITSUM_DECODE_TURN_MS; 0: one
        # step a turn), so that the event loop's hand-off and publishing are paid once per run of steps.
        self.decode_turn_ms = decode_turn_ms
        self.last_turn_steps = 0  # engine steps the last leader turn ran
        self._failed_step: Exception | None = None  # a step of a run failed after others: raised by the next turn

    def turn(self):
        """One turn of the step thread: (outputs, rejected, stats, control results, followed plan kind, call results)."""
        if not self.backend.is_leader:
            return self._follow()
        return self._lead()

    def _follow(self):
        backend = self.backend
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
                        self.held_at_commit = backend.output_counts()  # a promoted peer adopts from here
                        self.limits_at_commit = backend.request_limits()
                    break
            if kind == "shutdown" or backend.is_leader or time.monotonic() > deadline:
                break
        return [], [], backend.stats(), acks, kind, []

    def _lead(self):
        backend = self.backend
        rejected: list[tuple[str, str]] = []
        acks = []
        calls: list[tuple[asyncio.Future, object, BaseException | None]] = []
        self.last_turn_steps = 0
        if self._failed_step is not None:
            exc, self._failed_step = self._failed_step, None
            raise exc
        items = self.inbox.take()
        self.turn_taken = self.inbox.taken_count  # this turn's outputs are for what the inbox held up to here
        for op, payload in items:
            if op == "add":
                req: SubmitRequest = payload
                try:
                    params = sampling_params(req.sampling)
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
                    self.held_at_commit = backend.output_counts()
                    self.limits_at_commit = backend.request_limits()
                if not backend.is_leader:
                    break  # this worker became a peer: the rest of the inbox is answered by the loop
        if any((ack.phase == "commit" and ack.ok) or (ack.phase == "prepare" and ack.pending) for _future, ack in acks):
            # The commit ack (and the adopted streams' bookkeeping) goes out now; the new group's first step
            # is the next turn. Otherwise the coordinator's pause would include a step at the new TP.
            # A pending prepare's ack too: its pre-copy flows get their permits meanwhile (`StepHolds.await_permits`).
            return [], rejected, backend.stats(), acks, "step", calls
        if backend.is_leader and backend.precopy_tick() and self.holds.hold_s(COMMIT_HOLD_MIN_STEP_MS) > 0:
            # A transition's KV pre-copy (one chunk per allowed flow, then the step) just sent the prepare's
            # final ack: the coordinator's commit is one round trip away. This turn ends before the step so that
            # the loop can wait that long (`StepHolds.await_command`) and the commit comes at this step boundary rather
            # than after the next step -- a merge's commit otherwise waits for the slowest old leader's step.
            self.hold_for_commit = True
            return [], rejected, backend.stats(), acks, "step", calls
        outputs = self._decode_steps(backend) if backend.is_leader and backend.has_unfinished() else []
        if not outputs and backend.is_leader and not backend.has_unfinished():
            backend.idle_tick()
        return outputs, rejected, backend.stats(), acks, "step", calls

    def _decode_steps(self, backend) -> list:
        """The turn's step, then more steps back to back while each one only decodes, and while the turn stays
        within `decode_turn_ms` at the mean step so far. The run ends before the budget, at a step that ran
        prompt tokens (first tokens go out at once), one where a request finished (its hand-off or its end
        goes out at once), or as soon as the event loop put anything in the inbox (a new request, an abort, a
        call or a command waits at most one step) or a transition's pre-copy is active (it runs between every
        two steps)."""
        started = time.perf_counter()
        engine = backend.engine
        prefilled = engine.num_prefill_tokens_computed if engine is not None else 0
        outputs = last = list(backend.step())
        if self.prefill_delay_s > 0 and engine is not None and engine.num_prefill_tokens_computed != prefilled:
            time.sleep(self.prefill_delay_s)
        self.last_turn_steps = 1
        budget_s = self.decode_turn_ms / 1000.0
        while budget_s > 0 and last:
            elapsed = time.perf_counter() - started
            if elapsed * (self.last_turn_steps + 1) / self.last_turn_steps > budget_s:
                break
            if len(self.inbox) or backend.precopy_active or not backend.is_leader or not backend.has_unfinished():
                break
            if engine is None or backend.engine is not engine or engine.num_prefill_tokens_computed != prefilled:
                break
            if any(o.finished for o in last):
                break
            try:
                last = backend.step()
            except Exception as exc:  # the steps before it went well: their tokens go out, the failure next turn
                self._failed_step = exc
                break
            self.last_turn_steps += 1
            outputs.extend(last)
        return outputs
