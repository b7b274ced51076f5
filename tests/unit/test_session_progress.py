"""WorkerSession's per-request progress (what WorkerStats carries for the coordinator's snapshot) and its
refusal to shed a request that is already streaming."""

from __future__ import annotations

import time
from types import SimpleNamespace

from nitsum_services.worker.session import Running, WorkerSession


def _session() -> WorkerSession:
    backend = SimpleNamespace(stats=lambda: SimpleNamespace(num_waiting=0))
    return WorkerSession(backend, bus=None, worker_id="w1", metrics=None, tracer=None)


def _span():
    return SimpleNamespace(end=lambda: None, set_attribute=lambda *a: None)


def test_progress_lists_streamed_tokens_and_first_token_ages_in_running_order():
    s = _session()
    now = time.monotonic()
    s.running["a"] = Running("a", "subj", 10, 0, _span(), attempt=0)  # queued: no token yet
    s.running["b"] = Running("b", "subj", 10, 5, _span(), attempt=0, first_token_s=now - 0.25)
    s.running["c"] = Running("c", "subj", 0, 7, _span())  # adopted past its first token (TP change, P/D)
    later = time.monotonic()
    ids, streamed, ages = s.progress(later)
    assert ids == ("a", "b", "c") and streamed == (0, 5, 7)
    assert ages[0] == -1.0 and abs(ages[1] - (later - now + 0.25) * 1000.0) < 1e-6 and 0.0 <= ages[2] < 1000.0


def test_a_streaming_request_is_not_shed():
    s = _session()
    s.running["b"] = Running("b", "subj", 10, 5, _span(), attempt=0, first_token_s=time.monotonic())
    assert s.abort("b", "shed") is False
    assert "b" in s.running
