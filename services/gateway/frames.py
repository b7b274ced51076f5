"""The gateway's one subscription for batched token frames (TokenBatch, one per worker step).

Every request this gateway submits names `Subjects.gateway_frames(<this gateway's id>)` as its stream
subject; workers send each step's chunks for all of this gateway's requests as one TokenBatch there, under
their own worker id. The dispatcher hands each chunk to its request's Generation, which checks it exactly
as a chunk on the request's own stream subject (sender = the subject's worker = the chunk's worker_id).
A chunk for a request this gateway no longer serves (finished, the client gone) is dropped, as a frame on
a per-request subject nobody subscribes to any more is.
"""

from __future__ import annotations

import logging

from nitsum.bus import Bus
from nitsum.wire.messages import TokenBatch

log = logging.getLogger("nitsum.gateway")


class FrameDispatcher:
    def __init__(self, bus: Bus, registry, gateway_id: str, on_foreign=None, on_batch=None) -> None:
        self.bus = bus
        self.registry = registry
        self.gateway_id = gateway_id
        self.subject = bus.subjects.gateway_frames(gateway_id)
        self.on_foreign = on_foreign  # called with the sender of a batch whose subject it does not match
        self.on_batch = on_batch  # called (no argument) for every batch received
        self.batches = 0
        self.chunks = 0
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(self.subject, self._on_batch, expected=TokenBatch)

    async def _on_batch(self, batch: TokenBatch, delivery) -> None:
        parts = delivery.subject.split(".")
        sender = parts[2] if self.bus.subjects.frames_gateway(delivery.subject) == self.gateway_id else ""
        self.batches += 1
        if self.on_batch is not None:
            self.on_batch()
        if not sender or sender != batch.worker_id:
            log.warning("dropped a token batch on %s claiming worker %s", delivery.subject, batch.worker_id)
            if self.on_foreign is not None:
                self.on_foreign(sender or delivery.subject)
            return
        for chunk in batch.chunks:
            self.chunks += 1
            gen = self.registry.by_id.get(chunk.request_id)
            if gen is not None:
                gen.take(chunk, sender)
