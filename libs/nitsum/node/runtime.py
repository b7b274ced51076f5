"""One worker's share of a node whose TP groups change at run time: Prepare / Commit / Abort with epochs.

`NodeRuntime` wraps what this worker is in the current topology: the *leader* of its group (lowest rank:
it owns an `Engine`, batches, samples and drives its peers through the msgpack step plan) or a *peer*
(it runs the plans its leader broadcasts). A topology command reaches every worker of the group at the
same step boundary: the leader gets it (from the coordinator), broadcasts it as a control plan, and every
member applies it (`NodeRuntime.command` on the leader, `follow` on peers).

Transition (ALGORITHMS.md §1.4), with `span` = this worker's *component* of the change: the largest changed
group (old or new) that holds it (`kv.reshard.component_of`). Components share no worker, KV or request, so each
runs the steps below inside its own group (2xTP2 -> 4xTP1: two splits, neither waits for the other):
- `prepare(epoch, new)`: each changed worker takes a KV cache for its new head slice -- in shm mode a view of
  its spare arena (`kv_segment.Arena`: two per worker, reserved at boot; commit makes the old cache's arena
  the spare), else a fresh one; the span all-gathers the old leaders' block tables; every worker computes the
  same `plan_prepare` (the full blocks to move). The new runner comes from the worker's pool: one runner per
  allowed level (weight *views* of the boot store: no weight is read or allocated), built at boot
  (`_build_ahead`); a change that finds none builds it in a thread, and a fresh segment's pages are reserved
  there, paced, and on past the commit.
  KV paths are agreed once, at construction (`kv_hosts`): every worker all-gathers its host id
  (NITSUM_HOST_ID, else hostname + boot id + its /dev/shm's device), whether it can use /dev/shm, and where
  its KV receiver listens; then each (source, destination) pair has a path.
  One-sided mode (CPU; "auto" picks it): the full blocks move in chunks *between the old groups' decode
  steps* (`precopy.py`; each old group's leader drives its members with `precopy` control plans), written
  into each destination's new cache with no receive posted by its step thread:
  - pairs on one host ("shm"): the new cache lives in shared memory that every source of the host maps (a
    spare arena through /proc/<pid>/fd, or a fresh segment whose name is unlinked before prepare returns)
    and writes into;
  - pairs across hosts ("tcp"): the source connects to the destination's KV receiver in prepare (stage-M
    DSCP; a pair that cannot connect refuses the prepare on every member) and sends each chunk over the
    transfer framing; the receiver's thread writes it into the new cache and acks after the write
    (`kv_tcp.py`). Forced for every pair by kv_path "tcp".
  The prepare ack is then `pending`; the final one comes when the group's chunks are done and this
  worker's runner is built (`take_prepare_ack`); a chunk whose link failed fails that ack and the commit.
  KV path "p2p" (GPU caches, or configured): the runner is awaited and paired gloo send/recv moves every
  full block inside the prepare step. A failure anywhere (e.g. no memory for the new cache)
  makes every worker ack `ok=False` and keep nothing: the old topology keeps serving; Abort then is a no-op.
  (A peer whose runner build fails is known to its leader only at commit: the commit exchange carries it
  and every worker then keeps the old topology.)
- `commit(epoch)` at a step boundary: each worker finishes whatever pre-copy of its own is left, old
  leaders export their requests' full state, the span all-gathers it, every worker computes `plan_commit`
  (the delta: blocks written since prepare, requests that arrived or were preempted since) and moves it
  (one-sided: shared-memory writes and acked TCP chunks, then an exchange that passes only once every
  source's bytes are written; a failed link there makes every worker keep the old topology); new leaders
  adopt the requests into fresh engines; roles switch. This is the only pause a stream sees. What the old
  topology used is released after it, off the step thread: the old cache and the mappings by the reaper
  (`reaper.py`), the old runner back into the pool.
- `abort(epoch)`: drops the prepared state (new caches, views, mappings, TCP links and the receiver's
  session); the old topology never stopped.
Epochs only grow: a command with an epoch at or below the committed one is refused (as is a commit of
an epoch that was not prepared).

Workers outside the span take no part in the collectives; they only advance their epoch and topology.
The transition code itself (prepare/commit/abort, pre-copy, the command and ack types) is in
`transition.py`, mixed into `NodeRuntime`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Callable

import torch

from nitsum.node import kv_hosts, kv_segment
from nitsum.engine.engine import Engine
from nitsum.node.kv_tcp import KvReceiver
from nitsum.engine.params import EngineConfig, RequestOutput, SamplingParams
from nitsum.engine.plan import PLAN_KIND_CONTROL, PLAN_KIND_NOOP, PLAN_KIND_SHUTDOWN, PLAN_KIND_STEP, StepPlan
from nitsum.node.precopy import DEFAULT_CHUNK_BYTES
from nitsum.node.reaper import Reaper
from nitsum.engine.runner import ModelRunner, num_kv_blocks_for
from nitsum.node.transition import (  # noqa: F401  (re-exported: the worker shell and tests import them here)
    COMMAND_KINDS,
    KV_PATHS,
    NodeCommand,
    NodeTransition,
    TransitionAck,
    _Prepared,
)
from nitsum.kv.reshard import Group, KVGeometry, Topology
from nitsum.model import loader
from nitsum.model.loader import read_raw_config
from nitsum.model.model import Workspace
from nitsum.model.tokenizer import Tokenizer
from nitsum.parallel import shm_collectives as shm_collectives_lib
from nitsum.parallel.world import NodeWorld

FailureHook = Callable[[str, int], None]
KV_HISTORY = 4096  # entries of kv_pairs / kv_tos kept


log = logging.getLogger("nitsum.node.runtime")

class NodeRuntime(NodeTransition):
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
        host_id: str = "",
        kv_advertise_addr: str = "",
        master_addr: str = "127.0.0.1",
        kv_fault_epoch: int = 0,
        kv_fault_chunk_epochs: tuple[int, ...] = (),
        engine: Engine | None = None,
        epoch: int = 0,
        shm_collectives: bool = True,
    ) -> None:
        """`engine` (with `epoch`): adopt a TP=1 engine this worker already serves with (a standalone worker,
        or one that fell back to TP=1, joining a re-formed node world): its runner, KV cache and requests
        carry on unchanged (a TP=1 engine uses no communicator); later changes build runners from `weights`."""
        assert topology.num_workers == world.size, "the topology covers the node's workers"
        if engine is not None and topology.group_of(world.rank).tp != 1:
            raise ValueError(f"an adopted engine serves TP=1, but worker {world.rank} is in {topology.group_of(world.rank)}")
        if engine is not None and engine.runner.group.size != 1:
            raise ValueError(f"only a TP=1 engine can be adopted, this one runs at TP={engine.runner.group.size}")
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
        # Chosen once, by the whole world: who shares a host (and so a /dev/shm), where each KV receiver
        # listens, and the mode (one-sided "shm"/"tcp", or paired "p2p"); then a path per pair (`kv_hosts`).
        # (A setting that cannot work raises on every member after the exchange, not on one before it.)
        shm_possible = world.device == "cpu" and kv_segment.available()
        addr = kv_hosts.advertise_addr(kv_advertise_addr, master_addr)
        self._kv_receiver: KvReceiver | None = None
        if world.device == "cpu" and kv_path != "p2p":
            self._kv_receiver = KvReceiver("127.0.0.1" if kv_hosts.is_loopback(addr) else "", kv_fault_epoch,
                                           kv_fault_chunk_epochs)
        me = kv_hosts.Member(world.rank, kv_hosts.local_host_id(host_id), shm_possible, world.device, kv_path, addr,
                             self._kv_receiver.port if self._kv_receiver is not None else 0, os.getpid(),
                             shm_collectives_lib.pid_namespace(), shm_collectives,
                             self._kv_receiver.token if self._kv_receiver is not None else 0)
        try:
            self.members = kv_hosts.exchange(world, me)
            self.kv_path = kv_hosts.resolve_mode(self.members)
            # Groups of one host: their collectives through shared memory (NITSUM_TP_SHM_COLLECTIVES, which
            # every member of a group must have on: decided from the exchange, so all members agree).
            self.shm_channels = world.attach_channels(self._shares_host)
            # Whose /proc/<pid>/fd each worker may open (a spare arena is handed over by that path).
            readers = kv_hosts.fd_readers(world, self.members, self.rank) if self.kv_path == "shm" else None
        except BaseException:
            self._close_receiver()
            raise
        if self.kv_path == "p2p":
            self._close_receiver()
        self.precopy_chunk_bytes = precopy_chunk_bytes
        self.node_tag = node_tag or f"p{world.master_port}"
        self.bytes_by_path = {"shm": 0, "tcp": 0, "p2p": 0}  # KV bytes this worker moved into other workers' caches
        self.planned_by_path = {"shm": 0, "tcp": 0, "p2p": 0}  # ... that the agreed plans gave it to move
        # (epoch, src, dst, path, bytes) of the migration flows of agreed plans with this worker as source, and
        # the IP_TOS of the TCP KV links it opened: the latest ones (tests, diagnostics).
        self.kv_pairs: deque[tuple[int, int, int, str, int]] = deque(maxlen=KV_HISTORY)
        self.kv_tos: deque[int] = deque(maxlen=KV_HISTORY)
        self._failure_hook = failure_hook
        self._reaper = Reaper(f"nitsum-reaper-{world.rank}")  # frees what a commit retired, off the step thread
        self.topology = topology
        self.epoch = epoch  # an adopting worker keeps its epoch: epochs it saw never come back
        self._prepared: _Prepared | None = None
        self._reserving: list = []  # builds of caches commits switched to, while they reserve pages
        self._prepare_done: TransitionAck | None = None
        self.engine: Engine | None = None
        # This worker's runners for the TP levels it is not at, built ahead (see `_new_runner`).
        self._runner_pool: dict[tuple[int, int], ModelRunner] = {}
        self._pool_lock = threading.Lock()
        self.runner_builds = 0  # ModelRunners this worker constructed (one per level unless a change outran `_build_ahead`)
        self.engines_at_commit = 0  # new groups' Engines a commit made itself (normally prepare made them ahead)
        # KV arenas (shm mode): the cache in use and a spare one, both made and reserved here, each as large as
        # the largest level's cache. A change's new cache is a view of the spare, and its commit makes the old
        # cache's arena the spare: a change allocates, zeroes and reserves no memory (64 MiB of page zeroing per
        # changed worker was the largest CPU cost of a change here, on top of the old groups' steps). The price
        # is a second arena per worker for as long as it runs.
        self._arena: kv_segment.Arena | None = None  # backs the cache in use (None: a private or adopted one)
        self._spare: kv_segment.Arena | None = None
        self._arena_bytes = max(kv_segment.nbytes_of(self._cache_shape(tp), self._dtype) for tp in world.levels)
        same_namespace = self.kv_path == "shm" and shm_possible and kv_hosts.maps_arenas_of(self.members, self.rank)
        self._recycle = same_namespace and kv_hosts.maps_arenas_of(self.members, self.rank, readers)
        if same_namespace and not self._recycle:
            log.warning("worker %d: a worker that shares this host's memory cannot open this one's /proc/%d/fd "
                        "(hidepid, another user id or a security module): its TP changes make fresh KV segments",
                        self.rank, os.getpid())
        if self._recycle:
            try:
                self._spare = self._new_arena()
                if engine is None:
                    self._arena = self._new_arena()
            except (OSError, RuntimeError) as exc:
                log.warning("worker %d: no KV arenas (%s): every TP change makes its new cache afresh", self.rank, exc)
                self._release_arena(self._spare)
                self._spare, self._arena, self._recycle = None, None, False
        if engine is not None:
            self.runner, self.engine = engine.runner, engine
            self._workspace = engine.runner.workspace
            self.runner.node_group = (self.group.start, self.group.tp)
        else:
            self._workspace = Workspace()
            self.runner = self._new_runner(self.group, with_cache=self._arena is None)
            if self._arena is not None:
                self.runner.kv_cache = self._arena.view(tuple(self.runner.kv_cache_shape), self._dtype)
            if self.is_leader:
                self.engine = self._new_engine(self.group, self.runner)
        self._prebuild = threading.Thread(target=self._build_ahead, name="nitsum-runner-prebuild", daemon=True)
        self._prebuild.start()
        self.last_ack: TransitionAck | None = None
        # Where the last prepare step's time went (ms since its start, cumulative): built (runner + new
        # cache), exchanged (the span's rendezvous: the wait for the slowest member), planned, mapped, agreed.
        self.last_prepare_timings_ms: dict[str, float] = {}
        self.last_commit_timings_ms: dict[str, float] = {}  # the same for the last commit (see `commit`)

    def _new_arena(self) -> kv_segment.Arena:
        name = kv_segment.segment_name(self.node_tag, 0, self.rank) + f"-arena-{os.urandom(4).hex()}"
        return kv_segment.Arena.create(name, self._arena_bytes)

    def _release_arena(self, arena: kv_segment.Arena | None) -> None:
        """An arena nothing uses any more: its descriptor now, its pages in the reaper (MADV_REMOVE)."""
        if arena is not None:
            arena.close()
            self._reaper.retire(own=[arena.flat])

    @property
    def arenas_held(self) -> int:
        """KV arenas this worker keeps (their descriptors are open): the one in use and the spare."""
        return sum(a is not None and a.fd is not None for a in (self._arena, self._spare))

    def _shares_host(self, ranks) -> bool:
        """Every member of these ranks shares the first one's /dev/shm and has shared-memory collectives on."""
        first = self.members[ranks[0]]
        return all(kv_hosts.shares_memory(first, self.members[r]) and self.members[r].tpc for r in ranks)

    # -- what this worker is now --------------------------------------------------------------------
    @property
    def group(self) -> Group:
        return self.topology.group_of(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.group.leader == self.rank

    @property
    def in_transition(self) -> bool:
        """A prepared change is held (its commit or abort has not come yet)."""
        return self._prepared is not None

    def _tp_group(self, group: Group):
        return self.world.group(group.start, group.tp)

    # -- runners: one per TP level this worker may join --------------------------------------------------
    def _new_runner(self, group: Group, with_cache: bool = True) -> ModelRunner:
        """This worker's runner for `group`. Weights are views, so a runner is modules and rope tables; on a
        loaded 2-core host building one took 100-400 ms of CPU and GIL, in a thread racing the old group's decode
        steps and the prepare step's exchanges. So every level's runner is built once, ahead (`_build_ahead`,
        at boot), and a runner a change leaves goes back to the pool (`_shelve_runner`); building here is the
        fallback. `with_cache`: allocate its KV cache (zeros) here; else the caller attaches the one prepare made.
        A worker sits at one aligned group per level, so (start, tp) names its runner for that level."""
        key = (group.start, group.tp)
        with self._pool_lock:
            runner = self._runner_pool.pop(key, None)
        if runner is None:
            runner = self._build_runner(group)
        runner.workspace = self._workspace  # one per worker (one runner computes at a time): its pages are warm
        if with_cache and runner.kv_cache is None:
            runner.kv_cache = torch.zeros(runner.kv_cache_shape, dtype=runner.dtype, device=runner.device)
        return runner

    def _pooled_runner(self, group: Group) -> ModelRunner | None:
        """This worker's pooled runner for `group` (without a KV cache), or None when the pool has none."""
        with self._pool_lock:
            runner = self._runner_pool.pop((group.start, group.tp), None)
        if runner is not None:
            runner.workspace = self._workspace
        return runner

    def _build_runner(self, group: Group) -> ModelRunner:
        cfg = self.cfg
        with self._pool_lock:
            self.runner_builds += 1
        runner = ModelRunner(
            cfg.model_dir, self._tp_group(group), device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size,
            num_kv_blocks=self._num_blocks_of[group.tp], weights=self.weights, config=self.model_config,
            allocate_kv_cache=False,
        )
        runner.node_group = (group.start, group.tp)
        return runner

    def _shelve_runner(self, runner: ModelRunner) -> None:
        """A runner no longer in use goes back to the pool, without its KV cache (the caller frees that)."""
        runner.kv_cache = None
        with self._pool_lock:
            self._runner_pool.setdefault(runner.node_group, runner)

    def wait_built_ahead(self, timeout_s: float | None = None) -> None:
        """Until every level's runner is built (tests and benchmarks that want the steady state)."""
        self._prebuild.join(timeout_s)

    def _build_ahead(self) -> None:
        """Boot, in a thread: this worker's runner at every other allowed level (no KV cache: a transition
        allocates that). A failure only costs the later change the build it would have done anyway."""
        for tp in sorted(self.world.levels):
            group = Group(self.rank - self.rank % tp, tp)
            with self._pool_lock:
                if group == self.topology.group_of(self.rank) or (group.start, tp) in self._runner_pool:
                    continue
            try:
                runner = self._build_runner(group)
            except Exception:
                log.exception("worker %d: building the TP=%d runner ahead failed (a change to it builds one)", self.rank, tp)
                return
            with self._pool_lock:
                self._runner_pool.setdefault((group.start, tp), runner)

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
        create and unlink inside a prepare can leave one), drop the prepared state (its KV links and receiver
        thread go too) and close the KV receiver's listening socket."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared.build is not None:
            prepared.build.stop_after()  # a reservation running: given up at its next piece, not joined to its end
            prepared.build.finish()
            self._join_engine_ahead(prepared)
            if prepared.build.runner is not None:
                self._shelve_runner(prepared.build.runner)
        if prepared is not None:
            self._release_links(prepared)
            if prepared.arena is not None:  # the spare it took, or one made for the epoch
                prepared.arena.close()
                prepared.arena = None
        self._close_receiver()
        self._reap_reservations(stop=True)
        for arena in (self._arena, self._spare):
            if arena is not None:
                arena.close()  # the memory goes with the last mapping (the cache in use keeps computing)
        self._arena = self._spare = None
        self._recycle = False
        self._reaper.drain()
        self._prebuild.join(30.0)
        for name in kv_segment.leftovers(self.node_tag):
            if name.endswith(f"-w{self.rank}"):
                kv_segment.unlink(name)

    def _close_receiver(self) -> None:
        receiver, self._kv_receiver = self._kv_receiver, None
        if receiver is not None:
            receiver.close()

    def kv_path_of(self, src: int, dst: int) -> str:
        """How KV moves from worker `src` to worker `dst`: "local", "shm", "tcp" or "p2p"."""
        return kv_hosts.pair_path(self.kv_path, self.members, src, dst)

    def kv_data_plane_open(self) -> tuple[int, int]:
        """(TCP KV sockets this process holds open, KV receiver threads alive): (0, 0) between transitions."""
        from nitsum.node.kv_tcp import THREAD_PREFIX, open_kv_sockets

        mine = self.members[self.rank].port
        sockets = open_kv_sockets(mine, (m.port for m in self.members if m.rank != self.rank)) if mine else 0
        threads = sum(1 for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))
        return sockets, threads

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

    # -- after a member of the node world died ------------------------------------------------------
    world_lost: str = ""  # why this worker left the node world ("" while it is in it)

    def leave_world(self, reason: str) -> list[str]:
        """A collective failed because a worker of the node world is gone. A process world cannot take a
        member back, so this worker serves standalone at TP=1 (as a restarted worker does) and takes part in
        no further collective of this world, until the node is re-formed: a new world generation among the
        same devices (NodeWorld(generation=g)) whose NodeRuntime adopts this TP=1 engine (`engine=`). Returns the ids of the requests its engine held and could not
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
        # The runners built ahead for other levels hold their groups too (a TP=1 runner holds none).
        self._prebuild.join()
        with self._pool_lock:
            for key in [k for k in self._runner_pool if k in doomed]:
                del self._runner_pool[key]
        for key in doomed:
            self.world.drop_channel(*key)
            dist.destroy_process_group(groups.pop(key))
        gc.collect()  # runners and engines of a failed step may sit in reference cycles
        return len(doomed)
