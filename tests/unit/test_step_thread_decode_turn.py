"""A leader's turn of the step thread runs decode-only steps back to back (NITSUM_DECODE_TURN_MS): the tiny
model's real engine behind the worker's PlainBackend, turned as the session turns it. The run of steps ends at
a step that ran prompt tokens, at a finished request, at anything the event loop put in the inbox, and before
the budget; the tokens are the engine's own, in order."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from nitsum.engine import Engine, EngineConfig, SamplingParams
from nitsum.wire.messages import SamplingSpec, SubmitRequest
from nitsum_services.worker.backend import PlainBackend
from nitsum_services.worker.holds import StepHolds
from nitsum_services.worker.step_thread import StepInbox, StepThread

UNBOUNDED_MS = 1e9  # a budget no run of steps reaches: only the other ends apply


@pytest.fixture
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    return Engine(EngineConfig(model_dir=str(tiny_model_dir), block_size=16, num_kv_blocks=64))


def _thread(backend, budget_ms: float) -> StepThread:
    return StepThread(backend, StepInbox(asyncio.Event()), StepHolds(), budget_ms)


def _add(thread: StepThread, request_id: str, prompt: list[int], max_tokens: int) -> None:
    spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
    thread.inbox.put(("add", SubmitRequest(request_id, tuple(prompt), spec, "interactive", 1e3, 1e2, 1.0, 0.0, "s")))


def _reference(engine_dir, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    ref = Engine(EngineConfig(model_dir=engine_dir, block_size=16, num_kv_blocks=64))
    return [
        ref.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        for p, n in zip(prompts, max_tokens, strict=True)
    ]


def _tokens(outputs, request_id: str) -> list[int]:
    return [t for o in outputs if o.request_id == request_id for t in o.new_token_ids]


def test_the_first_token_goes_out_alone_then_the_decodes_run_back_to_back_until_the_request_ends(engine):
    thread = _thread(PlainBackend(engine, 0), UNBOUNDED_MS)
    prompt = [5 + i for i in range(20)]
    _add(thread, "a", prompt, 8)
    first = thread.turn()[0]
    assert thread.last_turn_steps == 1 and _tokens(first, "a") and not first[-1].finished  # prefill: one step
    rest = thread.turn()[0]
    assert thread.last_turn_steps == 7 and [o.finished for o in rest] == [False] * 6 + [True]
    assert _tokens(first, "a") + _tokens(rest, "a") == _reference(engine.cfg.model_dir, [prompt], [8])[0]


def test_without_a_budget_every_turn_runs_one_step(engine):
    thread = _thread(PlainBackend(engine, 0), 0.0)
    _add(thread, "a", [5 + i for i in range(20)], 6)
    steps = []
    while not steps or engine.has_unfinished():
        thread.turn()
        steps.append(thread.last_turn_steps)
    assert steps == [1] * 6


def test_the_run_ends_at_the_step_where_a_request_finishes_and_at_a_new_prefill(engine):
    thread = _thread(PlainBackend(engine, 0), UNBOUNDED_MS)
    prompts = [[5 + i for i in range(20)], [40 + i for i in range(12)]]
    _add(thread, "short", prompts[0], 3)
    _add(thread, "long", prompts[1], 9)
    outputs = thread.turn()[0]  # both prefills in one step
    assert thread.last_turn_steps == 1
    outputs += thread.turn()[0]
    assert thread.last_turn_steps == 2 and [(o.request_id, o.finished) for o in outputs[-2:] if o.finished] == [
        ("short", True)
    ]
    _add(thread, "late", [90 + i for i in range(16)], 2)  # its prefill step ends the next run at once
    outputs += thread.turn()[0]
    assert thread.last_turn_steps == 1 and "late" in {o.request_id for o in outputs[-2:]}
    while engine.has_unfinished():
        outputs += thread.turn()[0]
    want = _reference(engine.cfg.model_dir, prompts + [[90 + i for i in range(16)]], [3, 9, 2])
    assert [_tokens(outputs, r) for r in ("short", "long", "late")] == want


class InboxOnStep(PlainBackend):
    """Puts an abort of an unknown request into the inbox during its `at`-th step (the event loop acting while
    a run of steps goes on)."""

    def __init__(self, engine, at: int) -> None:
        super().__init__(engine, 0)
        self.at, self.steps, self.inbox = at, 0, None

    def step(self):
        self.steps += 1
        if self.steps == self.at:
            self.inbox.put(("abort", "nobody"))
        return super().step()


def test_anything_the_event_loop_puts_in_the_inbox_ends_the_run_after_the_step_under_way(engine):
    backend = InboxOnStep(engine, at=3)
    thread = _thread(backend, UNBOUNDED_MS)
    backend.inbox = thread.inbox
    _add(thread, "a", [5 + i for i in range(20)], 12)
    thread.turn()  # step 1: the prefill
    thread.turn()
    assert thread.last_turn_steps == 2 and len(thread.inbox) == 1  # steps 2 and 3; the abort waits for the turn
    thread.turn()
    assert len(thread.inbox) == 0 and thread.last_turn_steps == 12 - 3


class SlowSteps(PlainBackend):
    def __init__(self, engine, step_s: float) -> None:
        super().__init__(engine, 0)
        self.step_s = step_s

    def step(self):
        time.sleep(self.step_s)
        return super().step()


def test_a_run_never_passes_its_budget_at_the_mean_step_so_far(engine):
    # steps of at least 20 ms against a 50 ms budget: after two (>= 40 ms) a third would pass it
    thread = _thread(SlowSteps(engine, 0.02), 50.0)
    _add(thread, "a", [5 + i for i in range(20)], 10)
    thread.turn()
    runs = []
    while engine.has_unfinished():
        thread.turn()
        runs.append(thread.last_turn_steps)
    assert sum(runs) == 9 and all(1 <= n <= 2 for n in runs), runs


def _session_chunks(engine, budget_ms: float, requests: list[tuple[str, list[int], int]]) -> list:
    """The chunks a WorkerSession over `engine` publishes for `requests` (id, prompt, max_tokens; logprobs with 2
    alternatives, stop strings off), run to their ends with `budget_ms` per turn."""
    from types import SimpleNamespace

    from nitsum.wire.messages import RunRequest
    from nitsum_services.worker.session import WorkerSession
    from tests.unit.test_session_stale_outputs import Anything

    bus = SimpleNamespace(subjects=SimpleNamespace(frames_gateway=lambda _s: "", stream=lambda r, w: f"s.{w}.{r}"))
    session = WorkerSession(PlainBackend(engine, 0), bus, "w1", Anything(), Anything(), budget_ms)
    sent = []
    session.publisher = SimpleNamespace(send=lambda _subject, chunk: sent.append(chunk), flush=lambda: asyncio.sleep(0))

    async def scenario() -> None:
        stop = asyncio.Event()
        for request_id, prompt, max_tokens in requests:
            spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
            req = SubmitRequest(request_id, tuple(prompt), spec, "interactive", 1e3, 1e2, 1.0, 0.0, "s")
            session.submit(RunRequest(req))
        task = asyncio.create_task(session.run(stop))
        for _ in range(1000):
            if sum(c.finished for c in sent) == len(requests):
                break
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 10.0)

    asyncio.run(scenario())
    return sent


def test_a_run_of_steps_goes_out_as_one_chunk_per_request_equal_to_its_steps_chunks(engine, tiny_model_dir):
    requests = [("a", [5 + i for i in range(20)], 9), ("b", [60 + i for i in range(7)], 5)]
    merged = _session_chunks(engine, UNBOUNDED_MS, requests)
    fresh = Engine(EngineConfig(model_dir=str(tiny_model_dir), block_size=16, num_kv_blocks=64))
    single = _session_chunks(fresh, 0.0, requests)
    assert all(len(c.token_ids) == 1 for c in single)  # one step a turn: a chunk per token
    for request_id, _prompt, max_tokens in requests:
        mine = [c for c in merged if c.request_id == request_id]
        theirs = [c for c in single if c.request_id == request_id]
        assert len(mine) < len(theirs) == max_tokens  # runs of steps: fewer chunks, the same stream
        assert [c.index for c in mine] == [0] + [sum(len(m.token_ids) for m in mine[:i]) for i in range(1, len(mine))]
        for field in ("token_ids", "logprobs", "top_logprob_ids", "top_logprob_values"):
            assert sum((getattr(c, field) for c in mine), ()) == sum((getattr(c, field) for c in theirs), ()), field
        assert "".join(c.text for c in mine) == "".join(c.text for c in theirs)
        assert mine[-1].finished and mine[-1].finish_reason == theirs[-1].finish_reason == "length"
        assert not any(c.finished for c in mine[:-1]) and {c.top_k for c in mine} == {2}


class FailsAt(PlainBackend):
    def __init__(self, engine, at: int) -> None:
        super().__init__(engine, 0)
        self.at, self.steps = at, 0

    def step(self):
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError("device lost")
        return super().step()


def test_a_step_that_fails_inside_a_run_lets_the_runs_earlier_tokens_out_and_fails_the_next_turn(engine):
    thread = _thread(FailsAt(engine, at=4), UNBOUNDED_MS)
    prompt = [5 + i for i in range(20)]
    _add(thread, "a", prompt, 8)
    first = thread.turn()[0]
    rest = thread.turn()[0]  # steps 2 and 3 went well, step 4 raised
    assert thread.last_turn_steps == 2
    assert _tokens(first, "a") + _tokens(rest, "a") == _reference(engine.cfg.model_dir, [prompt], [8])[0][:3]
    with pytest.raises(RuntimeError, match="device lost"):
        thread.turn()  # the session fails the requests in flight, as for a failed first step
    thread.turn()  # once: the next turn steps again
    assert thread.last_turn_steps >= 1
