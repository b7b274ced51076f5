"""A request re-submitted under the same id while the engine steps its earlier incarnation: the step that was
already running returns a token of the old incarnation (its abort and the new add wait in the inbox), which must
not go out as the new attempt's next token (a foreign token in the stream, seen as one extra token after a NATS
failover re-routed a stream back to the same decode worker)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from nitsum.wire.messages import RunRequest, SamplingSpec, SubmitRequest
from nitsum_services.worker.session import WorkerSession

WAIT_S = 10.0  # bounds on waits that end at once when the code works (not timing assertions)


class Anything:
    """Metrics, tracer and spans: every attribute and call answers with itself."""

    def __getattr__(self, _name):
        return self

    def __call__(self, *_a, **_k):
        return self


class SteppingBackend:
    is_leader, in_world, precopy_active, engine = True, False, False, None

    def __init__(self) -> None:
        self.steps = 0
        self.hold = threading.Event()  # the second step waits here, so the test can act while it runs
        self.second_started = threading.Event()
        self.added: list[str] = []

    def stats(self):
        return SimpleNamespace(num_waiting=0)

    def add_request(self, request_id, _tokens, _params, _slo=None) -> None:
        self.added.append(request_id)

    def abort(self, _request_id) -> bool:
        return True

    def has_unfinished(self) -> bool:
        return self.steps < 3

    def precopy_tick(self) -> bool:
        return False

    def idle_tick(self) -> None:
        pass

    def step(self):
        self.steps += 1
        if self.steps == 2:
            self.second_started.set()
            assert self.hold.wait(WAIT_S)
        out = dict(text_delta="", finished=False, finish_reason=None, num_cached_prompt_tokens=0, logprob=None)
        return [SimpleNamespace(request_id="r", new_token_ids=(100 + self.steps,), top_logprobs=(), **out)]


def _run(attempt: int, resumed: tuple[int, ...] = ()) -> RunRequest:
    req = SubmitRequest(
        "r", (1, 2, 3), SamplingSpec(max_tokens=8), "interactive", 1e3, 1e2, 1.0, 0.0, "s", attempt=attempt
    )
    return RunRequest(SubmitRequest(**{**req.__dict__, "output_token_ids": resumed}) if resumed else req)


def test_a_token_of_the_replaced_incarnation_is_not_published_as_the_new_attempts():
    backend = SteppingBackend()
    bus = SimpleNamespace(subjects=SimpleNamespace(frames_gateway=lambda _s: "", stream=lambda r, w: f"s.{w}.{r}"))
    session = WorkerSession(backend, bus=bus, worker_id="w1", metrics=Anything(), tracer=Anything())
    sent = []
    session.publisher = SimpleNamespace(send=lambda _subject, chunk: sent.append(chunk), flush=lambda: asyncio.sleep(0))

    async def scenario() -> None:
        stop = asyncio.Event()
        session.submit(_run(0))
        task = asyncio.create_task(session.run(stop))
        assert await asyncio.to_thread(backend.second_started.wait, WAIT_S)
        # while step 2 runs: the gateway re-routed the stream (attempt 1, resuming after the token it has)
        session.abort("r", "rerouted")
        session.submit(_run(1, resumed=(101,)))
        backend.hold.set()
        for _ in range(int(WAIT_S / 0.01)):
            if backend.steps >= 3 and any(c.attempt == 1 for c in sent):
                break
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, WAIT_S)

    asyncio.run(scenario())
    assert [(c.attempt, c.index, c.token_ids) for c in sent if c.attempt == 0] == [(0, 0, (101,))]
    # step 2 stepped attempt 0 (its abort and attempt 1's add were still in the inbox): its token 102 is not
    # attempt 1's; attempt 1's stream goes on at index 1 with step 3's token
    assert [(c.attempt, c.index, c.token_ids) for c in sent if c.attempt == 1] == [(1, 1, (103,))]
    assert backend.added == ["r", "r"]
