"""How long the old group's next step may wait for a TP transition's next message: its pre-copy flows'
permits after a pending prepare, or the commit after the final prepare ack. Each hold is a fraction of the
group's steady step (the median of its recent steps), and none for a fast group."""

from __future__ import annotations

import asyncio
import statistics
from collections import deque

# After a prepare came back pending, the old group's next step waits this long at most for its pre-copy flows to
# be permitted (one flow-scheduler round trip: 2-5 ms here, up to ~10 when four old leaders ask at once), so that
# their first round runs before that step rather than after it -- a whole step sooner (and the final prepare
# ack with it). Never more than this fraction of a steady step: the streams lose at most that, once (a quarter
# was too short for merges of four groups: mid model, 20 ms steps, 0.5 -> totals 44-66 ms vs 48-76).
PRECOPY_HOLD_MAX_S = 0.025
PRECOPY_HOLD_STEP_FRACTION = 0.5
# Below this steady step the hold is not worth it: a fraction of it is shorter than the permits' round trip, and
# holding stacks the prepare step, the hold, the first round and the next step into one gap that streams see.
PRECOPY_HOLD_MIN_STEP_MS = 8.0
# ... and for the commit after the final prepare ack only from this step time on: that wait lies inside the
# streams' cutover gap (hold + commit + the new group's first step), where a 9-10 ms group's half-step hold
# made the pause 2.0-2.3 steps; with longer steps the hold is worth it (the commit comes at this boundary,
# not after the slowest old leader's next step).
COMMIT_HOLD_MIN_STEP_MS = 12.0
STEADY_STEPS = 16  # steps a steady step time is the median of (`steady_step_ms`)


class StepHolds:
    """The group's recent step times and the holds they allow; the waits run on the event loop."""

    def __init__(self) -> None:
        self.recent_step_ms: deque[float] = deque(maxlen=STEADY_STEPS)  # the last steps that produced tokens

    def steady_step_ms(self) -> float:
        """A steady step of this group: the median of its last STEADY_STEPS steps that produced tokens. A few
        long steps (prefills, a stream's first steps) do not move it; the EWMA did, for ~25 steps after one,
        and a change in that time held the old group's steps for nothing (a 4-7 ms tiny-model group kept no
        token out for a whole merge, 50-60 ms)."""
        return statistics.median(self.recent_step_ms) if self.recent_step_ms else 0.0

    def hold_s(self, min_step_ms: float = 0.0) -> float:
        """How long the old group's next step may wait for a transition's next message (0: not at all): for
        the pre-copy's permits from PRECOPY_HOLD_MIN_STEP_MS steps on, for the commit from `min_step_ms`."""
        step_ms = self.steady_step_ms()
        if step_ms < max(PRECOPY_HOLD_MIN_STEP_MS, min_step_ms):
            return 0.0
        return min(PRECOPY_HOLD_MAX_S, PRECOPY_HOLD_STEP_FRACTION * step_ms / 1000.0)

    async def await_command(self, inbox, wake: asyncio.Event) -> None:
        """The prepare's final ack went out: wait for the next inbox item (the commit, normally) at most
        `hold_s`; the step thread's next turn applies it before any step."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s(COMMIT_HOLD_MIN_STEP_MS)
        while not inbox:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), remaining)
            except TimeoutError:
                return

    async def await_permits(self, backend, wake: asyncio.Event) -> None:
        """A prepare came back pending: the migration driver (the prepare's handler, which runs while this
        waits) is getting its pre-copy flows' permits. Wait until every flow is allowed, at most
        PRECOPY_HOLD_STEP_FRACTION of a steady step (capped at PRECOPY_HOLD_MAX_S; not at all below
        PRECOPY_HOLD_MIN_STEP_MS); the step thread's next turn then runs their first round before its step."""
        hold_s = self.hold_s()
        if hold_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        await asyncio.sleep(0)  # the prepare's handler takes its ack and starts the driver
        while not backend.precopy_all_allowed():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            wake.clear()  # `allow` wakes it (MigrationDriver); the loop re-reads the inbox anyway
            try:
                await asyncio.wait_for(wake.wait(), remaining)
            except TimeoutError:
                return
