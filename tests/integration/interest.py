"""Waiting for a subscription to be visible before the first request (integration tests' shared helper)."""

from __future__ import annotations

import asyncio

from nitsum.bus import Bus, NoResponders


async def until_answered(bus: Bus, subject: str, probe, timeout_s: float = 5.0) -> None:
    """Interest can take a moment to be visible to another connection even after the subscriber flushed (seen in
    CI: a request right after got no responders): send `probe` until something answers, up to `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await bus.request(subject, probe, 1.0)
            return
        except NoResponders:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)
