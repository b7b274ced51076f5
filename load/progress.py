"""A one-line live progress bar on a terminal (stderr by default), redrawn a few times a second."""

from __future__ import annotations

import asyncio
import time
from typing import TextIO

from nitsum_load.runner import Counters

BAR_WIDTH = 24


def render(c: Counters, elapsed_s: float, width: int = BAR_WIDTH) -> str:
    """The bar's text. Progress is requests finished over planned, or elapsed over duration when that is
    further along (a duration-bound run may end before every planned request is sent)."""
    frac = c.done / c.planned if c.planned else 1.0
    if c.duration_s:
        frac = max(frac, min(1.0, elapsed_s / c.duration_s))
    frac = min(1.0, frac)
    filled = int(round(frac * width))
    bar = "#" * filled + "-" * (width - filled)
    return (
        f"[{bar}] {frac * 100:5.1f}%  sent {c.sent}/{c.planned}  in flight {c.in_flight}  "
        f"done {c.done}  failed {c.failed}  tokens {c.tokens}  {elapsed_s:6.1f}s"
    )


class ProgressBar:
    """Redraws `render(counters)` on `stream` every `interval_s` while `run()` is awaited; erases on stop."""

    def __init__(self, counters: Counters, stream: TextIO, interval_s: float = 0.25) -> None:
        self.counters = counters
        self.stream = stream
        self.interval_s = interval_s
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._last_len = 0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass  # we cancelled it
            self._task = None
        self._draw(final=True)

    def _draw(self, final: bool = False) -> None:
        line = render(self.counters, time.monotonic() - self._t0)
        # Pad over the previous line: the new one may be shorter, and \r does not erase.
        padded = line.ljust(self._last_len)
        self._last_len = len(line)
        self.stream.write("\r" + padded + ("\n" if final else ""))
        self.stream.flush()

    async def _loop(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(self.interval_s)
