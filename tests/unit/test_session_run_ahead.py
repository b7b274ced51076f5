"""The worker's step loop starts the next engine step before it publishes the last one's tokens (a plain decode
step of a leader with more to step), and never across a topology command, a call or a commit hold."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from nitsum_services.worker.session import WorkerSession

STEPS = 4
WAIT_S = 10.0  # a bound on a wait that, run ahead, ends at once (not a timing assertion)


class SteppingBackend:
    """A leader with one request that takes STEPS steps; each step says when it started."""

    is_leader = True
    in_world = False
    precopy_active = False

    def __init__(self) -> None:
        self.started = [threading.Event() for _ in range(STEPS)]
        self.steps = 0

    def stats(self):
        return SimpleNamespace(num_waiting=0)

    def has_unfinished(self) -> bool:
        return self.steps < STEPS

    def precopy_tick(self) -> bool:
        return False

    def idle_tick(self) -> None:
        pass

    def step(self):
        i = self.steps
        self.started[i].set()
        self.steps += 1
        return [SimpleNamespace(request_id="r", index=i)]


def test_the_next_step_runs_while_the_last_ones_tokens_are_published():
    backend = SteppingBackend()
    session = WorkerSession(backend, bus=None, worker_id="w1", metrics=None, tracer=None)
    published: list[tuple[int, bool]] = []  # (output index, had the next step started when it was published)

    async def publish(out) -> None:
        nxt = out.index + 1
        ran_ahead = nxt >= STEPS or await asyncio.to_thread(backend.started[nxt].wait, WAIT_S)
        published.append((out.index, ran_ahead))

    session._publish = publish

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(session.run(stop))
        while len(published) < STEPS:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, WAIT_S)

    asyncio.run(run())
    assert published == [(i, True) for i in range(STEPS)], "tokens in order, each published as the next step ran"


def test_no_run_ahead_across_commands_calls_or_holds():
    backend = SteppingBackend()
    session = WorkerSession(backend, bus=None, worker_id="w1", metrics=None, tracer=None)
    thread = session.step_thread
    out = [SimpleNamespace(request_id="r", index=0)]
    ack = SimpleNamespace(phase="prepare", ok=True, pending=False)
    assert thread.may_run_ahead(out, [], [])
    assert not thread.may_run_ahead([], [], []), "nothing stepped: the loop checks for idleness first"
    assert not thread.may_run_ahead(out, [(None, ack)], []), "a topology command settles first"
    assert not thread.may_run_ahead(out, [], [(None, None, None)]), "a call's result goes out first"
    thread.hold_for_commit = True
    assert not thread.may_run_ahead(out, [], []), "a commit hold waits for the command"
    thread.hold_for_commit = False
    backend.steps = STEPS
    assert not thread.may_run_ahead(out, [], []), "nothing left to step"
    backend.is_leader = False
    backend.steps = 0
    assert not thread.may_run_ahead(out, [], []), "a peer follows its leader's plans"
