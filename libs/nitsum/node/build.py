"""A transition's work off the step thread: the new runner made ready (`RunnerBuild`) and the new group's
Engine made ahead of the commit (`EngineAhead`). Both are owned by one `Transition`; neither outlives it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from nitsum.engine.runner import ModelRunner

log = logging.getLogger("nitsum.node.build")


class EngineAhead:
    """The new group's Engine, made in a thread once prepare's exchanges are over (its block pool alone is
    ~2 ms of Python for the tiny model's 16k blocks at TP4, which the commit -- inside the streams' pause --
    no longer pays). It waits for the runner's build; any failure leaves the commit to make the Engine itself."""

    def __init__(self, build: RunnerBuild, make: Callable[[ModelRunner], Any]) -> None:
        self.engine: Any = None
        self._thread = threading.Thread(target=self._run, args=(build, make), name="nitsum-prepare-engine", daemon=True)
        self._thread.start()

    def _run(self, build: RunnerBuild, make: Callable[[ModelRunner], Any]) -> None:
        build.wait_ready()
        runner = build.runner
        if runner is None or build.runner_error:
            return
        try:
            self.engine = make(runner)
        except Exception:  # noqa: BLE001 -- the commit makes it again and meets the error there
            log.exception("making the new group's engine ahead failed (the commit makes it)")

    def take(self, runner: ModelRunner) -> Any:
        """The Engine made for `runner`, or None (then the caller makes one)."""
        self._thread.join()
        engine, self.engine = self.engine, None
        return engine if engine is not None and engine.runner is runner else None


class RunnerBuild:
    """The new runner made ready in a thread while the old group keeps decoding: taken from the worker's pool
    of runners built ahead (or built, when the pool has none: modules and rope tables, 100-400 ms on a loaded
    2-core host for the ~27M model), and, in shm mode, the new cache segment's pages reserved (a 64 MiB
    posix_fallocate is ~10-25 ms of kernel page zeroing; paced, and it may go on after the commit: see
    `Transition.adopt_runner`). Nothing needs the runner before commit: pre-copy writes into
    the new cache, which prepare allocates itself (so that a lack of memory refuses the epoch in prepare).
    Prepare starts it only once the span agreed (`start`), so that this work does not compete with the
    prepare step's exchanges -- the part of a change that stops the old group. (Pre-copy may then write into
    pages not reserved yet; /dev/shm's room was checked when the segment was created, and only another
    program filling it in these milliseconds could make such a write fail.)"""

    def __init__(
        self,
        fn: Callable[[], ModelRunner],
        start: bool = True,
        cancel: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """`fn` makes the runner; `after` (the segment's reservation) runs next in the same thread. The final
        prepare ack and the commit wait only for the runner (`ready`); a failure of the runner, or of a
        reservation that already ended, refuses the epoch on the whole span at commit."""
        self.runner: ModelRunner | None = None
        self.error = ""  # of fn or of after
        self.runner_error = ""  # of fn only
        self.started = False
        self._threadless = False
        self._cancel = cancel
        self._after = after
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name="nitsum-prepare-build", daemon=True)
        if start:
            self.start()

    @staticmethod
    def at_once(runner: ModelRunner) -> RunnerBuild:
        """A build that is already done: the runner came from the worker's pool and there is nothing to reserve
        (the new cache is the spare arena). No thread, so nothing for the final prepare ack to wait for."""
        build = RunnerBuild(lambda: runner, start=False)
        build.runner, build.started, build._threadless = runner, True, True
        build._ready.set()
        return build

    def finish(self) -> None:
        """A prepare that failed or is dropped: wait for a started build; one never started is given up
        (`cancel`: e.g. the reserve's descriptor closed) rather than run for nothing."""
        if self.started:
            if not self._threadless:
                self._thread.join()
        elif self._cancel is not None:
            self.started = True  # nothing may start it now
            cancel, self._cancel = self._cancel, None
            cancel()

    def stop_after(self) -> None:
        """Give up `after` (a reservation) at its next piece, or before it starts."""
        stop = getattr(self._after, "close", None)
        if stop is not None:
            stop()

    def start(self) -> None:
        if not self.started:
            self.started = True
            self._thread.start()

    def _run(self, fn: Callable[[], ModelRunner]) -> None:
        try:
            self.runner = fn()
        except (RuntimeError, MemoryError, ValueError, OSError) as exc:  # told to the span at the exchange
            self.error = self.runner_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._ready.set()
        if self._after is not None:
            try:
                self._after()
            except (RuntimeError, MemoryError, ValueError, OSError) as exc:  # told to the span at commit
                self.error = self.error or f"{type(exc).__name__}: {exc}"

    @property
    def done(self) -> bool:
        return self.started and (self._threadless or not self._thread.is_alive())

    @property
    def ready(self) -> bool:
        """The runner is made (or failed); `after` may still run."""
        return self.started and self._ready.is_set()

    def wait_ready(self) -> None:
        self.start()
        self._ready.wait()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until it is done (a build nobody started yet starts now)."""
        self.start()
        if not self._threadless:
            self._thread.join(timeout_s)


class PageReservations:
    """The page reservations of caches that commits switched to (paced, they may take a while and nothing needs
    to wait for them: the pages a worker writes are backed by the writes, and a retired cache's pages go with
    its last mapping and the reservation's descriptor)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._builds: list[RunnerBuild] = []

    def append(self, build: RunnerBuild) -> None:
        self._builds.append(build)

    def reap(self, wait: bool = False, stop: bool = False) -> None:
        """Forget the finished ones (a failed one is logged); `stop` gives the others up at their next piece,
        `wait` waits for them (stop, tests)."""
        keep = []
        for build in self._builds:
            if stop:
                build.stop_after()
            if wait or stop:
                build.wait()
            if not build.done:
                keep.append(build)
            elif build.error:
                log.warning(
                    "worker %d: the KV cache's page reservation failed (%s); its pages come as they are touched",
                    self.rank,
                    build.error,
                )
        self._builds = keep
