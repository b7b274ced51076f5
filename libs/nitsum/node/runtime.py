"""One worker's share of a node whose TP groups change at run time (`NodeRuntime`); the protocol is told in
the package's docstring (`nitsum.node`). The runtime holds what lasts across epochs: the world, this worker's
topology (its groups' roles with it) and epoch, its runner and engine (a group's leader) or its leader to follow
(a peer), and the pieces it is composed of; each epoch's change is one `Transition`, driven by the topology
commands (commands.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from nitsum.engine.engine import Engine
from nitsum.engine.params import EngineConfig, RequestOutput, SamplingParams
from nitsum.engine.plan import PLAN_KIND_CONTROL, PLAN_KIND_NOOP, PLAN_KIND_SHUTDOWN, PLAN_KIND_STEP, StepPlan
from nitsum.engine.runner import ModelRunner
from nitsum.engine.slo import RequestSlo
from nitsum.kv.reshard import RequestKV
from nitsum.model.loader import read_raw_config
from nitsum.model.model import Workspace
from nitsum.model.tokenizer import Tokenizer
from nitsum.node import commands
from nitsum.node.arenas import KvArenas
from nitsum.node.build import PageReservations
from nitsum.node.counters import KvCounters
from nitsum.node.kv_plane import KvPlane
from nitsum.node.layout import CacheLayout
from nitsum.node.messages import COMMAND_KINDS, KV_PATHS, NodeCommand, TransitionAck
from nitsum.node.precopy import DEFAULT_CHUNK_BYTES, MigrationFlow, transfer_block_bytes
from nitsum.node.reaper import Reaper
from nitsum.node.runners import RunnerPool
from nitsum.node.transition import Transition
from nitsum.parallel.world import NodeWorld
from nitsum.topology import Group, Topology
from nitsum.transfer import shm
from nitsum.wire import codec
from nitsum.wire.node import NODE_MESSAGE_TYPES

__all__ = ["COMMAND_KINDS", "KV_PATHS", "NodeCommand", "NodeRuntime", "TransitionAck"]

FailureHook = Callable[[str, int], None]

log = logging.getLogger("nitsum.node.runtime")


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
            raise ValueError(
                f"an adopted engine serves TP=1, but worker {world.rank} is in {topology.group_of(world.rank)}"
            )
        if engine is not None and engine.runner.group.size != 1:
            raise ValueError(f"only a TP=1 engine can be adopted, this one runs at TP={engine.runner.group.size}")
        if kv_path not in KV_PATHS:
            raise ValueError(f"kv_path must be one of {KV_PATHS}, got {kv_path!r}")
        self.world = world
        self.rank = world.rank
        self.cfg = cfg
        self.layout = CacheLayout(cfg, world.levels)  # read once at boot; a TP change reads nothing from disk
        self.tokenizer = Tokenizer(cfg.model_dir, read_raw_config(cfg.model_dir))
        self.node_tag = node_tag or f"p{world.master_port}"
        self.precopy_chunk_bytes = precopy_chunk_bytes
        self.failure_hook = failure_hook
        self.counters = KvCounters()  # what this worker's transitions moved, by path
        self.reaper = Reaper(f"nitsum-reaper-{world.rank}")  # frees what a commit retired, off the step thread
        self.plane = KvPlane(
            world,
            kv_path,
            host_id,
            kv_advertise_addr,
            master_addr,
            kv_fault_epoch,
            kv_fault_chunk_epochs,
            shm_collectives,
        )
        arena_bytes = max(shm.nbytes_of(self.layout.cache_shape(tp), self.layout.dtype) for tp in world.levels)
        self.arenas = KvArenas(self.node_tag, self.rank, arena_bytes, self.reaper, self.plane.recycles_arenas())
        self.topology = topology
        self.epoch = epoch  # an adopting worker keeps its epoch: epochs it saw never come back
        self.transition: Transition | None = None  # the prepared epoch, until its commit or abort
        self.prepare_done: TransitionAck | None = None  # a final prepare ack nobody took yet
        self.reserving = PageReservations(self.rank)  # builds of caches commits switched to, while they reserve pages
        self.engines_at_commit = 0  # new groups' Engines a commit made itself (normally prepare made them ahead)
        self.last_ack: TransitionAck | None = None
        # Where the last prepare step's time went (ms since its start, cumulative): built (runner + new
        # cache), exchanged (the span's rendezvous: the wait for the slowest member), planned, mapped, agreed.
        self.last_prepare_timings_ms: dict[str, float] = {}
        self.last_commit_timings_ms: dict[str, float] = {}  # the same for the last commit (see `Transition.commit`)
        self.world_lost = ""  # why this worker left the node world ("" while it is in it)
        # Each group's leader's worker id, as the last commit set them ((start, tp) -> worker id; the prepared
        # epoch's wait in its Transition). The groups' roles are in `topology`.
        self.leaders: dict[tuple[int, int], str] = {}
        self.handoff_handles: tuple[int, tuple[str, ...]] | None = None  # (epoch, this group's arena handles)
        codec.prepare_codecs(NODE_MESSAGE_TYPES)  # not inside the first change's exchanges
        self._start_serving(weights, engine)

    def _start_serving(self, weights: dict[str, torch.Tensor], engine: Engine | None) -> None:
        """The runner and engine of the first topology (or the adopted engine's), and the other levels' runners
        built ahead in a thread."""
        self.engine: Engine | None = None
        self.arenas.reserve_at_boot(with_in_use=engine is None)
        workspace = engine.runner.workspace if engine is not None else Workspace()
        self.pool = RunnerPool(
            self.rank, self.cfg, weights, self.layout.model_config, self.layout.num_blocks_of, self._tp_group, workspace
        )
        if engine is not None:
            self.runner, self.engine = engine.runner, engine
            self.runner.node_group = (self.group.start, self.group.tp)
        else:
            in_use = self.arenas.in_use
            self.runner = self.pool.runner(self.group, with_cache=in_use is None)
            if in_use is not None:
                self.runner.kv_cache = in_use.view(tuple(self.runner.kv_cache_shape), self.layout.dtype)
            if self.is_leader:
                self.engine = self.new_engine(self.group, self.runner)
        self.pool.start_ahead(self.world.levels, lambda: self.topology.group_of(self.rank))

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
        return self.transition is not None

    @property
    def prepared_epoch(self) -> int | None:
        """The epoch of the prepared change, None when none is held."""
        return self.transition.epoch if self.transition is not None else None

    @property
    def arenas_held(self) -> int:
        """KV arenas this worker keeps (their descriptors are open): the one in use and the spare."""
        return self.arenas.held

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """This worker's boot weight store (views of it make every level's runner)."""
        return self.pool.weights

    @property
    def runner_builds(self) -> int:
        """ModelRunners this worker constructed (one per level unless a change outran the pool's build ahead)."""
        return self.pool.builds

    def _tp_group(self, group: Group):
        return self.world.group(group.start, group.tp)

    def new_engine(self, group: Group, runner: ModelRunner) -> Engine:
        return Engine(self.cfg, self._tp_group(group), runner=runner, tokenizer=self.tokenizer)

    def wait_built_ahead(self, timeout_s: float | None = None) -> None:
        """Until every level's runner is built (tests and benchmarks that want the steady state)."""
        self.pool.wait_ahead(timeout_s)

    def kv_snapshot(self, group: Group) -> list[RequestKV]:
        """The block tables of this worker's engine's requests, as `group` holds them ([] without an engine)."""
        return self.engine.snapshot_kv(group) if self.engine is not None else []

    def block_bytes(self, t) -> int:
        return transfer_block_bytes(
            t, self.cfg.block_size, self.layout.model_config.head_dim, self.runner.kv_cache.element_size()
        )

    # -- leader: requests and steps -----------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, slo: RequestSlo | None = None
    ) -> None:
        assert self.engine is not None, f"worker {self.rank} is not a group leader"
        self.engine.add_request(request_id, prompt_token_ids, params, slo)

    def step(self) -> list[RequestOutput]:
        assert self.engine is not None, f"worker {self.rank} is not a group leader"
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished()

    def command(self, cmd: NodeCommand) -> TransitionAck:
        """Leader: run a topology command on every member of the group at this step boundary."""
        assert self.is_leader, "commands enter a group through its leader"
        self._broadcast(cmd)
        return commands.apply(self, cmd)

    def broadcast(self, cmd: NodeCommand) -> None:
        """Leader: send a command to the group's peers (they run it as they follow)."""
        self._broadcast(cmd)

    @property
    def role(self) -> str:
        """This worker's group's role ("hybrid" unless a commit said otherwise)."""
        return self.group.role

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
                self.run_precopy(cmd)
                return "precopy"
            self.last_ack = commands.apply(self, cmd)
        else:
            assert plan.kind in (PLAN_KIND_NOOP, PLAN_KIND_SHUTDOWN), f"unexpected plan kind {plan.kind}"
        return plan.kind

    # -- pre-copy between steps (one-sided mode), through the prepare's gate ------------------------------
    @property
    def precopy_pending(self) -> bool:
        """A prepare of this worker is accepted but not final yet (its pre-copy is running)."""
        return self.transition is not None and self.transition.gate.pending

    def precopy_flows(self) -> tuple[MigrationFlow, ...]:
        """The migration flows this worker's old group still has to pre-copy (its leader drives them)."""
        t = self.transition
        if t is None or t.precopy is None or t.acked:
            return ()
        return t.precopy.flows

    def precopy_next_items(self, flows) -> list[tuple[int, int]]:
        """(flow, chunk) of the next chunk not done of each of these flows (those with one left)."""
        t = self.transition
        if t is None or t.precopy is None:
            return []
        return t.precopy.next_items_of(flows)

    def precopy(
        self,
        items: list[tuple[int, int]] | None = None,
        wait_build: bool = False,
        classes: Mapping[int, int] | None = None,
    ) -> int | None:
        """Leader of an old group, between two steps: run these (flow, chunk) items on every member (default:
        the next chunk of every unfinished flow); across hosts each flow's chunks go in its class, `classes`
        (flow index -> the DSCP of its permit's level), the lowest level's for a flow not in it (no permit: a
        scripted driver). Returns the bytes this worker sent, None when no pre-copy is running (finished,
        committed or aborted). The final prepare ack also needs this worker's new runner: `wait_build` waits
        for it here once every chunk is done (a scripted coordinator); else `poll_prepare` produces it later."""
        assert self.is_leader, "the old group's leader drives its pre-copy"
        if not self.precopy_pending:
            return None
        t = self.transition
        assert t is not None and t.precopy is not None
        chunks = tuple(items) if items is not None else tuple(t.precopy.next_items())
        cmd = NodeCommand("precopy", t.epoch, chunks=chunks, classes=tuple(sorted((classes or {}).items())))
        self._broadcast(cmd)
        return self.run_precopy(cmd, wait_build)

    def precopy_flows_done(self, indices) -> tuple[set[int], bool]:
        """(those of these flows whose every chunk is copied, whether the whole pre-copy is complete)."""
        t = self.transition
        if t is None or t.precopy is None:
            return set(), False
        return {i for i in indices if t.precopy.flow_done(i)}, t.precopy.complete

    def poll_prepare(self, wait_s: float = 0.0) -> None:
        """Leader, between steps: every chunk is done; produce the final prepare ack once the new runner is
        built (waiting up to `wait_s` for it)."""
        if self.transition is not None:
            self.transition.gate.poll(wait_s)

    def take_prepare_ack(self) -> TransitionAck | None:
        """The final ack of a prepare whose pre-copy just completed (once), else None."""
        ack, self.prepare_done = self.prepare_done, None
        return ack

    def run_precopy(self, cmd: NodeCommand, wait_build: bool = False) -> int:
        """Run a "precopy" command's chunks (this worker's part); the bytes it sent."""
        t = self.transition
        if t is None or t.epoch != cmd.epoch or t.precopy is None:
            return 0  # aborted or committed meanwhile: nothing left to copy
        return t.gate.run(cmd.chunks, dict(cmd.classes), wait_build)

    def reap_reservations(self, wait: bool = False, stop: bool = False) -> None:
        """Forget the finished page reservations of caches commits switched to (see `PageReservations`)."""
        self.reserving.reap(wait, stop)

    # -- KV paths -----------------------------------------------------------------------------------
    def kv_path_of(self, src: int, dst: int) -> str:
        """How KV moves from worker `src` to worker `dst`: "local", "shm", "tcp" or "p2p"."""
        return self.plane.path_of(src, dst)

    def kv_data_plane_open(self) -> tuple[int, int]:
        """(TCP KV sockets this process holds open, KV receiver threads alive): (0, 0) between transitions."""
        return self.plane.open_now()

    # The agreed plane: the world's mode, its members, this worker's KV receiver.
    kv_path = property(lambda self: self.plane.mode)
    members = property(lambda self: self.plane.members)
    receiver = property(lambda self: self.plane.receiver)

    # -- stop (after a member of the node world died: `nitsum.node.fallback`) ------------------------------
    def close(self) -> None:
        """At stop: remove any KV segment name of this worker still in /dev/shm (only a crash between
        create and unlink inside a prepare can leave one), drop the prepared state (its KV links and receiver
        thread go too) and close the KV receiver's listening socket."""
        transition, self.transition = self.transition, None
        if transition is not None:
            transition.close()
        self.plane.close_receiver()
        self.reap_reservations(stop=True)
        self.arenas.close()
        self.reaper.drain()
        self.pool.wait_ahead(30.0)
        for name in shm.leftovers(self.node_tag):
            if name.endswith(f"-w{self.rank}"):
                shm.unlink(name)
