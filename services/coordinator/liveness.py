"""The coordinator's watch over its workers' heartbeats: a silent worker is declared lost (its requests
announced for re-routing), but only for silence the coordinator could have heard (`LivenessWatch.run`)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from nitsum.bus import BusError

log = logging.getLogger("nitsum.coordinator")

EXPIRE_PERIOD_S = 0.25


class LivenessWatch:
    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator  # its membership, bus, stop event, loss announcements and gauges
        self.members = coordinator.members
        self.bus = coordinator.bus
        # Since when a round trip through NATS has failed (None: the coordinator hears NATS); see `run`.
        self.deaf_since: float | None = None

    async def run(self) -> None:
        """Expire silent workers (announcing their requests for re-routing) and refresh gauges.

        A worker is judged silent only for time during which the coordinator could have heard it:
        - own stalls: when this loop wakes up well past its period (the coordinator's process or machine did not
          run: SIGSTOP, a VM pause, a blocked event loop), the excess is credited to every worker (logged);
        - before announcing a loss it hears NATS first (`expire_silent`): two round trips on its own connection,
          which also hand every heartbeat that arrived before them to `on_stats`, then a fresh look. If a round
          trip fails (nats-server stalled or down, or this process stalled meanwhile) nobody is expired: a dead
          worker and a deaf coordinator look the same. Once NATS answers again every worker's silence counts
          from then, so a worker that is really gone is announced about one heartbeat timeout later.
        Gateways keep their own stream timeouts meanwhile.
        """
        last = time.monotonic()
        while not self.coordinator.ctx.stop.is_set():
            now = time.monotonic()
            overslept = now - last - EXPIRE_PERIOD_S
            if overslept > EXPIRE_PERIOD_S:
                self.members.credit(overslept, now)
                log.warning(
                    "the coordinator did not run for %.2f s (its process or machine stalled): not counted as the workers' silence",
                    overslept,
                )
            await self.expire_silent()
            self.coordinator.update_metrics()
            last = time.monotonic()
            await _sleep_or_stop(self.coordinator.ctx.stop, EXPIRE_PERIOD_S)

    async def expire_silent(self) -> None:
        """Announce the workers silent for longer than the heartbeat timeout, once NATS proves it delivers."""
        if not self.members.silent(time.monotonic()):
            if self.deaf_since is not None:  # heartbeats are coming in again
                log.warning("NATS answers again after %.1f s", time.monotonic() - self.deaf_since)
                self.deaf_since = None
            return
        timeout_s = min(1.0, self.members.heartbeat_timeout_s / 2)
        t0 = time.monotonic()
        try:
            # Twice: a server that resumes from a stall serves its connections in any order, so the first echo
            # can overtake heartbeats the workers sent during the stall; the second is sent only once the first is
            # back, by when the server has long read what was waiting on its other connections.
            for _ in range(2):
                await self.bus.round_trip(timeout_s)
        except BusError as exc:
            if self.deaf_since is None:
                self.deaf_since = t0
                log.warning("cannot hear NATS (%s): no worker is declared lost until it answers again", exc)
            return
        now = time.monotonic()
        if self.deaf_since is not None:
            log.warning(
                "NATS answers again after %.1f s: every worker's silence counts from now", now - self.deaf_since
            )
            self.deaf_since = None
            self.members.credit(math.inf, now)
            return
        for worker_id, request_ids in self.members.expire(now):
            await self.coordinator.announce_lost(worker_id, request_ids, "heartbeat timeout")


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
