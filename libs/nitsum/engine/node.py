"""One worker's share of a node whose TP groups change at run time: Prepare / Commit / Abort with epochs.

`NodeRuntime` wraps what this worker is in the current topology: the *leader* of its group (lowest rank:
it owns an `Engine`, batches, samples and drives its peers through the msgpack step plan) or a *peer*
(it runs the plans its leader broadcasts). A topology command reaches every worker of the group at the
same step boundary: the leader gets it (from the coordinator), broadcasts it as a control plan, and every
member applies it (`NodeRuntime.command` on the leader, `follow` on peers).

Transition (ALGORITHMS.md §1.4), with `span` = the smallest aligned group covering every changed worker:
- `prepare(epoch, new)`: each changed worker allocates a fresh KV cache for its new head slice and starts
  building its new runner (weight *views* of the boot store: no weight is read or allocated) in a thread;
  the span all-gathers the old leaders' block tables; every worker computes the same `plan_prepare` (the
  full blocks to move).
  KV path "shm" (CPU, one host; the default): each new cache lives in a shared-memory segment that every
  source maps (its name is unlinked before prepare returns), and the full blocks move in chunks *between
  the old groups' decode steps* (`precopy.py`; each old group's leader drives its members with `precopy`
  control plans). The prepare ack is then `pending`; the final one comes when the group's chunks are done
  and this worker's runner is built (`take_prepare_ack`).
  KV path "p2p" (the fallback, chosen at construction): the runner is awaited and paired gloo send/recv
  moves every full block inside the prepare step. A failure anywhere (e.g. no memory for the new cache)
  makes every worker ack `ok=False` and keep nothing: the old topology keeps serving; Abort then is a no-op.
  (A peer whose runner build fails is known to its leader only at commit: the commit exchange carries it
  and every worker then keeps the old topology.)
- `commit(epoch)` at a step boundary: each worker finishes whatever pre-copy of its own is left, old
  leaders export their requests' full state, the span all-gathers it, every worker computes `plan_commit`
  (the delta: blocks written since prepare, requests that arrived or were preempted since) and moves it
  (shm: one-sided writes, then a barrier); new leaders adopt the requests into fresh engines; roles
  switch. This is the only pause a stream sees.
- `abort(epoch)`: drops the prepared state (new caches, views, mappings); the old topology never stopped.
Epochs only grow: a command with an epoch at or below the committed one is refused (as is a commit of
an epoch that was not prepared).

Workers outside the span take no part in the collectives; they only advance their epoch and topology.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch

from nitsum.engine import kv_segment, migration
from nitsum.engine.engine import Engine
from nitsum.engine.params import EngineConfig, RequestOutput, SamplingParams
from nitsum.engine.precopy import DEFAULT_CHUNK_BYTES, MigrationFlow, PreCopy, copy_transfers_one_sided, plan_flows, \
    transfer_block_bytes
from nitsum.engine.plan import PLAN_KIND_CONTROL, PLAN_KIND_NOOP, PLAN_KIND_SHUTDOWN, PLAN_KIND_STEP, StepPlan
from nitsum.engine.runner import ModelRunner, num_kv_blocks_for
from nitsum.kv.reshard import (
    Group,
    KVGeometry,
    RequestKV,
    ReshardPlan,
    Topology,
    changed_groups,
    plan_commit,
    plan_prepare,
    transition_span,
)
from nitsum.model import loader
from nitsum.model.loader import read_raw_config
from nitsum.model.tokenizer import Tokenizer
from nitsum.parallel.world import NodeWorld

COMMAND_KINDS = ("prepare", "commit", "abort", "precopy")
KV_PATHS = ("auto", "shm", "p2p")


@dataclass(frozen=True)
class NodeCommand:
    """A topology command as it travels inside a control step plan (msgpack)."""

    kind: str
    epoch: int
    groups: tuple[tuple[int, int], ...] = ()  # prepare: the new topology as (start, tp) pairs
    chunks: tuple[tuple[int, int], ...] = ()  # precopy: (flow index, chunk index) items to run now

    def encode(self) -> bytes:
        return msgpack.packb([self.kind, self.epoch, [list(g) for g in self.groups], [list(c) for c in self.chunks]],
                             use_bin_type=True)

    @staticmethod
    def decode(payload: bytes) -> NodeCommand:
        kind, epoch, groups, chunks = msgpack.unpackb(payload, raw=False)
        if kind not in COMMAND_KINDS:
            raise ValueError(f"unknown node command {kind!r}")
        return NodeCommand(kind, int(epoch), tuple((int(s), int(t)) for s, t in groups),
                           tuple((int(f), int(c)) for f, c in chunks))


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


@dataclass
class _Prepared:
    epoch: int
    new: Topology
    span: Group | None  # None: this worker is outside the span (a bystander)
    plan: ReshardPlan | None = None
    runner: ModelRunner | None = None  # the new runner, when this worker's group changes
    timings_ms: dict[str, float] = field(default_factory=dict)
    t0: float = 0.0  # perf_counter at prepare start (the final prepare ack's duration runs from here)
    precopy: PreCopy | None = None  # shm path, when this worker's old group changes
    dst_caches: dict[int, tuple[torch.Tensor, tuple[int, int]]] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)  # old leader: request -> preemptions at prepare
    acked: bool = False  # the final prepare ack was produced
    build: _Build | None = None  # the new runner, built in a thread (shm path) until commit needs it
    segment: str | None = None  # this worker's new-cache segment name (shm path)
    new_cache: torch.Tensor | None = None  # its new KV cache in that segment (the runner adopts it at commit)


class _Build:
    """The new runner built in a thread while the old group keeps decoding: weights are views, so this is
    module construction and rope tables (100-400 ms on a loaded 2-core host for the ~27M model) -- time the
    old group would otherwise not decode. Nothing needs it before commit: pre-copy writes into the new
    cache, which prepare allocates itself (so that a lack of memory refuses the epoch in prepare)."""

    def __init__(self, fn: Callable[[], ModelRunner]) -> None:
        self.runner: ModelRunner | None = None
        self.error = ""
        self._thread = threading.Thread(target=self._run, args=(fn,), name="nitsum-prepare-build", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], ModelRunner]) -> None:
        try:
            self.runner = fn()
        except (RuntimeError, MemoryError, ValueError, OSError) as exc:  # told to the span at the exchange
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)


FailureHook = Callable[[str, int], None]


class NodeRuntime:
    def __init__(
        self,
        world: NodeWorld,
        cfg: EngineConfig,
        weights: dict[str, torch.Tensor],
        topology: Topology,
        failure_hook: FailureHook | None = None,
        kv_path: str = "auto",
        precopy_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        node_tag: str | None = None,
    ) -> None:
        assert topology.num_workers == world.size, "the topology covers the node's workers"
        if kv_path not in KV_PATHS:
            raise ValueError(f"kv_path must be one of {KV_PATHS}, got {kv_path!r}")
        self.world = world
        self.rank = world.rank
        self.cfg = cfg
        self.weights = weights
        # Read once at boot; a TP change reads nothing from disk.
        self.model_config = loader.load_config(cfg.model_dir)
        self.tokenizer = Tokenizer(cfg.model_dir, read_raw_config(cfg.model_dir))
        self.geometry = KVGeometry(self.model_config.num_layers, self.model_config.num_kv_heads, cfg.block_size)
        self._dtype = loader.dtype_of(cfg.dtype)
        self._num_blocks_of = {
            tp: num_kv_blocks_for(self.model_config, tp, cfg.block_size, self._dtype, cfg.num_kv_blocks, cfg.kv_cache_mb)
            for tp in world.levels
        }
        # Chosen once: shared memory needs host-memory caches on one host (a node world is one host).
        shm_possible = world.device == "cpu" and kv_segment.available()
        if kv_path == "shm" and not shm_possible:
            raise ValueError("kv_path 'shm' needs CPU caches and a writable /dev/shm")
        self.kv_path = "shm" if kv_path == "auto" and shm_possible else ("p2p" if kv_path == "auto" else kv_path)
        self.precopy_chunk_bytes = precopy_chunk_bytes
        self.node_tag = node_tag or f"p{world.master_port}"
        self.bytes_by_path = {"shm": 0, "p2p": 0}  # KV bytes this worker moved into other workers' caches
        self._failure_hook = failure_hook
        self.topology = topology
        self.epoch = 0
        self._prepared: _Prepared | None = None
        self._prepare_done: TransitionAck | None = None
        self.engine: Engine | None = None
        self.runner: ModelRunner = self._new_runner(self.group)
        if self.is_leader:
            self.engine = self._new_engine(self.group, self.runner)
        self.last_ack: TransitionAck | None = None
        # Where the last prepare step's time went (ms since its start, cumulative): built (runner + new
        # cache), exchanged (the span's rendezvous: the wait for the slowest member), planned, mapped, agreed.
        self.last_prepare_timings_ms: dict[str, float] = {}

    # -- what this worker is now --------------------------------------------------------------------
    @property
    def group(self) -> Group:
        return self.topology.group_of(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.group.leader == self.rank

    def _tp_group(self, group: Group):
        return self.world.group(group.start, group.tp)

    def _new_runner(self, group: Group) -> ModelRunner:
        cfg = self.cfg
        return ModelRunner(
            cfg.model_dir, self._tp_group(group), device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size,
            num_kv_blocks=self._num_blocks_of[group.tp], weights=self.weights, config=self.model_config,
        )

    def _new_engine(self, group: Group, runner: ModelRunner) -> Engine:
        return Engine(self.cfg, self._tp_group(group), runner=runner, tokenizer=self.tokenizer)

    # -- leader: requests and steps -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        assert self.engine is not None, f"worker {self.rank} is not a group leader"
        self.engine.add_request(request_id, prompt_token_ids, params)

    def step(self) -> list[RequestOutput]:
        assert self.engine is not None, f"worker {self.rank} is not a group leader"
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished()

    def command(self, cmd: NodeCommand) -> TransitionAck:
        """Leader: run a topology command on every member of the group at this step boundary."""
        assert self.is_leader, "commands enter a group through its leader"
        self._broadcast(cmd)
        return self.apply(cmd)

    def _broadcast(self, cmd: NodeCommand) -> None:
        tp_group = self._tp_group(self.group)
        if tp_group.size > 1:
            tp_group.broadcast_bytes(StepPlan(kind=PLAN_KIND_CONTROL, step_id=0, control=cmd.encode()).encode())

    def keepalive(self) -> None:
        """Leader, while idle: tell the peers there is nothing to run (keeps their broadcast alive)."""
        tp_group = self._tp_group(self.group)
        if self.is_leader and tp_group.size > 1:
            tp_group.broadcast_bytes(StepPlan(kind=PLAN_KIND_NOOP, step_id=0).encode())

    def shutdown(self) -> None:
        assert self.engine is not None, "the leader shuts its group down"
        self.engine.shutdown()

    def close(self) -> None:
        """At stop: remove any KV segment name of this worker still in /dev/shm (only a crash between
        create and unlink inside a prepare can leave one) and drop the prepared state."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared.build is not None:
            prepared.build.wait()
        for name in kv_segment.leftovers(self.node_tag):
            if name.endswith(f"-w{self.rank}"):
                kv_segment.unlink(name)

    # -- peer: follow the leader --------------------------------------------------------------------
    def follow(self) -> str:
        """Peer: run the leader's next plan. Returns its kind ("step", "control", "precopy" or "shutdown")."""
        assert not self.is_leader, "the leader does not follow"
        plan = StepPlan.decode(self._tp_group(self.group).broadcast_bytes(None))
        if plan.kind == PLAN_KIND_STEP:
            self.runner.execute(plan)
        elif plan.kind == PLAN_KIND_CONTROL:
            cmd = NodeCommand.decode(plan.control)
            if cmd.kind == "precopy":
                self._run_precopy(cmd)
                return "precopy"
            self.last_ack = self.apply(cmd)
        elif plan.kind == PLAN_KIND_NOOP:
            pass
        else:
            assert plan.kind == PLAN_KIND_SHUTDOWN, f"unexpected plan kind {plan.kind}"
        return plan.kind

    # -- pre-copy between steps (shm path) ------------------------------------------------------------
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

    def precopy(self, items: list[tuple[int, int]] | None = None, wait_build: bool = False) -> int | None:
        """Leader of an old group, between two steps: run these (flow, chunk) items on every member (default:
        the next chunk of every unfinished flow). Returns the bytes this worker sent, None when no
        pre-copy is running (finished, committed or aborted). The final prepare ack also needs this
        worker's new runner: `wait_build` waits for it here once every chunk is done (a scripted
        coordinator); otherwise `poll_prepare` produces it at a later step boundary."""
        assert self.is_leader, "the old group's leader drives its pre-copy"
        if not self.precopy_pending:
            return None
        prepared = self._prepared
        assert prepared is not None and prepared.precopy is not None
        chunks = tuple(items) if items is not None else tuple(prepared.precopy.next_items())
        cmd = NodeCommand("precopy", prepared.epoch, chunks=chunks)
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
        sent = prepared.precopy.run(cmd.chunks)
        self.bytes_by_path["shm"] += sent
        self._maybe_finish_prepare(prepared, wait_build=wait_build)
        return sent

    def _maybe_finish_prepare(self, prepared: _Prepared, force: bool = False, reason: str = "",
                              wait_build: bool = False) -> None:
        """Produce the final prepare ack once: when the group's chunks are all done and this worker's new
        runner is built (not waiting for it unless `wait_build`), or (`force`) at commit (whose exchange
        follows every member's own remaining chunks) or abort (then it is a failure)."""
        if prepared.acked or (not force and prepared.precopy is not None and not prepared.precopy.complete):
            return
        if not force and not wait_build and prepared.build is not None and not prepared.build.done:
            return  # the step thread does not wait for the build: a later poll_prepare finishes
        prepared.acked = True
        sent = prepared.precopy.bytes_sent if prepared.precopy is not None else 0
        if not reason:
            reason = self._build_error(prepared)
        self._prepare_done = TransitionAck(prepared.epoch, not reason, "prepare", reason, _ms(prepared.t0), sent)

    def _build_error(self, prepared: _Prepared) -> str:
        """Wait for this worker's new runner (normally built long before) and say whether it failed."""
        if prepared.build is None:
            return ""
        prepared.build.wait()
        return f"worker {self.rank}: {prepared.build.error}" if prepared.build.error else ""

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

    def prepare(self, epoch: int, new: Topology) -> TransitionAck:
        t0 = time.perf_counter()
        self._prepare_done = None  # an earlier epoch's final ack nobody took (a peer's) is stale now
        if epoch <= self.epoch:
            return TransitionAck(epoch, False, "prepare", f"stale epoch {epoch} (committed {self.epoch})")
        if self._prepared is not None:
            return TransitionAck(epoch, False, "prepare", f"epoch {self._prepared.epoch} is in progress")
        old = self.topology
        span = transition_span(old, new)
        if span is None or self.rank not in span.workers:
            self._prepared = _Prepared(epoch, new, None, t0=t0, acked=True)
            return TransitionAck(epoch, True, "prepare", "not affected", _ms(t0))
        gone, born = changed_groups(old, new)
        my_old, my_new = old.group_of(self.rank), new.group_of(self.rank)
        prepared = _Prepared(epoch, new, span, t0=t0)
        self._prepared = prepared
        reason = ""
        try:
            if self._failure_hook is not None:
                self._failure_hook("prepare", epoch)
            if my_new in born:
                if self.kv_path == "shm":
                    # Sparse here (microseconds); the build thread reserves its pages before anything but
                    # pre-copy writes into it (/dev/shm's room was checked: a full one refuses the epoch now).
                    segment = prepared.segment = kv_segment.segment_name(self.node_tag, epoch, self.rank)
                    prepared.new_cache = kv_segment.create(segment, self._cache_shape(my_new.tp), self._dtype,
                                                           reserve=False)
                    reserve = kv_segment.reserver(segment)
                    prepared.build = _Build(lambda: (reserve(), self._new_runner(my_new))[1])
                else:  # p2p receives into the new runner's own cache right here
                    prepared.build = _Build(lambda: self._new_runner(my_new))
                    prepared.runner = self._wait_runner(prepared)
        except (RuntimeError, MemoryError, ValueError, OSError) as exc:
            # An expected boundary failure (allocation, injected fault): every worker must still take
            # part in the exchange below so that all of them agree to refuse the epoch.
            reason = f"worker {self.rank}: {type(exc).__name__}: {exc}"
        timings = self.last_prepare_timings_ms = {"allocated": _ms(t0)}
        local = self._kv_snapshot(my_old, gone)
        try:
            parts = self.world.all_gather_bytes(
                msgpack.packb([not reason, reason, [_kv_wire(r) for r in local]], use_bin_type=True),
                span.start, span.tp,
            )
        except BaseException:
            self._drop(prepared)
            raise
        decoded = [msgpack.unpackb(p, raw=False) for p in parts]
        failures = [r for good, r, _ in decoded if not good]
        if failures:
            self._drop(prepared)
            return TransitionAck(epoch, False, "prepare", "; ".join(failures), _ms(t0))
        requests = [_kv_unwire(w) for _, _, entries in decoded for w in entries]
        timings["exchanged"] = _ms(t0)
        plan = plan_prepare(old, new, requests, self.geometry, self._num_blocks_of)
        prepared.plan = plan
        timings["planned"] = _ms(t0)
        if self.kv_path == "p2p":
            moved = self._move(plan, my_old, my_new, gone, born, prepared.runner)
            self.bytes_by_path["p2p"] += moved
            prepared.acked = True
            return TransitionAck(epoch, True, "prepare", "", _ms(t0), moved)
        # shm: every source maps every new cache of the span; once all agree, the names go.
        dst_caches: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}
        problem = ""
        try:
            if my_old in gone:
                dst_caches = self._map_new_caches(epoch, born, prepared.new_cache)
        except (OSError, RuntimeError) as exc:
            problem = f"worker {self.rank}: cannot map the new KV caches: {type(exc).__name__}: {exc}"
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
        if my_old in gone:
            flows = plan_flows(plan.transfers, self._block_bytes, self.precopy_chunk_bytes)
            heads = migration.heads_of(self.model_config.num_kv_heads, my_old, self.rank)
            prepared.precopy = PreCopy(self.rank, my_old.workers, plan.transfers, flows, self.runner.kv_cache, heads,
                                       dst_caches)
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
        prepared.build.wait()
        if prepared.build.error:
            raise RuntimeError(prepared.build.error)
        runner = prepared.build.runner
        assert runner is not None
        if prepared.new_cache is not None:
            assert tuple(runner.kv_cache.shape) == tuple(prepared.new_cache.shape), "the new cache fits the runner"
            runner.kv_cache = prepared.new_cache
        return runner

    def _drop(self, prepared: _Prepared) -> None:
        """A failed prepare: nothing of it stays (runner, cache, mappings, segment name)."""
        prepared.acked = True
        if prepared.build is not None:
            prepared.build.wait()  # no thread outlives its epoch
        if prepared.segment is not None:
            kv_segment.unlink(prepared.segment)
        if self._prepared is prepared:
            self._prepared = None

    def commit(self, epoch: int) -> TransitionAck:
        t0 = time.perf_counter()
        if epoch <= self.epoch:
            return TransitionAck(epoch, False, "commit", f"stale epoch {epoch} (committed {self.epoch})")
        prepared = self._prepared
        if prepared is None or prepared.epoch != epoch:
            return TransitionAck(epoch, False, "commit", f"epoch {epoch} was not prepared")
        old, new = self.topology, prepared.new
        moved = 0
        if prepared.span is not None:
            span = prepared.span
            gone, born = changed_groups(old, new)
            my_old, my_new = old.group_of(self.rank), new.group_of(self.rank)
            if prepared.precopy is not None:
                # Normally nothing is left: the coordinator commits after every prepare ack. A scripted
                # commit may come earlier; the rest is one-sided, so it runs right here.
                self.bytes_by_path["shm"] += prepared.precopy.finish_mine()
                self._maybe_finish_prepare(prepared, force=True)
            build_error = ""
            if prepared.build is not None and prepared.runner is None:
                try:
                    prepared.runner = self._wait_runner(prepared)
                except RuntimeError as exc:  # told to the span below: nobody switches
                    build_error = f"worker {self.rank}: new runner: {exc}"
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
            if self.kv_path == "shm":
                heads = migration.heads_of(self.model_config.num_kv_heads, my_old, self.rank) if my_old in gone else None
                moved = copy_transfers_one_sided(self.rank, delta.transfers, self.runner.kv_cache if my_old in gone else None,
                                                 heads, prepared.dst_caches)
                # Every write into a new cache has landed before any new group runs a step.
                self.world.all_gather_bytes(b"", span.start, span.tp)
                self.bytes_by_path["shm"] += moved
            else:
                moved = self._move(delta, my_old, my_new, gone, born, prepared.runner)
                self.bytes_by_path["p2p"] += moved
            if my_new in born:
                assert prepared.runner is not None, "a changed worker built its new runner at prepare"
                self.runner = prepared.runner
                self.engine = None
                if my_new.leader == self.rank:
                    engine = self._new_engine(my_new, prepared.runner)
                    engine._step_id = max(step for _, _, step, _, _ in decoded)
                    placements = {p.request_id: p for p in delta.placements if p.dst_group == my_new}
                    states = [s for st, *_ in decoded for s in st if s["id"] in placements]
                    migration.install_states(engine, states, placements)
                    engine.check_integrity()
                    self.engine = engine
        prepared.dst_caches.clear()  # drop the mappings of other workers' caches
        prepared.precopy = None
        self.topology, self.epoch, self._prepared = new, epoch, None
        return TransitionAck(epoch, True, "commit", "", _ms(t0), moved)

    def abort(self, epoch: int) -> TransitionAck:
        prepared = self._prepared
        if prepared is not None and prepared.epoch == epoch:
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

    def _map_new_caches(self, epoch: int, born: tuple[Group, ...], own: torch.Tensor | None):
        """Every new cache of the span (this worker's own included), with the global heads it holds."""
        heads = self.model_config.num_kv_heads
        caches = {}
        for g in born:
            for w in g.workers:
                if w == self.rank:
                    assert own is not None, "a changed worker allocated its new cache"
                    cache = own
                else:
                    cache = kv_segment.attach(kv_segment.segment_name(self.node_tag, epoch, w), self._cache_shape(g.tp),
                                              self._dtype)
                caches[w] = (cache, migration.heads_of(heads, g, w))
        return caches

    def _move(self, plan: ReshardPlan, my_old: Group, my_new: Group, gone, born, runner) -> int:
        heads = self.model_config.num_kv_heads
        old_kv = self.runner.kv_cache if my_old in gone else None
        new_kv = runner.kv_cache if runner is not None else None
        return migration.execute_transfers(
            self.world, plan.transfers, self.rank,
            old_kv, migration.heads_of(heads, my_old, self.rank) if my_old in gone else None,
            new_kv, migration.heads_of(heads, my_new, self.rank) if my_new in born else None,
        )

    # -- after a member of the node world died ------------------------------------------------------
    world_lost: str = ""  # why this worker left the node world ("" while it is in it)

    def leave_world(self, reason: str) -> list[str]:
        """A collective failed because a worker of the node world is gone. A process world cannot take a
        member back, so this worker serves standalone at TP=1 from now on (as a restarted worker does) and
        takes part in no further collective. Returns the ids of the requests its engine held and could not
        keep: the caller re-queues them.

        A TP=1 group holds its requests' whole KV: its runner and engine stay, its requests continue. A
        larger group's KV was sharded over its members, one of which may be dead: a TP=1 runner over the
        same weight store (views: nothing is read or copied) and an empty engine take over. A prepared
        transition is dropped either way (its new cache goes with it, and any KV segment name of this worker
        a failed exchange left in /dev/shm)."""
        assert 1 in self.world.levels, "a fallback to TP=1 needs TP=1 among the node's levels (NITSUM_MIN_TP=1)"
        self.close()
        self.world_lost = reason
        old = self.group
        solo = Group(self.rank, 1)
        self.topology = Topology.uniform(self.world.size, 1)
        if old.tp == 1 and self.engine is not None:
            dropped = []
        else:
            dropped = sorted(self.engine._seqs) if self.engine is not None else []
            self.runner = self._new_runner(solo)
            self.engine = self._new_engine(solo, self.runner)
        self.drop_communicators(keep=None)
        return dropped

    def drop_communicators(self, keep: Group | None) -> int:
        """After a peer loss: tear down this worker's pre-built process groups, all but `keep`'s. A member still
        waiting in a collective of one of them (gloo: the dead worker's ring neighbour waits for data that never
        comes) then fails at once ("connection closed") instead of at the world timeout. gloo closes a group's
        connections only when its last reference goes: the caller drops what it held (a failed prepare's
        runner, the traceback) first. Returns how many groups went. NodeWorld has no public way to drop one
        group, hence its table is edited here."""
        import gc

        import torch.distributed as dist

        groups = self.world._groups  # (start, tp) -> process group (None at TP=1: there is nothing to drop)
        doomed = [key for key, pg in groups.items() if pg is not None and (keep is None or key != (keep.start, keep.tp))]
        for key in doomed:
            dist.destroy_process_group(groups.pop(key))
        gc.collect()  # runners and engines of a failed step may sit in reference cycles
        return len(doomed)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _kv_wire(r: RequestKV) -> list[Any]:
    return [r.request_id, r.group.start, r.group.tp, r.num_computed_tokens, list(r.block_ids)]


def _kv_unwire(w: list[Any]) -> RequestKV:
    rid, start, tp, computed, blocks = w
    return RequestKV(rid, Group(start, tp), computed, tuple(blocks))
