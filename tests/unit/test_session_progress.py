"""WorkerSession's per-request progress (what WorkerStats carries for the coordinator's snapshot) and its
refusal to shed a request that is already streaming."""

from __future__ import annotations

import time
from types import SimpleNamespace

from nitsum.kv.prefix import block_hashes
from nitsum.wire.messages import RunRequest, SamplingSpec, SubmitRequest
from nitsum_services.gateway.generation import RETRYABLE_CODES
from nitsum_services.worker.prefill_admission import PrefillAdmissions, PrefillCost
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


class _Publisher:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, subject, chunk) -> None:
        self.sent.append((subject, chunk))


class _Metrics:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def aborted_requests_total(self):
        metrics = self

        class _Labelled:
            def labels(self, reason):
                metrics.reasons.append(reason)
                return SimpleNamespace(inc=lambda: None)

        return _Labelled()


def test_a_prune_ends_only_a_request_still_prefilling_with_the_retryable_code_and_reports_it_left():
    """The flow-scheduler's prune before the prefill: a request with no token yet ends with `overload_pruned`
    (the gateway re-routes that code), leaves the engine and is reported as no longer pending; one whose first
    token is out is kept, untouched (its hand-off is checked on its own)."""
    s = _session()
    s.metrics, s.publisher = _Metrics(), _Publisher()
    left: list[str] = []
    s.on_prefill_over = left.append
    s.running["q"] = Running("q", "subj-q", 10, 0, _span(), attempt=0)
    s.running["b"] = Running("b", "subj-b", 10, 1, _span(), attempt=0, first_token_s=time.monotonic())
    span_q = s.running["q"].span
    span_q.set_status = lambda *a, **k: None
    span_q.add_event = lambda *a, **k: None
    span_q.record_exception = lambda *a, **k: None
    assert s.prune("b", "too late") is False and "b" in s.running and s.publisher.sent == []
    assert s.prune("q", "its prefill cannot meet its TTFT deadline") is True
    assert "q" not in s.running and left == ["q"] and s.metrics.reasons == ["overload_pruned"]
    ((subject, chunk),) = s.publisher.sent
    assert subject == "subj-q" and chunk.finished and chunk.error_code == "overload_pruned"
    assert "its prefill cannot meet its TTFT deadline" in chunk.error_message
    assert ("abort", "q") in list(s.inbox._items)
    assert s.prune("q", "again") is False  # gone: nothing more happens
    assert "overload_pruned" in RETRYABLE_CODES


def test_the_prefill_cost_fits_a_fixed_cost_per_turn_and_one_per_token_after_the_warm_up():
    cost = PrefillCost()
    assert cost.estimate_ms(100) == 0.0  # nothing measured: nothing is estimated (never pruned on a guess)
    cost.add(50, 9_999.0)  # the engine's first turn warms it up: not a sample
    assert cost.estimate_ms(100) == 0.0
    cost.add(20, 5.0 + 0.1 * 20)
    assert cost.estimate_ms(40) == (7.0 / 20) * 40  # one size measured: ms per token
    for tokens in (40, 200, 1000):
        cost.add(tokens, 5.0 + 0.1 * tokens)
    assert abs(cost.estimate_ms(2000) - (5.0 + 0.1 * 2000)) < 1e-6  # not 2000 x the short turns' ms per token
    cost.add(0, 3.0)  # a turn that computed no prompt token is no sample
    assert abs(cost.estimate_ms(10) - 6.0) < 1e-6


def test_the_admission_estimate_counts_only_the_prompt_tokens_the_worker_will_compute():
    """Less the leading blocks the worker's prefix cache holds (its engine's last report) or a stage-1 fetch
    brings; the last token is always computed."""
    prompt = tuple(range(3, 3 + 70))  # 70 tokens: 4 full blocks of 16 before the last token
    held = block_hashes(list(prompt[:69]), 16)[:2]
    session = SimpleNamespace(stats=lambda: SimpleNamespace(cached_block_hashes=held))
    admissions = PrefillAdmissions(session, bus=None, worker_id="w1", block_size=16)

    def run(p, reuse=()):
        req = SubmitRequest("r", p, SamplingSpec(), "interactive", 200.0, 25.0, 1.0, 1.0, "s")
        return RunRequest(req, decode_worker="d", reuse_from="h" if reuse else "", reuse_hashes=reuse)

    assert admissions.uncached_tokens(run(prompt)) == 70 - 32
    assert admissions.uncached_tokens(run(prompt, reuse=(1, 2, 3))) == 70 - 48  # the fetch brings more
    assert admissions.uncached_tokens(run(tuple(range(100, 170)))) == 70  # another prompt: nothing cached
    assert admissions.uncached_tokens(run(prompt[:16])) == 16  # one block, all but the last token: none reused
