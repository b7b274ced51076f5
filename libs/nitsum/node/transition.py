"""The transition half of a node-world worker (`NodeRuntime` mixes it in): Prepare / Commit / Abort with
epochs, the pre-copy between steps, and the messages and acks they use. See runtime.py's docstring for the
protocol; everything here runs in the step thread, at a step boundary, on every member of a group at the
same point of its command stream (the leader applies a command and broadcasts it; peers `follow`).

The state these methods read and write (world, rank, topology, epoch, runner, engine, the prepared
transition) belongs to `NodeRuntime`; this module only keeps the long transition code out of it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgpack
import torch

from nitsum.engine import migration
from nitsum.node import kv_segment
from nitsum.node.kv_tcp import STAGE_M_DSCP, KvLinks
from nitsum.node.precopy import MigrationFlow, PreCopy, copy_transfers_one_sided, plan_flows, transfer_block_bytes
from nitsum.engine.runner import ModelRunner
from nitsum.kv.reshard import (
    Group,
    RequestKV,
    ReshardPlan,
    Topology,
    changed_groups,
    plan_commit,
    plan_prepare,
    local_target,
    transition_span,
)
from nitsum.model import loader
from nitsum.transfer.framing import TransferError

log = logging.getLogger("nitsum.node.transition")

COMMAND_KINDS = ("prepare", "commit", "abort", "precopy")
KV_PATHS = ("auto", "shm", "tcp", "p2p")


@dataclass(frozen=True)
class NodeCommand:
    """A topology command as it travels inside a control step plan (msgpack)."""

    kind: str
    epoch: int
    groups: tuple[tuple[int, int], ...] = ()  # prepare: the new topology as (start, tp) pairs
    chunks: tuple[tuple[int, int], ...] = ()  # precopy: (flow index, chunk index) items to run now
    # precopy: (flow index, DSCP of its permit's level); a flow not here goes across hosts at the lowest level's
    classes: tuple[tuple[int, int], ...] = ()

    def encode(self) -> bytes:
        return msgpack.packb([self.kind, self.epoch, [list(g) for g in self.groups], [list(c) for c in self.chunks],
                              [list(c) for c in self.classes]], use_bin_type=True)

    @staticmethod
    def decode(payload: bytes) -> NodeCommand:
        kind, epoch, groups, chunks, classes = msgpack.unpackb(payload, raw=False)
        if kind not in COMMAND_KINDS:
            raise ValueError(f"unknown node command {kind!r}")
        return NodeCommand(kind, int(epoch), tuple((int(s), int(t)) for s, t in groups),
                           tuple((int(f), int(c)) for f, c in chunks), tuple((int(f), int(d)) for f, d in classes))


@dataclass(frozen=True)
class TransitionAck:
    """Mirrors the wire's TopologyAck (the worker shell adds its id)."""

    epoch: int
    ok: bool
    phase: str  # "prepare" | "commit" | "abort"
    reason: str = ""
    duration_ms: float = 0.0
    bytes_moved: int = 0  # KV bytes this worker sent to other workers
    pending: bool = False  # prepare: accepted, pre-copy running between steps; the final ack follows
    bytes_by_path: tuple[tuple[str, int], ...] = ()  # bytes_moved by path ("shm", "tcp", "p2p"): metrics


@dataclass
class _Prepared:
    epoch: int
    new: Topology
    span: Group | None  # None: this worker is outside the span (a bystander)
    local: Topology | None = None  # the change as this worker's component sees it (`kv.reshard.local_target`)
    plan: ReshardPlan | None = None
    runner: ModelRunner | None = None  # the new runner, when this worker's group changes
    timings_ms: dict[str, float] = field(default_factory=dict)
    t0: float = 0.0  # perf_counter at prepare start (the final prepare ack's duration runs from here)
    precopy: PreCopy | None = None  # one-sided mode (shm / tcp), when this worker's old group changes
    dst_caches: dict[int, tuple[torch.Tensor, tuple[int, int]]] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)  # old leader: request -> preemptions at prepare
    acked: bool = False  # the final prepare ack was produced
    build: _Build | None = None  # the new runner, built in a thread (one-sided mode) until commit needs it
    segment: str | None = None  # this worker's new-cache segment name (shm path, when made afresh)
    arena: Any = None  # the kv_segment.Arena its new cache is a view of (shm path with arenas)
    handles: dict = field(default_factory=dict)  # worker -> Arena.handle of its new cache (mapped through /proc)
    new_cache: torch.Tensor | None = None  # its new KV cache in that segment (the runner adopts it at commit)
    links: KvLinks | None = None  # source: its TCP links to destinations on other hosts
    receiving: bool = False  # destination: its KV receiver serves this epoch's sources on other hosts
    engine: _EngineAhead | None = None  # the new group's leader: its Engine, made while pre-copy runs


class _EngineAhead:
    """The new group's Engine, made in a thread once prepare's exchanges are over (its block pool alone is
    ~2 ms of Python for the tiny model's 16k blocks at TP4, which the commit -- inside the streams' pause --
    no longer pays). It waits for the runner's build; any failure leaves the commit to make the Engine itself."""

    def __init__(self, build: _Build, make: Callable[[ModelRunner], Any]) -> None:
        self.engine: Any = None
        self._thread = threading.Thread(target=self._run, args=(build, make), name="nitsum-prepare-engine",
                                        daemon=True)
        self._thread.start()

    def _run(self, build: _Build, make: Callable[[ModelRunner], Any]) -> None:
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


class _Build:
    """The new runner made ready in a thread while the old group keeps decoding: taken from the worker's pool
    of runners built ahead (or built, when the pool has none: modules and rope tables, 100-400 ms on a loaded
    2-core host for the ~27M model), and, in shm mode, the new cache segment's pages reserved (a 64 MiB
    posix_fallocate is ~10-25 ms of kernel page zeroing; paced, and it may go on after the commit: see
    `_wait_runner`). Nothing needs the runner before commit: pre-copy writes into
    the new cache, which prepare allocates itself (so that a lack of memory refuses the epoch in prepare).
    Prepare starts it only once the span agreed (`start`), so that this work does not compete with the
    prepare step's exchanges -- the part of a change that stops the old group. (Pre-copy may then write into
    pages not reserved yet; /dev/shm's room was checked when the segment was created, and only another
    program filling it in these milliseconds could make such a write fail.)"""

    def __init__(self, fn: Callable[[], ModelRunner], start: bool = True,
                 cancel: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
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
    def at_once(runner: ModelRunner) -> _Build:
        """A build that is already done: the runner came from the worker's pool and there is nothing to reserve
        (the new cache is the spare arena). No thread, so nothing for the final prepare ack to wait for."""
        build = _Build(lambda: runner, start=False)
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


class NodeTransition:
    """Mixed into NodeRuntime: the transition commands and the pre-copy (see the module docstring)."""

    # -- pre-copy between steps (one-sided mode) --------------------------------------------------------
    @property
    def precopy_pending(self) -> bool:
        """A prepare of this worker is accepted but not final yet (its pre-copy is running)."""
        prepared = self._prepared
        return prepared is not None and prepared.span is not None and not prepared.acked

    def precopy_flows(self) -> tuple[MigrationFlow, ...]:
        """The migration flows this worker's old group still has to pre-copy (its leader drives them)."""
        prepared = self._prepared
        if prepared is None or prepared.precopy is None or prepared.acked:
            return ()
        return prepared.precopy.flows

    def precopy(self, items: list[tuple[int, int]] | None = None, wait_build: bool = False,
                classes: Mapping[int, int] | None = None) -> int | None:
        """Leader of an old group, between two steps: run these (flow, chunk) items on every member (default:
        the next chunk of every unfinished flow); across hosts each flow's chunks go in its class, `classes`
        (flow index -> the DSCP of its permit's level), the lowest level's for a flow not in it (no permit:
        a scripted driver). Returns the bytes this worker sent, None when no
        pre-copy is running (finished, committed or aborted). The final prepare ack also needs this
        worker's new runner: `wait_build` waits for it here once every chunk is done (a scripted
        coordinator); otherwise `poll_prepare` produces it at a later step boundary."""
        assert self.is_leader, "the old group's leader drives its pre-copy"
        if not self.precopy_pending:
            return None
        prepared = self._prepared
        assert prepared is not None and prepared.precopy is not None
        chunks = tuple(items) if items is not None else tuple(prepared.precopy.next_items())
        cmd = NodeCommand("precopy", prepared.epoch, chunks=chunks, classes=tuple(sorted((classes or {}).items())))
        self._broadcast(cmd)
        return self._run_precopy(cmd, wait_build)

    def poll_prepare(self, wait_s: float = 0.0) -> None:
        """Leader, between steps: every chunk is done; produce the final prepare ack once the new runner is
        built (waiting up to `wait_s` for it)."""
        prepared = self._prepared
        if prepared is None or prepared.acked or prepared.precopy is None or not prepared.precopy.complete:
            return
        if prepared.build is not None and wait_s > 0:
            prepared.build.wait(wait_s)
        self._maybe_finish_prepare(prepared)

    def _run_precopy(self, cmd: NodeCommand, wait_build: bool = False) -> int:
        prepared = self._prepared
        if prepared is None or prepared.epoch != cmd.epoch or prepared.precopy is None:
            return 0  # aborted or committed meanwhile: nothing left to copy
        before = dict(prepared.precopy.bytes_by_path)
        sent = prepared.precopy.run(cmd.chunks, dict(cmd.classes))
        self._count_moved({p: n - before[p] for p, n in prepared.precopy.bytes_by_path.items()})
        self._maybe_finish_prepare(prepared, wait_build=wait_build)
        return sent

    def _count_moved(self, by_path: dict[str, int]) -> None:
        for path, n in by_path.items():
            self.bytes_by_path[path] += n

    def _maybe_finish_prepare(self, prepared: _Prepared, force: bool = False, reason: str = "",
                              wait_build: bool = False) -> None:
        """Produce the final prepare ack once: when the group's chunks are all done and this worker's new
        runner is built (not waiting for it unless `wait_build`), or (`force`) at commit (whose exchange
        follows every member's own remaining chunks) or abort (then it is a failure)."""
        if prepared.acked or (not force and prepared.precopy is not None and not prepared.precopy.complete):
            return
        if not force and not wait_build and prepared.build is not None and not prepared.build.ready:
            return  # the step thread does not wait for the runner: a later poll_prepare finishes
        prepared.acked = True
        sent = prepared.precopy.bytes_sent if prepared.precopy is not None else 0
        if not reason and prepared.precopy is not None:
            reason = prepared.precopy.error  # a KV link of this worker failed: its chunks did not land
        if not reason:
            reason = self._build_error(prepared)
        by_path = tuple(prepared.precopy.bytes_by_path.items()) if prepared.precopy is not None else ()
        self._prepare_done = TransitionAck(prepared.epoch, not reason, "prepare", reason, _ms(prepared.t0), sent,
                                           bytes_by_path=by_path)

    def _build_error(self, prepared: _Prepared) -> str:
        """Wait for this worker's new runner (normally ready long before; its cache's reservation may still run,
        see `_wait_runner`) and say whether it failed."""
        if prepared.build is None:
            return ""
        prepared.build.wait_ready()
        return f"worker {self.rank}: {prepared.build.runner_error}" if prepared.build.runner_error else ""

    def take_prepare_ack(self) -> TransitionAck | None:
        """The final ack of a prepare whose pre-copy just completed (once), else None."""
        ack, self._prepare_done = self._prepare_done, None
        return ack

    # -- the transition -----------------------------------------------------------------------------
    def apply(self, cmd: NodeCommand) -> TransitionAck:
        if cmd.kind == "prepare":
            ack = self.prepare(cmd.epoch, Topology.of(self.world.size, cmd.groups))
        elif cmd.kind == "commit":
            ack = self.commit(cmd.epoch)
        elif cmd.kind == "abort":
            ack = self.abort(cmd.epoch)
        else:
            return TransitionAck(cmd.epoch, True, "precopy", "", 0.0, self._run_precopy(cmd))
        self.last_ack = ack
        return ack

    def _reap_reservations(self, wait: bool = False, stop: bool = False) -> None:
        """The page reservations of caches that commits switched to (`_reserving`; paced, they may take a while
        and nothing needs to wait for them: the pages a worker writes are
        backed by the writes, and a retired cache's pages go with its last mapping and the reservation's
        descriptor). Forget the finished ones (a failed one is logged); `stop` gives the others up at their
        next piece, `wait` waits for them (stop, tests)."""
        keep = []
        for build in self._reserving:
            if stop:
                build.stop_after()
            if wait or stop:
                build.wait()
            if not build.done:
                keep.append(build)
            elif build.error:
                log.warning("worker %d: the KV cache's page reservation failed (%s); its pages come as they are "
                            "touched", self.rank, build.error)
        self._reserving = keep

    def prepare(self, epoch: int, new: Topology) -> TransitionAck:
        t0 = time.perf_counter()
        self._reap_reservations()
        if self._prepared is not None and epoch > self.epoch:
            # Its own abort never reached this worker. The span's other members are already waiting in the
            # exchange: join it as a refusal so that all of them refuse the epoch (a refusal that skipped it
            # left them waiting there until the world timeout, then out of the node world).
            return self._refuse_in_span(epoch, new, f"epoch {self._prepared.epoch} is in progress", t0)
        self._prepare_done = None  # an earlier epoch's final ack nobody took (a peer's) is stale now
        if epoch <= self.epoch:
            return TransitionAck(epoch, False, "prepare", f"stale epoch {epoch} (committed {self.epoch})")
        old = self.topology
        # Only this worker's component of the change: its span is that component, so independent parts of one
        # change (2xTP2 -> 4xTP1: two splits) exchange, copy and cut over each inside its own group.
        part = local_target(old, new, self.rank)
        span = transition_span(old, part)
        if span is None or self.rank not in span.workers:
            self._prepared = _Prepared(epoch, new, None, t0=t0, acked=True)
            return TransitionAck(epoch, True, "prepare", "not affected", _ms(t0))
        gone, born = changed_groups(old, part)
        my_old, my_new = old.group_of(self.rank), part.group_of(self.rank)
        prepared = _Prepared(epoch, new, span, t0=t0, local=part)
        self._prepared = prepared
        reason = ""
        try:
            if self._failure_hook is not None:
                self._failure_hook("prepare", epoch)
            if my_new in born:
                if self.kv_path == "shm" and self.members[self.rank].shm and self._spare is not None:
                    # The spare arena (reserved long ago): nothing to allocate, zero or reserve.
                    prepared.arena, self._spare = self._spare, None
                    prepared.new_cache = prepared.arena.view(self._cache_shape(my_new.tp), self._dtype)
                    pooled = self._pooled_runner(my_new)  # normally there: built at boot, or left by a change
                    prepared.build = (_Build.at_once(pooled) if pooled is not None else
                                      _Build(lambda: self._new_runner(my_new, with_cache=False), start=False))
                elif self.kv_path == "shm" and self.members[self.rank].shm:
                    # Sparse here (microseconds); the build thread reserves its pages before anything but
                    # pre-copy writes into it (/dev/shm's room was checked: a full one refuses the epoch now).
                    segment = prepared.segment = kv_segment.segment_name(self.node_tag, epoch, self.rank)
                    if self._recycle:  # an arena from now on (this worker's spare was gone)
                        prepared.arena = kv_segment.Arena.create(segment, self._arena_bytes, reserve=False,
                                                                 keep_name=True)
                        prepared.new_cache = prepared.arena.view(self._cache_shape(my_new.tp), self._dtype)
                    else:
                        prepared.new_cache = kv_segment.create(segment, self._cache_shape(my_new.tp), self._dtype,
                                                               reserve=False)
                    reserve = kv_segment.reserver(segment)
                    prepared.build = _Build(lambda: self._new_runner(my_new, with_cache=False), start=False,
                                            cancel=reserve.close, after=reserve)
                elif self.kv_path in ("shm", "tcp"):  # only its receiver thread writes into it: private memory
                    prepared.new_cache = torch.zeros(self._cache_shape(my_new.tp), dtype=self._dtype)
                    prepared.build = _Build(lambda: self._new_runner(my_new, with_cache=False), start=False)
                else:  # p2p receives into the new runner's own cache right here
                    prepared.build = _Build(lambda: self._new_runner(my_new))
                    prepared.runner = self._wait_runner(prepared)
                self._serve_remote_sources(prepared, gone, my_new)
        except (RuntimeError, MemoryError, ValueError, OSError) as exc:
            # An expected boundary failure (allocation, injected fault): every worker must still take
            # part in the exchange below so that all of them agree to refuse the epoch.
            reason = f"worker {self.rank}: {type(exc).__name__}: {exc}"
        timings = self.last_prepare_timings_ms = {"allocated": _ms(t0)}
        local = self._kv_snapshot(my_old, gone)
        try:
            # A new cache that is a named segment is attached by its name; one in a recycled arena by its handle.
            handle = prepared.arena.handle if prepared.arena is not None and prepared.segment is None else ""
            parts = self.world.all_gather_bytes(
                msgpack.packb([not reason, reason, [_kv_wire(r) for r in local], handle], use_bin_type=True),
                span.start, span.tp,
            )
        except BaseException:
            self._drop(prepared)
            raise
        decoded = [msgpack.unpackb(p, raw=False) for p in parts]
        failures = [r for good, r, _, _ in decoded if not good]
        if failures:
            self._drop(prepared)
            return TransitionAck(epoch, False, "prepare", "; ".join(failures), _ms(t0))
        prepared.handles = {span.start + i: h for i, (_, _, _, h) in enumerate(decoded) if h}
        requests = [_kv_unwire(w) for _, _, entries, _ in decoded for w in entries]
        timings["exchanged"] = _ms(t0)
        plan = plan_prepare(old, part, requests, self.geometry, self._num_blocks_of)
        prepared.plan = plan
        timings["planned"] = _ms(t0)
        if self.kv_path == "p2p":
            moved = self._move(plan, my_old, my_new, gone, born, prepared.runner)
            self.bytes_by_path["p2p"] += moved
            prepared.acked = True
            return TransitionAck(epoch, True, "prepare", "", _ms(t0), moved, bytes_by_path=(("p2p", moved),))
        # One-sided: every source maps every new cache of the span on its host and connects to every one on
        # another host (its receiver answers the hello); once all agree, the names go.
        dst_caches: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}
        problem = ""
        try:
            if my_old in gone:
                dst_caches = self._map_new_caches(epoch, born, prepared.new_cache, prepared.handles)
        except (OSError, RuntimeError) as exc:
            problem = f"worker {self.rank}: cannot map the new KV caches: {type(exc).__name__}: {exc}"
        if not problem and my_old in gone:
            problem = self._connect_remote(prepared, born)
        timings["mapped"] = _ms(t0)
        try:
            answers = self.world.all_gather_bytes(msgpack.packb(problem), span.start, span.tp)
        except BaseException:
            self._drop(prepared)
            raise
        finally:
            if prepared.segment is not None:
                kv_segment.unlink(prepared.segment)
        timings["agreed"] = _ms(t0)
        problems = [p for p in (msgpack.unpackb(a, raw=False) for a in answers) if p]
        if problems:
            self._drop(prepared)
            return TransitionAck(epoch, False, "prepare", "; ".join(problems), _ms(t0))
        if prepared.build is not None:
            prepared.build.start()  # after the exchanges: see _Build
            if my_new in born and my_new.leader == self.rank:
                prepared.engine = _EngineAhead(prepared.build, lambda runner: self._new_engine(my_new, runner))
        if my_old in gone:
            flows = plan_flows(plan.transfers, self._block_bytes, self.precopy_chunk_bytes)
            heads = migration.heads_of(self.model_config.num_kv_heads, my_old, self.rank)
            prepared.precopy = PreCopy(self.rank, my_old.workers, plan.transfers, flows, self.runner.kv_cache, heads,
                                       dst_caches, prepared.links)
            self._count_planned(epoch, [(f.src_worker, f.dst_worker, f.size_bytes) for f in flows])
            if self.engine is not None:
                prepared.preemptions = {s.request_id: s.num_preemptions for s in migration.sequences_in_order(self.engine)}
        prepared.dst_caches = dst_caches
        if prepared.precopy is not None and not prepared.precopy.complete:
            return TransitionAck(epoch, True, "prepare", "", _ms(t0), 0, pending=True)
        prepared.acked = True
        error = self._build_error(prepared)
        return TransitionAck(epoch, not error, "prepare", error, _ms(t0), 0)

    def _wait_runner(self, prepared: _Prepared) -> ModelRunner:
        """The built new runner (raises RuntimeError when its build failed), with the new cache adopted."""
        assert prepared.build is not None, "a changed worker builds a new runner"
        # The runner, not the new segment's reservation (a 64 MiB posix_fallocate: 10-30 ms of page zeroing per
        # worker on a loaded 2-core host, most of a commit's wait): that goes on after the switch, paced
        # (`_reap_reservations`, kv_segment.Reserver). One that already failed refuses the epoch; one that fails later is
        # logged, and the pages come as they are touched (/dev/shm's room was checked when the segment was made).
        prepared.build.wait_ready()
        if prepared.build.runner_error or (prepared.build.done and prepared.build.error):
            raise RuntimeError(prepared.build.error)
        runner = prepared.build.runner
        assert runner is not None
        if prepared.new_cache is not None:
            assert tuple(runner.kv_cache_shape) == tuple(prepared.new_cache.shape), "the new cache fits the runner"
            runner.kv_cache = prepared.new_cache
        return runner

    def _drop(self, prepared: _Prepared) -> None:
        """A failed prepare: nothing of it stays (runner, cache, mappings, segment name)."""
        prepared.acked = True
        if prepared.build is not None:
            prepared.build.stop_after()  # a reservation running: given up at its next piece
            prepared.build.finish()  # no thread outlives its epoch; one never started is given up
            self._join_engine_ahead(prepared)  # (before its runner goes back to the pool)
            if prepared.build.runner is not None:
                self._shelve_runner(prepared.build.runner)  # without the epoch's cache: it goes with `prepared`
                prepared.build.runner = prepared.runner = None
        self._release_links(prepared)
        if prepared.segment is not None:
            kv_segment.unlink(prepared.segment)
        arena, prepared.arena = prepared.arena, None
        if arena is not None:
            # Not back to spare: a source of this epoch whose abort is late may still write a pre-copy round into
            # it (through its handle), and the next change would hand it out as a live cache. The next prepare
            # makes a fresh one (a named segment, reserved paced), which its commit then leaves as the spare.
            self._release_arena(arena)
        prepared.new_cache = None
        if self._prepared is prepared:
            self._prepared = None

    @staticmethod
    def _join_engine_ahead(prepared: _Prepared) -> None:
        """The Engine made ahead for a change that will not commit: its thread ends (it waits only for the
        runner's build, finished by then), and the Engine goes."""
        ahead, prepared.engine = prepared.engine, None
        if ahead is not None:
            ahead.take(None)

    def _release_links(self, prepared: _Prepared) -> None:
        """The epoch's TCP KV links (as a source) and its receiver session (as a destination) go."""
        links, prepared.links = prepared.links, None
        if links is not None:
            links.close()
        if prepared.receiving:
            prepared.receiving = False
            if self._kv_receiver is not None and self._kv_receiver.serving == prepared.epoch:
                self._kv_receiver.close_session()

    def commit(self, epoch: int) -> TransitionAck:
        t0 = time.perf_counter()
        if epoch <= self.epoch:
            return TransitionAck(epoch, False, "commit", f"stale epoch {epoch} (committed {self.epoch})")
        prepared = self._prepared
        if prepared is None or prepared.epoch != epoch:
            return TransitionAck(epoch, False, "commit", f"epoch {epoch} was not prepared")
        old, new = self.topology, prepared.new
        moved, by_path, retired = 0, {}, None
        # Where the pause went (ms since the commit began, cumulative): the span's state exchange (it waits for
        # the slowest old leader's step boundary), the delta's plan, its copy, the agreement after it, and
        # the new engines adopting the requests.
        timings = self.last_commit_timings_ms = {}
        if prepared.span is not None:
            span = prepared.span
            assert prepared.local is not None, "a span worker's prepare kept its component's change"
            gone, born = changed_groups(old, prepared.local)
            my_old, my_new = old.group_of(self.rank), prepared.local.group_of(self.rank)
            if prepared.precopy is not None:
                # Normally nothing is left: the coordinator commits after every prepare ack. A scripted
                # commit may come earlier; the rest is one-sided, so it runs right here.
                before = dict(prepared.precopy.bytes_by_path)
                prepared.precopy.finish_mine()
                self._count_moved({p: n - before[p] for p, n in prepared.precopy.bytes_by_path.items()})
                self._maybe_finish_prepare(prepared, force=True)
            build_error = ""
            if prepared.build is not None and prepared.runner is None:
                try:
                    prepared.runner = self._wait_runner(prepared)
                except RuntimeError as exc:  # told to the span below: nobody switches
                    build_error = f"worker {self.rank}: new runner: {exc}"
            if not build_error and prepared.precopy is not None and prepared.precopy.error:
                build_error = prepared.precopy.error  # some pre-copied blocks never landed: nobody switches
            timings["built"] = _ms(t0)
            states, invalid = [], []
            if self.is_leader and my_old in gone:
                assert self.engine is not None
                states = migration.export_states(self.engine)
                # Preempted since prepare: its old blocks were free for a while, so what pre-copy read
                # may not be its KV -- commit moves it afresh.
                invalid = [rid for rid, n in prepared.preemptions.items()
                           if rid in self.engine._seqs and self.engine._seqs[rid].num_preemptions != n]
            local = self._kv_snapshot(my_old, gone)
            parts = self.world.all_gather_bytes(
                msgpack.packb([states, [_kv_wire(r) for r in local], self._step_id(), invalid, build_error],
                              use_bin_type=True),
                span.start, span.tp,
            )
            decoded = [msgpack.unpackb(p, raw=False) for p in parts]
            timings["exchanged"] = _ms(t0)
            errors = [e for *_, e in decoded if e]
            if errors:
                # Every worker saw the same: all keep the old topology (normally the leader's final prepare
                # ack already refused the epoch; a peer's build failure is only known here).
                self._drop(prepared)
                return TransitionAck(epoch, False, "commit", "; ".join(errors), _ms(t0))
            requests = [_kv_unwire(w) for _, entries, _, _, _ in decoded for w in entries]
            assert prepared.plan is not None, "a prepared span worker has a plan"
            stale = {rid for _, _, _, inv, _ in decoded for rid in inv}
            plan = prepared.plan
            if stale:
                plan = dataclasses.replace(plan, src_tables={rid: (() if rid in stale else t)
                                                             for rid, t in plan.src_tables.items()})
            delta = plan_commit(plan, requests, self.geometry, self._num_blocks_of)
            timings["planned"] = _ms(t0)
            if self.kv_path in ("shm", "tcp"):
                heads = migration.heads_of(self.model_config.num_kv_heads, my_old, self.rank) if my_old in gone else None
                by_path, error = copy_transfers_one_sided(
                    self.rank, delta.transfers, self.runner.kv_cache if my_old in gone else None, heads,
                    prepared.dst_caches, prepared.links, self._block_bytes, self.precopy_chunk_bytes)
                timings["moved"] = _ms(t0)
                # Every write into a new cache has landed (TCP: acked after the write) before any new group
                # runs a step; a link that failed means some did not: then every worker keeps the old topology.
                answers = self.world.all_gather_bytes(msgpack.packb(error), span.start, span.tp)
                errors = [e for e in (msgpack.unpackb(a, raw=False) for a in answers) if e]
                timings["agreed"] = _ms(t0)
                if errors:
                    self._drop(prepared)
                    return TransitionAck(epoch, False, "commit", "; ".join(errors), _ms(t0))
                self._count_moved(by_path)
                self._count_planned(epoch, [(t.src_worker, t.dst_worker, self._block_bytes(t) * t.num_blocks)
                                            for t in delta.transfers if t.src_worker == self.rank])
                moved = sum(by_path.values())
            else:
                moved = self._move(delta, my_old, my_new, gone, born, prepared.runner)
                timings["moved"] = timings["agreed"] = _ms(t0)
                self.bytes_by_path["p2p"] += moved
                by_path = {"p2p": moved}
            if my_new in born:
                assert prepared.runner is not None, "a changed worker built its new runner at prepare"
                retired = (self.runner, self.engine)
                self.runner = prepared.runner
                self.engine = None
                if my_new.leader == self.rank:
                    ahead, prepared.engine = prepared.engine, None
                    engine = ahead.take(prepared.runner) if ahead is not None else None
                    if engine is None:
                        self.engines_at_commit += 1
                        engine = self._new_engine(my_new, prepared.runner)
                    engine._step_id = max(step for _, _, step, _, _ in decoded)
                    placements = {p.request_id: p for p in delta.placements if p.dst_group == my_new}
                    states = [s for st, *_ in decoded for s in st if s["id"] in placements]
                    migration.install_states(engine, states, placements)
                    # Quick: a fresh pool (the full check walks every block: 3-5 ms of a tiny model's TP4 commit).
                    engine.check_integrity(quick=True)
                    self.engine = engine
        # The old cache, the mappings of other workers' new caches and the pre-copy go to the reaper: freeing
        # them here (~10-20 ms of page freeing with the GIL held) was part of the pause (see node.reaper).
        # The old runner itself waits in the pool for the next change to its level.
        old_runner, old_engine = retired if retired is not None else (None, None)
        if prepared.build is not None and not prepared.build.done:
            self._reserving.append(prepared.build)
        own = [old_runner.kv_cache] if old_runner is not None else []
        if retired is not None and (prepared.arena is not None or self._arena is not None):
            # The old cache's arena is the next change's spare (its pages stay: nothing to free or zero).
            old_arena, self._arena, prepared.arena = self._arena, prepared.arena, None
            if old_arena is not None:
                own = []
                if self._spare is None and self._recycle:
                    self._spare = old_arena
                else:
                    self._release_arena(old_arena)
        self._reaper.retire(
            own=own,
            mapped=[cache for w, (cache, _) in prepared.dst_caches.items() if w != self.rank],
            other=[old_engine, prepared.precopy],
        )
        if old_runner is not None:
            self._shelve_runner(old_runner)
        del old_runner, old_engine, retired
        prepared.dst_caches.clear()
        prepared.precopy = None
        self._release_links(prepared)
        self.topology, self.epoch, self._prepared = new, epoch, None
        timings["adopted"] = _ms(t0)
        return TransitionAck(epoch, True, "commit", "", _ms(t0), moved, bytes_by_path=tuple(by_path.items()))

    def _refuse_in_span(self, epoch: int, new: Topology, reason: str, t0: float) -> TransitionAck:
        """Refuse `epoch`, taking part in its span's exchange when this worker is in the span."""
        span = transition_span(self.topology, local_target(self.topology, new, self.rank))
        if span is not None and self.rank in span.workers:
            parts = self.world.all_gather_bytes(
                msgpack.packb([False, f"worker {self.rank}: {reason}", [], ""], use_bin_type=True), span.start, span.tp)
            reason = "; ".join(r for good, r, _, _ in (msgpack.unpackb(p, raw=False) for p in parts) if not good)
        return TransitionAck(epoch, False, "prepare", reason, _ms(t0))

    def abort(self, epoch: int) -> TransitionAck:
        prepared = self._prepared
        # An abort of a later epoch also ends an older prepare still held here (its own abort was lost): the
        # coordinator runs one transition at a time, so it never commits an epoch older than one it has sent.
        if prepared is not None and prepared.epoch <= epoch:
            # A prepare still pre-copying gets its answer now: it never completed.
            self._maybe_finish_prepare(prepared, force=True, reason="aborted during pre-copy")
            self._drop(prepared)  # the new runner, its cache, views and mappings go with it
            return TransitionAck(epoch, True, "abort")
        if epoch <= self.epoch:
            return TransitionAck(epoch, False, "abort", f"stale epoch {epoch} (committed {self.epoch})")
        return TransitionAck(epoch, True, "abort", "nothing prepared")

    # -- helpers ------------------------------------------------------------------------------------
    def _kv_snapshot(self, my_old: Group, gone: tuple[Group, ...]) -> list[RequestKV]:
        if self.engine is None or my_old not in gone:
            return []
        return migration.snapshot_kv(self.engine, my_old)

    def _step_id(self) -> int:
        return self.engine._step_id if self.engine is not None else 0

    def _block_bytes(self, t) -> int:
        return transfer_block_bytes(t, self.cfg.block_size, self.model_config.head_dim, self.runner.kv_cache.element_size())

    def _cache_shape(self, tp: int) -> tuple[int, ...]:
        cfg = self.model_config
        return (cfg.num_layers, 2, self._num_blocks_of[tp], self.cfg.block_size, loader.kv_heads_per_rank(cfg, tp),
                cfg.head_dim)

    def _map_new_caches(self, epoch: int, born: tuple[Group, ...], own: torch.Tensor | None,
                        handles: Mapping[int, str] | None = None):
        """Every new cache of the span (this worker's own included), with the global heads it holds: by the
        worker's arena handle when it gave one, else by the epoch's segment name."""
        handles = handles or {}
        heads = self.model_config.num_kv_heads
        caches = {}
        for g in born:
            for w in g.workers:
                if self.kv_path_of(self.rank, w) == "tcp":
                    continue  # on another host: reached through its receiver (_connect_remote)
                if w == self.rank:
                    assert own is not None, "a changed worker allocated its new cache"
                    cache = own
                elif w in handles:
                    cache = kv_segment.attach_handle(handles[w], self._cache_shape(g.tp), self._dtype,
                                                     self.members[w].pid)
                else:
                    cache = kv_segment.attach(kv_segment.segment_name(self.node_tag, epoch, w), self._cache_shape(g.tp),
                                              self._dtype, allow_larger=True)
                caches[w] = (cache, migration.heads_of(heads, g, w))
        return caches

    def _serve_remote_sources(self, prepared: _Prepared, gone: tuple[Group, ...], my_new: Group) -> None:
        """Destination: serve the sources of this epoch on other hosts (before the span's first exchange, so
        that the receiver is up by the time any of them connects)."""
        sources = {w for g in gone for w in g.workers if self.kv_path_of(w, self.rank) == "tcp"}
        if not sources:
            return
        assert self._kv_receiver is not None and prepared.new_cache is not None, "one-sided mode has a receiver"
        heads = migration.heads_of(self.model_config.num_kv_heads, my_new, self.rank)
        self._kv_receiver.open(prepared.epoch, self.rank, prepared.new_cache, heads, sources)
        prepared.receiving = True

    def _connect_remote(self, prepared: _Prepared, born: tuple[Group, ...]) -> str:
        """Source: a TCP link to every new cache of the span on another host; a problem, or "". Its first
        connection is in the delta's class (STAGE_M_DSCP); pre-copy opens its permit's class at its first
        chunk. `kv_tos` gets the IP_TOS of every connection opened, now or then."""
        targets = {w: (self.members[w].addr, self.members[w].port, self.members[w].token) for g in born for w in g.workers
                   if self.kv_path_of(self.rank, w) == "tcp"}
        if not targets:
            return ""
        prepared.links = KvLinks(on_open=self.kv_tos.append)
        try:
            prepared.links.connect(prepared.epoch, self.rank, targets, STAGE_M_DSCP)
        except TransferError as exc:
            return f"worker {self.rank}: cannot reach a new KV cache on another host: {exc}"
        return ""

    def _count_planned(self, epoch: int, flows: list[tuple[int, int, int]]) -> None:
        """What an agreed plan gives this worker to move, by pair and path (local copies are no path)."""
        for src, dst, size in flows:
            path = self.kv_path_of(src, dst)
            if src == self.rank and path != "local":
                self.planned_by_path[path] += size
                self.kv_pairs.append((epoch, src, dst, path, size))

    def _move(self, plan: ReshardPlan, my_old: Group, my_new: Group, gone, born, runner) -> int:
        heads = self.model_config.num_kv_heads
        old_kv = self.runner.kv_cache if my_old in gone else None
        new_kv = runner.kv_cache if runner is not None else None
        return migration.execute_transfers(
            self.world, plan.transfers, self.rank,
            old_kv, migration.heads_of(heads, my_old, self.rank) if my_old in gone else None,
            new_kv, migration.heads_of(heads, my_new, self.rank) if my_new in born else None,
        )


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _kv_wire(r: RequestKV) -> list[Any]:
    return [r.request_id, r.group.start, r.group.tp, r.num_computed_tokens, list(r.block_ids)]


def _kv_unwire(w: list[Any]) -> RequestKV:
    rid, start, tp, computed, blocks = w
    return RequestKV(rid, Group(start, tp), computed, tuple(blocks))
