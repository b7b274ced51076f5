"""The worker's async half: feeds requests into the engine, steps it in a thread, streams tokens out.

The engine is not thread-safe, so the event loop never touches it while a step runs: adds and aborts
go into an inbox that the step thread applies right before each step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from opentelemetry import trace

from nitsum.bus import Bus
from nitsum.telemetry.metrics import Metrics
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import RunRequest, SubmitRequest, TokenChunk

log = logging.getLogger("nitsum.worker")


@dataclass
class Running:
    request: SubmitRequest
    next_index: int
    span: trace.Span
    started_s: float = field(default_factory=time.monotonic)


class WorkerSession:
    def __init__(self, engine, bus: Bus, worker_id: str, metrics: Metrics, tracer: trace.Tracer) -> None:
        self.engine = engine
        self.bus = bus
        self.worker_id = worker_id
        self.metrics = metrics
        self.tracer = tracer
        self.running: dict[str, Running] = {}
        self._inbox: deque[tuple[str, object]] = deque()
        self._inbox_lock = threading.Lock()
        self._wake = asyncio.Event()
        self.step_ms_ewma = 0.0
        self.num_aborted = 0
        self._stats = engine.stats()

    # ---- called from the event loop -------------------------------------------------------------
    def validate(self, run: RunRequest) -> str:
        """Why this request cannot run here ("" when it can)."""
        req = run.request
        if req.request_id in self.running:
            return "duplicate request id"
        total = len(req.prompt_token_ids) + len(req.output_token_ids) + req.sampling.max_tokens
        if total > self.engine.max_model_len:
            return f"prompt + max_tokens = {total} exceeds the model context of {self.engine.max_model_len}"
        if not req.prompt_token_ids:
            return "empty prompt"
        return ""

    def submit(self, run: RunRequest) -> None:
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
        self.running[req.request_id] = Running(req, next_index=len(req.output_token_ids), span=span)
        with self._inbox_lock:
            self._inbox.append(("add", req))
        self._wake.set()

    # Aborts for these reasons end the stream with an error chunk (the client must hear why); the others
    # (client gone, request moved elsewhere) end it silently.
    TOLD_REASONS = ("shed", "admin")

    def abort(self, request_id: str, reason: str) -> bool:
        state = self.running.get(request_id)
        if state is None:
            return False
        if reason.split(":")[0] in self.TOLD_REASONS:
            chunk = TokenChunk(request_id, self.worker_id, state.next_index, (), finished=True, finish_reason="error", error_code=reason, error_message=f"the request was {reason}: it cannot meet its SLO")
            task = asyncio.ensure_future(self.bus.publish(state.request.stream_subject, chunk))
            task.add_done_callback(lambda t: t.exception())
        self.running.pop(request_id, None)
        with self._inbox_lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()
        self.num_aborted += 1
        self.metrics.aborted_requests_total().labels(reason=reason).inc()
        mark_error(state.span, f"aborted: {reason}")
        state.span.end()
        return True

    def stats(self):
        return self._stats

    @property
    def idle(self) -> bool:
        return not self.running and not self._inbox

    # ---- the step loop ----------------------------------------------------------------------------
    def _apply_inbox_and_step(self):
        from nitsum.engine import SamplingParams

        rejected: list[tuple[str, str]] = []
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
                    )
                    self.engine.add_request(req.request_id, list(req.prompt_token_ids) + list(req.output_token_ids), params)
                except ValueError as exc:
                    rejected.append((req.request_id, str(exc)))
            else:
                self.engine.abort(payload)
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        return outputs, rejected, self.engine.stats()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self._inbox and not self.engine.has_unfinished():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    continue
            t0 = time.perf_counter()
            try:
                outputs, rejected, self._stats = await asyncio.to_thread(self._apply_inbox_and_step)
            except Exception as exc:  # an engine failure fails the requests in flight, loudly
                log.exception("engine step failed")
                await self._fail_all("engine_error", f"{type(exc).__name__}: {exc}")
                continue
            step_ms = (time.perf_counter() - t0) * 1000.0
            if outputs:
                self.step_ms_ewma = step_ms if self.step_ms_ewma == 0 else 0.9 * self.step_ms_ewma + 0.1 * step_ms
            for request_id, reason in rejected:
                await self._finish_error(request_id, "invalid_request", reason)
            for out in outputs:
                await self._publish(out)

    async def _publish(self, out) -> None:
        state = self.running.get(out.request_id)
        if state is None:  # aborted while the step ran
            return
        tokens = tuple(out.new_token_ids)
        chunk = TokenChunk(
            request_id=out.request_id,
            worker_id=self.worker_id,
            index=state.next_index,
            token_ids=tokens,
            text=out.text_delta,
            finished=out.finished,
            finish_reason=out.finish_reason or "",
            num_prompt_tokens=len(state.request.prompt_token_ids),
            num_cached_prompt_tokens=out.num_cached_prompt_tokens,
        )
        state.next_index += len(tokens)
        self.metrics.generated_tokens_total().labels(worker=self.worker_id).inc(len(tokens))
        if out.finished:
            self.running.pop(out.request_id, None)
            state.span.set_attribute("nitsum.output_tokens", state.next_index)
            state.span.set_attribute("nitsum.finish_reason", out.finish_reason or "")
            state.span.end()
        try:
            await self.bus.publish(state.request.stream_subject, chunk)
        except Exception as exc:  # NATS down: the gateway's stream timeout re-routes the request
            log.warning("could not publish tokens of %s: %s", out.request_id, exc)

    async def _finish_error(self, request_id: str, code: str, message: str) -> None:
        state = self.running.pop(request_id, None)
        if state is None:
            return
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
        )
        try:
            await self.bus.publish(state.request.stream_subject, chunk)
        except Exception as exc:
            log.warning("could not report the failure of %s: %s", request_id, exc)

    async def _fail_all(self, code: str, message: str) -> None:
        for request_id in list(self.running):
            with self._inbox_lock:
                self._inbox.append(("abort", request_id))
            await self._finish_error(request_id, code, message)
