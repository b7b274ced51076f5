"""The worker's outgoing token frames, sent off the engine's critical path.

The session hands every TokenChunk to `FramePublisher.send` (a list append: the step loop never awaits NATS)
and goes on to the next engine step; one publisher task, running while that step computes in its thread,
encodes and publishes what has piled up. Chunks for a gateway's frames subject (`Subjects.gateway_frames`,
what the gateway put in SubmitRequest.stream_subject) travel as one TokenBatch per subject: one frame per
step and gateway, not one per request. Chunks for a per-request stream subject (a stream adopted in a TP
change, whose gateway this worker does not know, or an older gateway) go out one by one, as before.

Order: one task publishes, first in first out, and a request's chunks always use one subject, so each
stream keeps its order (a batch lists a request's chunks in the order they were produced).
"""

from __future__ import annotations

import asyncio
import logging

from nitsum.bus import Bus
from nitsum.wire.messages import TokenBatch, TokenChunk

log = logging.getLogger("nitsum.worker")

# Chunks per TokenBatch at most (a frame of a few hundred bytes per chunk stays far below the codec's limit).
MAX_BATCH_CHUNKS = 512


class FramePublisher:
    def __init__(self, bus: Bus, worker_id: str) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self._pending: list[tuple[str, TokenChunk]] = []
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self.frames_sent = 0
        self.chunks_sent = 0

    def send(self, subject: str, chunk: TokenChunk) -> None:
        """Queue a chunk (event loop only); the publisher task sends it soon, after those queued before it."""
        self._pending.append((subject, chunk))
        self._idle.clear()
        self._ready.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued chunk was handed to NATS (at shutdown, before the bus drains)."""
        if self._pending or not self._idle.is_set():
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except TimeoutError:
                log.warning("%d token chunk(s) not published within %.0f s", len(self._pending), timeout_s)

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            items, self._pending = self._pending, []
            await self._publish(items)
            if not self._pending:
                self._idle.set()

    async def _publish(self, items: list[tuple[str, TokenChunk]]) -> None:
        grouped: dict[str, list[TokenChunk]] = {}
        for subject, chunk in items:
            grouped.setdefault(subject, []).append(chunk)
        for subject, chunks in grouped.items():
            try:
                if self.bus.subjects.frames_gateway(subject):
                    for i in range(0, len(chunks), MAX_BATCH_CHUNKS):
                        await self.bus.publish(
                            subject, TokenBatch(self.worker_id, tuple(chunks[i : i + MAX_BATCH_CHUNKS]))
                        )
                        self.frames_sent += 1
                else:
                    for chunk in chunks:
                        await self.bus.publish(subject, chunk)
                        self.frames_sent += 1
                self.chunks_sent += len(chunks)
            except Exception as exc:  # NATS down: the gateway's stream timeout re-routes the requests
                log.warning("could not publish %d token chunk(s) to %s: %s", len(chunks), subject, exc)
