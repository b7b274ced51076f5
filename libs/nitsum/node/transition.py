"""One epoch's TP change as this worker sees it: a `Transition`, from prepare to commit or abort.

See runtime.py's docstring for the protocol. Everything here runs in the step thread, at a step boundary, on
every member of a group at the same point of its command stream (the leader applies a command and
broadcasts it; peers `follow`). The worker's lasting state (world, topology, epoch, runner, engine, pools,
arenas) belongs to `NodeRuntime`; the epoch's state (its plan, new cache, build, links, pre-copy) lives here
and goes when the epoch commits or is dropped. Phases:
- prepare: `allocate` (this worker's new cache, by its `KvPath`), `exchange` (the old leaders' block tables),
  `plan_prepare`, then the path moves the full blocks (`KvPath.move_full_blocks`);
- commit: `finish_own_work` (the rest of its pre-copy, the new runner), `exchange_states`, `plan_delta`, the
  path moves the delta (`KvPath.move_delta`), then the switch (switch.py): `adopt` (the new engine takes the
  requests), `retire`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from nitsum.engine import migration
from nitsum.engine.runner import ModelRunner
from nitsum.kv.reshard import ReshardPlan, changed_groups, local_target, plan_commit, plan_prepare, transition_span
from nitsum.node import switch
from nitsum.node.build import EngineAhead, RunnerBuild
from nitsum.node.gate import PreCopyGate
from nitsum.node.kv_paths import KvPath, path_for, serve_remote_sources
from nitsum.node.messages import TransitionAck, kv_entry, request_kv
from nitsum.node.precopy import PreCopy
from nitsum.topology import Group, Topology
from nitsum.transfer import shm
from nitsum.transfer.kv_link import KvLinks
from nitsum.wire import codec
from nitsum.wire.node import Agreement, CommitShare, PrepareShare

if TYPE_CHECKING:
    from nitsum.node.runtime import NodeRuntime

log = logging.getLogger("nitsum.node.transition")

EXPECTED_FAILURES = (RuntimeError, MemoryError, ValueError, OSError)


class Transition:
    """The state of one prepared epoch on this worker (see the module docstring)."""

    def __init__(self, node: NodeRuntime, epoch: int, new: Topology, t0: float, leaders: dict | None = None) -> None:
        # new: the epoch's topology (its groups' roles with it); leaders: each new group's leader's worker id,
        # (start, tp) -> id, the node's once the epoch commits
        self.node, self.epoch, self.new, self.leaders = node, epoch, new, leaders or {}
        self.t0 = self.phase_t0 = t0  # perf_counter at prepare start (the final prepare ack runs from it); phase_t0:
        # at the start of the current phase (prepare, then commit)
        old = node.topology
        # Only this worker's component of the change: its span is that component, so independent parts of one
        # change (2xTP2 -> 4xTP1: two splits) exchange, copy and cut over each inside its own group.
        self.local = local_target(old, new, node.rank)
        span = transition_span(old, self.local)
        self.span: Group | None = span if span is not None and node.rank in span.workers else None  # None: bystander
        self.gone, self.born = changed_groups(old, self.local)
        self.my_old, self.my_new = old.group_of(node.rank), self.local.group_of(node.rank)
        self.path: KvPath = path_for(node)
        self.plan: ReshardPlan | None = None
        self.runner: ModelRunner | None = None  # the new runner, when this worker's group changes
        self.timings_ms: dict[str, float] = {}
        self.acked = self.span is None  # the final prepare ack was produced (a bystander has nothing to wait for)
        self.gate = PreCopyGate(self)
        self.precopy: PreCopy | None = None  # one-sided mode, when this worker's old group changes
        self.dst_caches: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}
        self.preemptions: dict[str, int] = {}  # old leader: request -> preemptions at prepare
        self.build: RunnerBuild | None = None  # the new runner, built in a thread until commit needs it
        self.segment: str | None = None  # this worker's new-cache segment name (when made afresh)
        self.arena: Any = None  # the shm.Arena its new cache is a view of
        self.handles: dict[int, str] = {}  # worker -> Arena.handle of its new cache (mapped through /proc)
        self.new_cache: torch.Tensor | None = None  # its new KV cache (the runner adopts it at commit)
        self.links: KvLinks | None = None  # source: its TCP links to destinations on other hosts
        self.receiving = False  # destination: its KV receiver serves this epoch's sources on other hosts
        self.engine_ahead: EngineAhead | None = None  # the new group's leader: its Engine, made during pre-copy
        self.moved_in_prepare = 0  # p2p: the full blocks' bytes this worker sent in prepare

    # -- what this worker is in the change ----------------------------------------------------------
    @property
    def source(self) -> bool:
        """Its old group changes: it holds KV to move."""
        return self.my_old in self.gone

    @property
    def destination(self) -> bool:
        """Its new group is born: it gets a new cache and runner."""
        return self.my_new in self.born

    def old_heads(self) -> tuple[int, int]:
        return migration.heads_of(self.node.layout.model_config.num_kv_heads, self.my_old, self.node.rank)

    def new_heads(self) -> tuple[int, int]:
        return migration.heads_of(self.node.layout.model_config.num_kv_heads, self.my_new, self.node.rank)

    def elapsed_ms(self) -> float:
        """Since the current phase began."""
        return _ms(self.phase_t0)

    def refusal(self, phase: str, reason: str) -> TransitionAck:
        self.drop()
        return TransitionAck(self.epoch, False, phase, reason, self.elapsed_ms())

    # -- prepare ------------------------------------------------------------------------------------
    def prepare(self) -> TransitionAck:
        if self.span is None:
            return TransitionAck(self.epoch, True, "prepare", "not affected", self.elapsed_ms())
        reason = self.allocate()
        self.timings_ms = self.node.last_prepare_timings_ms = {"allocated": self.elapsed_ms()}
        shares = self.exchange(reason)
        failures = [s.reason for s in shares if not s.ok]
        if failures:
            return self.refusal("prepare", "; ".join(failures))
        self.handles = {self.span.start + i: s.handle for i, s in enumerate(shares) if s.handle}
        self.timings_ms["exchanged"] = self.elapsed_ms()
        node = self.node
        requests = [request_kv(e) for s in shares for e in s.requests]
        self.plan = plan_prepare(node.topology, self.local, requests, node.layout.geometry, node.layout.num_blocks_of)
        self.timings_ms["planned"] = self.elapsed_ms()
        problem = self.path.move_full_blocks(self, self.plan)
        if problem:
            return self.refusal("prepare", problem)
        if not self.path.one_sided:
            self.acked = True
            moved = self.moved_in_prepare
            return TransitionAck(
                self.epoch, True, "prepare", "", self.elapsed_ms(), moved, bytes_by_path=(("p2p", moved),)
            )
        if self.precopy is not None and not self.precopy.complete:
            return TransitionAck(self.epoch, True, "prepare", "", self.elapsed_ms(), 0, pending=True)
        self.acked = True
        error = self.gate.build_error()
        return TransitionAck(self.epoch, not error, "prepare", error, self.elapsed_ms(), 0)

    def allocate(self) -> str:
        """This worker's new cache and runner build; a failure is a reason, told to the span (every worker
        must still take part in the exchange so that all of them agree to refuse the epoch)."""
        node = self.node
        try:
            if node.failure_hook is not None:
                node.failure_hook("prepare", self.epoch)
            if self.destination:
                self.path.allocate(self)
                serve_remote_sources(self)
        except EXPECTED_FAILURES as exc:  # allocation, an injected fault
            return f"worker {node.rank}: {type(exc).__name__}: {exc}"
        return ""

    def exchange(self, reason: str) -> list[PrepareShare]:
        """The span's first all-gather: who can take the epoch, the old leaders' block tables, and the handle
        of each new cache in a recycled arena (one that is a named segment is attached by its name)."""
        node = self.node
        local = node.kv_snapshot(self.my_old) if self.source else []
        handle = self.arena.handle if self.arena is not None and self.segment is None else ""
        share = PrepareShare(not reason, reason, tuple(kv_entry(r) for r in local), handle)
        return self.gather(share, PrepareShare, drop_on_error=True)

    def gather(self, message, kind: type, drop_on_error: bool) -> list:
        assert self.span is not None, "only a span worker exchanges"
        try:
            parts = self.node.world.all_gather_bytes(codec.encode(message), self.span.start, self.span.tp)
        except BaseException:
            if drop_on_error:
                self.drop()
            raise
        return [codec.decode(p, kind) for p in parts]

    def agree(self, problem: str, drop_on_error: bool = True) -> str:
        """An agreement round: every member's problem, joined ("" when nobody has one)."""
        answers = self.gather(Agreement(problem), Agreement, drop_on_error)
        return "; ".join(a.problem for a in answers if a.problem)

    def make_engine_ahead(self) -> None:
        if self.build is not None and self.destination and self.my_new.leader == self.node.rank:
            self.engine_ahead = EngineAhead(self.build, lambda runner: self.node.new_engine(self.my_new, runner))

    def note_preemptions(self) -> None:
        engine = self.node.engine
        if engine is not None:
            self.preemptions = engine.preemption_counts()

    def adopt_runner(self) -> ModelRunner:
        """The built new runner (raises RuntimeError when its build failed), with the new cache adopted. The
        runner, not the new segment's reservation (a 64 MiB posix_fallocate: 10-30 ms of page zeroing per
        worker on a loaded 2-core host, most of a commit's wait): that goes on after the switch, paced
        (`NodeRuntime.reap_reservations`). One that already failed refuses the epoch; one that fails later is
        logged, and the pages come as they are touched (/dev/shm's room was checked when the segment was made)."""
        assert self.build is not None, "a changed worker builds a new runner"
        self.build.wait_ready()
        if self.build.runner_error or (self.build.done and self.build.error):
            raise RuntimeError(self.build.error)
        runner = self.build.runner
        assert runner is not None
        if self.new_cache is not None:
            assert tuple(runner.kv_cache_shape) == tuple(self.new_cache.shape), "the new cache fits the runner"
            runner.kv_cache = self.new_cache
        return runner

    # -- commit -------------------------------------------------------------------------------------
    def commit(self) -> TransitionAck:
        node = self.node
        # Where the pause went (ms since the commit began, cumulative): the span's state exchange (it waits for
        # the slowest old leader's step boundary), the delta's plan, its copy, the agreement after it, and
        # the new engines adopting the requests.
        self.phase_t0 = time.perf_counter()
        self.timings_ms = node.last_commit_timings_ms = {}
        by_path: dict[str, int] = {}
        retired = None
        if self.span is not None:
            error = self.finish_own_work()
            self.timings_ms["built"] = self.elapsed_ms()
            shares = self.exchange_states(error)
            self.timings_ms["exchanged"] = self.elapsed_ms()
            errors = [s.error for s in shares if s.error]
            if errors:
                # Every worker saw the same: all keep the old topology (normally the leader's final prepare
                # ack already refused the epoch; a peer's build failure is only known here).
                return self.refusal("commit", "; ".join(errors))
            delta = self.plan_delta(shares)
            self.timings_ms["planned"] = self.elapsed_ms()
            by_path, problem = self.path.move_delta(self, delta)
            if problem:
                return self.refusal("commit", problem)
            if self.destination:
                retired = switch.adopt(self, shares, delta)
        switch.retire(self, retired)
        node.topology, node.epoch, node.transition, node.leaders = self.new, self.epoch, None, self.leaders
        self.timings_ms["adopted"] = self.elapsed_ms()
        return TransitionAck(
            self.epoch,
            True,
            "commit",
            "",
            self.elapsed_ms(),
            sum(by_path.values()),
            bytes_by_path=tuple(by_path.items()),
        )

    def finish_own_work(self) -> str:
        """The rest of this worker's pre-copy and its new runner; an error that makes nobody switch, or ""."""
        self.gate.finish_mine()
        if self.build is not None and self.runner is None:
            try:
                self.runner = self.adopt_runner()
            except RuntimeError as exc:  # told to the span: nobody switches
                return f"worker {self.node.rank}: new runner: {exc}"
        if self.precopy is not None and self.precopy.error:
            return self.precopy.error  # some pre-copied blocks never landed: nobody switches
        return ""

    def exchange_states(self, error: str) -> list[CommitShare]:
        """Old leaders export their requests' full state; the span all-gathers it with the block tables.
        A request preempted since prepare had its old blocks free for a while, so what pre-copy read may not
        be its KV: commit moves it afresh (`invalid`)."""
        node, engine = self.node, self.node.engine
        states, invalid = [], []
        if node.is_leader and self.source:
            assert engine is not None
            states = engine.export_states()
            invalid = [rid for rid, n in self.preemptions.items() if engine.num_preemptions(rid) not in (None, n)]
        local = node.kv_snapshot(self.my_old) if self.source else []
        share = CommitShare(
            msgpack.packb(states, use_bin_type=True),
            tuple(kv_entry(r) for r in local),
            engine.step_id if engine is not None else 0,
            tuple(invalid),
            error,
        )
        return self.gather(share, CommitShare, drop_on_error=False)

    def plan_delta(self, shares: list[CommitShare]) -> ReshardPlan:
        """The delta every worker computes alike: blocks written since prepare, requests that arrived or were
        preempted since."""
        assert self.plan is not None, "a prepared span worker has a plan"
        node = self.node
        requests = [request_kv(e) for s in shares for e in s.requests]
        stale = {rid for s in shares for rid in s.invalid}
        plan = self.plan
        if stale:
            plan = dataclasses.replace(
                plan, src_tables={rid: (() if rid in stale else t) for rid, t in plan.src_tables.items()}
            )
        return plan_commit(plan, requests, node.layout.geometry, node.layout.num_blocks_of)

    # -- abort / drop -------------------------------------------------------------------------------
    def abort(self) -> None:
        # A prepare still pre-copying gets its answer now: it never completed.
        self.gate.finish(force=True, reason="aborted during pre-copy")
        self.drop()  # the new runner, its cache, views and mappings go with it

    def drop(self) -> None:
        """A failed or aborted prepare: nothing of it stays (runner, cache, mappings, segment name)."""
        self.acked = True
        self.stop_build()
        self.release_links()
        if self.segment is not None:
            shm.unlink(self.segment)
        arena, self.arena = self.arena, None
        if arena is not None:
            # Not back to spare: a source of this epoch whose abort is late may still write a pre-copy round into
            # it (through its handle), and the next change would hand it out as a live cache. The next prepare
            # makes a fresh one (a named segment, reserved paced), which its commit then leaves as the spare.
            self.node.arenas.release(arena)
        self.new_cache = None
        if self.node.transition is self:
            self.node.transition = None

    def stop_build(self) -> None:
        """No thread outlives its epoch: a reservation running is given up at its next piece, a build never
        started is given up, the Engine made ahead goes, and the runner goes back to the pool (without the
        epoch's cache)."""
        if self.build is None:
            return
        self.build.stop_after()
        self.build.finish()
        ahead, self.engine_ahead = self.engine_ahead, None
        if ahead is not None:
            ahead.take(None)  # its thread ends (it waits only for the runner's build, finished by now)
        if self.build.runner is not None:
            self.node.pool.shelve(self.build.runner)
            self.build.runner = self.runner = None

    def close(self) -> None:
        """At stop: like `drop`, but the arena's descriptor just closes (the reaper is drained next)."""
        self.stop_build()
        self.release_links()
        if self.arena is not None:  # the spare it took, or one made for the epoch
            self.arena.close()
            self.arena = None

    def release_links(self) -> None:
        """The epoch's TCP KV links (as a source) and its receiver session (as a destination) go."""
        links, self.links = self.links, None
        if links is not None:
            links.close()
        if self.receiving:
            self.receiving = False
            receiver = self.node.receiver
            if receiver is not None and receiver.serving == self.epoch:
                receiver.close_session()


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0
