"""What the worker session drives: a plain TP=1 engine, or this worker's share of a node whose TP groups
change at run time (`NodeRuntime`). Both answer the same calls; only the node backend can become a peer
(it then follows its group leader's step plans instead of taking requests).

A `StandbyBackend` is a plain TP=1 engine of a worker that belongs to a node but is not in its world (a
restarted one, NITSUM_NODE_STANDBY): it computes on the node's boot weights (the host's shared store) so
that, when the coordinator re-forms the node world, a NodeRuntime adopts its engine as it is
(services/worker/peer_loss.py `form_generation`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nitsum.engine.params import EngineStats

log = logging.getLogger("nitsum.worker")

KEEPALIVE_S = 5.0
_IDLE_STATS = EngineStats(
    num_running=0,
    num_waiting=0,
    num_kv_blocks_total=0,
    num_kv_blocks_free=0,
    num_prefill_tokens_computed=0,
    num_cached_prompt_tokens=0,
    cached_block_hashes=[],
    num_preemptions=0,
    num_pinned=0,
)


class PlainBackend:
    in_world = False
    epoch = 0
    generation = 0

    def __init__(self, engine, device_index: int) -> None:
        self.engine = engine
        self.device_index = device_index
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def group(self) -> tuple[int, int]:
        return (self.device_index, 1)

    def add_request(self, request_id, prompt, params, slo=None) -> None:
        self.engine.add_request(request_id, prompt, params, slo)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def step(self):
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def output_counts(self) -> dict[str, int]:
        return {}

    def request_limits(self) -> dict[str, tuple[int, int, float]]:
        return {}

    def idle_tick(self) -> None:
        return None

    precopy_active = False

    def precopy_tick(self) -> bool:
        return False

    def precopy_all_allowed(self) -> bool:
        return True


class StandbyBackend(PlainBackend):
    """A standalone TP=1 engine over the node's boot weights, waiting to join a re-formed node world."""

    generation = 0  # of the node world this worker was last in (none: 0)

    def __init__(self, engine, device_index: int, weights, cfg) -> None:
        super().__init__(engine, device_index)
        self.weights = weights  # boot_weights(...) of this device: a later NodeRuntime's weights
        self.cfg = cfg  # the EngineConfig the engine was built with


class NodeBackend:
    in_world = True

    def __init__(self, runtime, model_name: str, max_model_len: int) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._last_broadcast_s = time.monotonic()
        # Pre-copy flows allowed to run (flow index -> callback(index, result)), set from the event loop
        # (MigrationDriver, once a flow has its permit), advanced by the step thread one chunk per step.
        self._allowed: dict[int, Callable[[int, tuple], None]] = {}
        self._classes: dict[int, int] = {}  # allowed flow index -> the DSCP of its permit's level
        self._allowed_lock = threading.Lock()

    @property
    def is_leader(self) -> bool:
        return self.runtime.is_leader

    @property
    def epoch(self) -> int:
        return self.runtime.epoch

    @property
    def generation(self) -> int:
        return self.runtime.world.generation

    @property
    def group(self) -> tuple[int, int]:
        g = self.runtime.group
        return (g.start, g.tp)

    def add_request(self, request_id, prompt, params, slo=None) -> None:
        self.runtime.add_request(request_id, prompt, params, slo)

    def abort(self, request_id: str) -> bool:
        return self.runtime.engine.abort(request_id) if self.runtime.engine is not None else False

    def step(self):
        self._last_broadcast_s = time.monotonic()
        return self.runtime.step()

    def has_unfinished(self) -> bool:
        return self.runtime.has_unfinished()

    def stats(self) -> EngineStats:
        return self.runtime.engine.stats() if self.runtime.engine is not None else _IDLE_STATS

    def output_counts(self) -> dict[str, int]:
        """Requests this leader's engine holds -> output tokens so far (adopted ones included)."""
        engine = self.runtime.engine
        return engine.num_output_tokens() if engine is not None else {}

    def request_limits(self) -> dict[str, tuple[int, int, float]]:
        """Requests this leader's engine holds -> (prompt tokens, max_tokens, TPOT ms) as the engine runs them."""
        engine = self.runtime.engine
        return engine.request_limits() if engine is not None else {}

    def command(self, cmd):
        self._last_broadcast_s = time.monotonic()
        return self.runtime.command(cmd)

    def follow(self) -> str:
        return self.runtime.follow()

    # -- a transition's pre-copy (shm path), run between steps by the old group's leader ---------------
    def precopy_flows(self):
        """The flows of a pending prepare (immutable once prepare returned, so the event loop may read them)."""
        return self.runtime.precopy_flows()

    def allow(self, flow_index: int, on_done: Callable[[int, tuple], None], dscp: int | None = None) -> None:
        """Event loop: this flow may run now, its chunks across hosts in class `dscp` (the DSCP of the level
        its permit grants; None: the lowest level's). Allowing it again with another class (a promotion)
        moves its next chunks to that class. `on_done(index, (ok, final prepare ack or None, error))` is
        called from the step thread when its last chunk ran, or when the pre-copy ended without it."""
        with self._allowed_lock:
            self._allowed[flow_index] = on_done
            if dscp is None:
                self._classes.pop(flow_index, None)
            else:
                self._classes[flow_index] = dscp

    @property
    def precopy_active(self) -> bool:
        return bool(self._allowed)

    def precopy_all_allowed(self) -> bool:
        """Every flow of the pending prepare's pre-copy may run (True when no pre-copy is pending)."""
        if not self.runtime.precopy_pending:
            return True
        flows = self.runtime.precopy_flows()
        with self._allowed_lock:
            return all(f.index in self._allowed for f in flows)

    def precopy_tick(self) -> bool:
        """Step thread, before a step: the next chunk of every allowed flow, all pairs in one round. True when
        this tick produced the prepare's final ack (the coordinator's commit is next)."""
        with self._allowed_lock:
            allowed = dict(self._allowed)
            classes = {i: d for i, d in self._classes.items() if i in allowed}
        if not allowed:
            return False
        runtime = self.runtime
        if not runtime.is_leader or not runtime.precopy_pending:
            self._finish(allowed, (False, runtime.take_prepare_ack(), "the pre-copy ended (commit or abort)"))
            return False
        items = runtime.precopy_next_items(allowed)
        if items:
            try:
                self._last_broadcast_s = time.monotonic()
                runtime.precopy(items, classes=classes)
            except Exception as exc:  # a collective failed (a peer died)
                why = f"pre-copy round failed: {type(exc).__name__}: {exc}"
                self._finish(allowed, (False, None, why))
                self._collective_failed(why)
                return False
        else:  # every chunk is done; the final ack waits for the new runner (idle: wait a little here)
            runtime.poll_prepare(0.0 if runtime.has_unfinished() else 0.01)
        final = runtime.take_prepare_ack()
        if final is not None:
            self._finish(allowed, (final.ok, final, final.reason))
            return final.ok
        finished, complete = runtime.precopy_flows_done(allowed)
        done = {i: cb for i, cb in allowed.items() if i in finished}
        if done and not complete:  # the last flows stay until the final ack
            self._finish(done, (True, None, ""))
        return False

    def _collective_failed(self, why: str) -> None:
        """A transition collective failed outside a command: the peer-loss guard (PeerLossGuard in
        services/worker/peer_loss.py, a subclass) decides what this worker does next, as for a command."""
        log.error("node world collective failed: %s", why)
        handler = getattr(self, "_after_failure", None)
        if handler is not None:
            handler(why, in_transition=True)

    def _finish(self, flows: dict[int, Callable[[int, tuple], None]], result: tuple) -> None:
        with self._allowed_lock:
            for i in flows:
                self._allowed.pop(i, None)
                self._classes.pop(i, None)
        for i, on_done in flows.items():
            on_done(i, result)

    def idle_tick(self) -> None:
        """Leader with nothing to run: keep peers' broadcasts from timing out."""
        if self.runtime.is_leader and time.monotonic() - self._last_broadcast_s > KEEPALIVE_S:
            self.runtime.keepalive()
            self._last_broadcast_s = time.monotonic()
