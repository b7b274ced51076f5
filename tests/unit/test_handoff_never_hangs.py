"""A P/D hand-off that fails in a way nobody foresaw (here: the export raises a RuntimeError, as a torch shape
mismatch or an unmappable arena would) still ends the request's stream at once with the retryable
kv_transfer_failed error and releases the pinned request; before, the exception escaped the hand-off task and the
stream waited for the gateway's timeout."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nitsum.telemetry.metrics import Metrics
from nitsum_services.worker.transfer import KvMover


class _Session:
    def __init__(self) -> None:
        self.released, self.failed, self.handed = [], [], []

    async def call(self, fn):
        raise RuntimeError("shape '[2, 4, 16]' is invalid for input of size 7")

    def release_pinned(self, rid: str) -> None:
        self.released.append(rid)

    def handed_off(self, rid: str) -> None:
        self.handed.append(rid)

    async def fail(self, rid: str, code: str, message: str) -> None:
        self.failed.append((rid, code, message))


class _Span:
    def add_event(self, *args, **kwargs) -> None:
        pass


def test_an_unforeseen_export_error_fails_the_stream_retryably_and_releases_the_request():
    session = _Session()
    mover = KvMover(session, agent=None, bus=None, worker_id="w0", metrics=Metrics("decode-worker"))
    running = SimpleNamespace(
        request_id="r1",
        span=_Span(),
        decode_worker="w1",
        tpot_ms=25.0,
        max_tokens=8,
        next_index=1,
        stream_subject="s",
        attempt=0,
    )
    asyncio.run(mover.hand_off(running))  # never raises
    assert session.released == ["r1"] and session.handed == []
    ((rid, code, message),) = session.failed
    assert rid == "r1" and code == "engine_error"
    assert message.startswith("kv_transfer_failed: hand-off to w1: RuntimeError: shape")
    assert mover.num_failures == 1
