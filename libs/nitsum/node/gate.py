"""The pre-copy gate of one prepare: it runs the pre-copy rounds the old group's leader drives and lets the
final prepare ack through exactly once -- when the group's chunks are all done and this worker's new runner
is built (the step thread never waits for the build unless told to), or, forced, at commit or abort.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nitsum.node.messages import TransitionAck

if TYPE_CHECKING:
    from nitsum.node.transition import Transition


class PreCopyGate:
    def __init__(self, transition: Transition) -> None:
        self.t = transition

    @property
    def pending(self) -> bool:
        """Accepted but not final yet (the pre-copy is running)."""
        return self.t.span is not None and not self.t.acked

    def run(self, chunks, classes: dict[int, int], wait_build: bool = False) -> int:
        """One pre-copy round of (flow, chunk) items; the bytes this worker sent."""
        precopy = self.t.precopy
        assert precopy is not None, "a round runs only while a pre-copy is held"
        before = dict(precopy.bytes_by_path)
        sent = precopy.run(chunks, classes)
        self.t.node.counters.moved({p: n - before[p] for p, n in precopy.bytes_by_path.items()})
        self.finish(wait_build=wait_build)
        return sent

    def finish_mine(self) -> None:
        """Commit: the rest of this worker's own chunks (normally none: the coordinator commits after every
        prepare ack; a scripted commit may come earlier, and the rest is one-sided), then the forced ack."""
        precopy = self.t.precopy
        if precopy is None:
            return
        before = dict(precopy.bytes_by_path)
        precopy.finish_mine()
        self.t.node.counters.moved({p: n - before[p] for p, n in precopy.bytes_by_path.items()})
        self.finish(force=True)

    def poll(self, wait_s: float = 0.0) -> None:
        """Every chunk is done: produce the final ack once the new runner is built (waiting up to `wait_s`)."""
        t = self.t
        if t.acked or t.precopy is None or not t.precopy.complete:
            return
        if t.build is not None and wait_s > 0:
            t.build.wait(wait_s)
        self.finish()

    def finish(self, force: bool = False, reason: str = "", wait_build: bool = False) -> None:
        """Produce the final prepare ack once (see the module docstring); `force` at commit (whose exchange
        follows every member's own remaining chunks) or abort (then it is a failure)."""
        t = self.t
        if t.acked or (not force and t.precopy is not None and not t.precopy.complete):
            return
        if not force and not wait_build and t.build is not None and not t.build.ready:
            return  # the step thread does not wait for the runner: a later poll finishes
        t.acked = True
        precopy = t.precopy
        sent = precopy.bytes_sent if precopy is not None else 0
        if not reason and precopy is not None:
            reason = precopy.error  # a KV link of this worker failed: its chunks did not land
        if not reason:
            reason = self.build_error()
        by_path = tuple(precopy.bytes_by_path.items()) if precopy is not None else ()
        t.node.prepare_done = TransitionAck(
            t.epoch, not reason, "prepare", reason, (time.perf_counter() - t.t0) * 1000.0, sent, bytes_by_path=by_path
        )

    def build_error(self) -> str:
        """Wait for this worker's new runner (normally ready long before; its cache's reservation may still
        run, see `Transition.adopt_runner`) and say whether it failed."""
        build = self.t.build
        if build is None:
            return ""
        build.wait_ready()
        return f"worker {self.t.node.rank}: {build.runner_error}" if build.runner_error else ""
