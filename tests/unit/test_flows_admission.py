"""The overload check on batch arrival, live (paper §4.4.2; docs/SIMULATOR.md rule 33): the real flow-scheduler
over a real nats-server, fed the PrefillAdmission reports a prefill worker publishes when it admits a request it
will hand off (here published by the test). Each worker's pending requests are walked in σ, once per worker; a
request that cannot meet its TTFT deadline is pruned before it sends anything: its worker gets a FlowPruned on
its permit subject, the gateways one on flow_pruned."""

from __future__ import annotations

import asyncio
import time

import pytest

from nitsum.wire.codec import decode
from nitsum.wire.messages import FlowCompletion, FlowPruned, FlowSubmit, PrefillAdmission
from nitsum_services.flow_scheduler.main import PRUNED_CODE
from tests.unit.test_flows_live_inputs import _Live


def _now() -> float:
    return time.time() * 1000.0


class _Workers:
    """What the flow-scheduler sends to the workers w1 and w2 on their permit subjects."""

    def __init__(self, live: _Live) -> None:
        self.live = live
        self.got: dict[str, list[FlowPruned]] = {"w1": [], "w2": []}

    async def __aenter__(self):
        def on(worker: str):
            async def cb(msg) -> None:
                note = decode(msg.data)
                if isinstance(note, FlowPruned):  # (a flow's permit pushed here is not what these tests watch)
                    self.got[worker].append(note)

            return cb

        self.subs = [await self.live.bus.nc.subscribe(f"nitsum.flow.permit.{w}", cb=on(w)) for w in self.got]
        await self.live.bus.flush()
        return self

    async def __aexit__(self, *exc):
        for s in self.subs:
            await s.unsubscribe()

    async def admit(
        self, worker: str, *requests: tuple[str, float, float], left: tuple[str, ...] = (), turn_ms: float = 0.0
    ) -> None:
        """Publish one report: (request id, ms to its TTFT deadline from now, compute ms) each."""
        now = _now()
        msg = PrefillAdmission(
            worker,
            tuple(r for r, _, _ in requests),
            tuple(now + d for _, d, _ in requests),
            tuple(c for _, _, c in requests),
            left,
            turn_ms=turn_ms,
        )
        await self.live.bus.publish("nitsum.flow.progress", msg)
        await self.live.bus.flush()


def _counter(live: _Live) -> float:
    text = live.ctx.metrics.render()[0].decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("nitsum_flow_admission_pruned_total ")]
    return float(lines[0].split()[1]) if lines else 0.0


async def _settle() -> None:
    await asyncio.sleep(0.3)


@pytest.mark.asyncio
async def test_a_request_its_worker_cannot_prefill_in_time_is_pruned_before_it_sends_anything(nats_server):
    """w1 admits a short request due in 5 s and a long one due in 7 s: in σ the short one is done at 1 s, the
    long one at 9 s, past its deadline, so the check prunes the long one (the largest delay up to the miss) and
    the short one fits. w2's request as long, due in 9 s, fits: another worker's compute is another queue."""
    async with _Live(nats_server.url) as live, _Workers(live) as workers:
        await workers.admit("w1", ("short", 5000.0, 1000.0), ("long", 7000.0, 8000.0))
        await workers.admit("w2", ("other", 9000.0, 8000.0))
        await live.wait_for(lambda: workers.got["w1"] and live.pruned)
        await _settle()
        (note,) = workers.got["w1"]
        assert (note.request_id, note.code, note.flow_ids) == ("long", PRUNED_CODE, ())
        assert "prefill cannot meet its TTFT deadline" in note.reason
        assert [(p.request_id, p.code) for p in live.pruned] == [("long", PRUNED_CODE)]
        assert workers.got["w2"] == []
        assert _counter(live) == 1.0
        # a later flow of the pruned request is refused with the same code; the short one's flow goes on
        late = FlowSubmit("long.pd.0", "long", "long", "3", 1 << 20, "w1", "d0", 0, _now() + 5000.0)
        ok = FlowSubmit("short.pd.0", "short", "short", "3", 1 << 20, "w1", "d0", 0, _now() + 5000.0)
        refused, permitted = await live.submit(late, ok)
        assert refused.pruned and refused.code == PRUNED_CODE
        assert not permitted.pruned


@pytest.mark.asyncio
async def test_a_request_whose_prefill_is_over_leaves_the_check(nats_server):
    """A request that left (its first token went out) no longer delays the worker's queue: without the `left`
    report the second request (done at 10 s behind the first, due at 7 s) would be pruned."""
    async with _Live(nats_server.url) as live, _Workers(live) as workers:
        await workers.admit("w1", ("first", 6000.0, 5000.0))
        await workers.admit("w1", left=("first",))
        await workers.admit("w1", ("second", 7000.0, 5000.0))
        await _settle()
        assert workers.got["w1"] == [] and live.pruned == [] and _counter(live) == 0.0
        # and the control, on w2: the same two without the `left` report prune one
        await workers.admit("w2", ("third", 6000.0, 5000.0))
        await workers.admit("w2", ("fourth", 7000.0, 5000.0))
        await live.wait_for(lambda: workers.got["w2"])
        await _settle()
        # (the prune takes the largest delay up to the miss: "third" has computed a little since its admission)
        assert [n.request_id for n in workers.got["w2"]] == ["fourth"] and workers.got["w1"] == []


@pytest.mark.asyncio
async def test_a_malformed_admission_report_is_ignored_and_changes_nothing(nats_server):
    async with _Live(nats_server.url) as live, _Workers(live) as workers:
        now = _now()
        bad = PrefillAdmission("w1", ("a", "b"), (now + 100.0,), (9000.0, 9000.0))
        await live.bus.publish("nitsum.flow.progress", bad)
        await live.bus.publish("nitsum.flow.progress", PrefillAdmission("", ("c",), (now + 100.0,), (9000.0,)))
        await live.bus.flush()
        await _settle()
        assert workers.got["w1"] == [] and live.pruned == []
        # the service kept nothing of them: a later request that fits alone is not walked behind them
        await workers.admit("w1", ("fits", 5000.0, 4000.0))
        await _settle()
        assert workers.got["w1"] == [] and live.pruned == []


@pytest.mark.asyncio
async def test_a_baseline_without_the_overload_check_prunes_no_admission(nats_server):
    async with _Live(nats_server.url, flow_policy="sjf") as live, _Workers(live) as workers:
        await workers.admit("w1", ("short", 5000.0, 1000.0), ("long", 7000.0, 8000.0))
        await _settle()
        assert workers.got["w1"] == [] and live.pruned == [] and _counter(live) == 0.0


@pytest.mark.asyncio
async def test_a_request_pruned_as_its_first_token_went_out_keeps_its_hand_off(nats_server):
    """The prune races the first token: the worker keeps the request (`WorkerSession.prune` refuses once the first
    token is out) and reports it left. Its hand-off is then checked on its own, not refused for the prefill."""
    async with _Live(nats_server.url) as live, _Workers(live) as workers:
        await workers.admit("w1", ("short", 5000.0, 1000.0), ("long", 7000.0, 8000.0))
        await live.wait_for(lambda: workers.got["w1"])
        await workers.admit("w1", left=("long",))
        await _settle()
        flow = FlowSubmit("long.pd.0", "long", "long", "3", 1 << 20, "w1", "d0", 0, _now() + 5000.0)
        (permit,) = await live.submit(flow)
        assert not permit.pruned, permit
        # ranked as any flow, not suppressed as a pruned request's flows are (they leave `priorities`)
        assert "long.pd.0" in live.service_scheduler().priorities(_now())


@pytest.mark.asyncio
async def test_a_pending_request_long_past_its_deadline_is_forgotten_not_pruned(nats_server):
    """A report whose request is 31 s past its deadline is stale (its `left` report was lost: a live one would
    have been pruned long before): forgotten, so it neither gets a FlowPruned nor delays the worker's others.
    One just past its deadline is pruned."""
    async with _Live(nats_server.url) as live, _Workers(live) as workers:
        await workers.admit("w1", ("stale", -31_000.0, 10.0))
        await workers.admit("w1", ("fits", 5000.0, 1000.0))
        await _settle()
        assert workers.got["w1"] == [] and live.pruned == []
        await workers.admit("w2", ("late", -10.0, 10.0))
        await live.wait_for(lambda: workers.got["w2"])
        assert [n.request_id for n in workers.got["w2"]] == ["late"]


@pytest.mark.asyncio
async def test_the_check_takes_the_compute_done_since_admission_off_and_only_admissions_walk_a_queue(nats_server):
    """A request whose compute is under way is not pruned for the part already done: due in 1.5 s with 1 s of
    compute, it fits at its admission; 0.8 s later a second one (due in 1.2 s from then, 0.1 s of compute) is
    admitted behind it. Counting the first one's full second from now would end it at 1.8 s, past its deadline,
    and prune it; with the 0.8 s it has computed taken off, both fit (0.2 + 0.1 s). A flow's arrival and
    departure run no worker's walk: only an admission walks its worker's queue."""
    async with _Live(nats_server.url) as live, _Workers(live) as workers:
        await workers.admit("w1", ("running", 1500.0, 1000.0))
        await asyncio.sleep(0.8)
        await workers.admit("w1", ("next", 1200.0, 100.0))
        await _settle()
        assert workers.got["w1"] == [] and live.pruned == []
        # w2's request is past its deadline by the time a flow arrives and leaves elsewhere: no walk of w2 runs
        # then (its queue did not change); w2's next admission walks it, and prunes the late one
        await workers.admit("w2", ("late", 200.0, 0.0))
        await asyncio.sleep(0.4)
        flow = FlowSubmit("x.pd.0", "x", "x", "3", 1 << 10, "w0", "d0", 0, _now() + 60_000.0)
        (permit,) = await live.submit(flow)
        await live.bus.publish("nitsum.flow.done", FlowCompletion("x.pd.0", True, 1 << 10))
        await _settle()
        assert not permit.pruned and workers.got["w2"] == []
        await workers.admit("w2", ("on-time", 60_000.0, 0.0))
        await live.wait_for(lambda: workers.got["w2"])
        assert [n.request_id for n in workers.got["w2"]] == ["late"]


@pytest.mark.asyncio
async def test_the_fixed_cost_of_a_turn_is_counted_once_for_the_requests_queued_together(nats_server):
    """Four requests of 500 ms each per token, a 3 s turn: 3 + 4 x 0.5 = 5 s, inside their 6 s (counted per
    request it would be 14 s: three pruned). A fifth due in 3.2 s cannot be served in time behind the turn."""
    async with _Live(nats_server.url) as live, _Workers(live) as workers:
        four = [(f"r{i}", 6000.0, 500.0) for i in range(4)]
        await workers.admit("w1", *four, turn_ms=3000.0)
        await _settle()
        assert workers.got["w1"] == [] and live.pruned == []
        await workers.admit("w1", ("soon", 3200.0, 500.0), turn_ms=3000.0)
        await live.wait_for(lambda: workers.got["w1"])
        await _settle()
        assert [n.request_id for n in workers.got["w1"]] == ["soon"]
