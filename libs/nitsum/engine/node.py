"""One worker's share of a node whose TP groups change at run time: Prepare / Commit / Abort with epochs.

`NodeRuntime` wraps what this worker is in the current topology: the *leader* of its group (lowest rank:
it owns an `Engine`, batches, samples and drives its peers through the msgpack step plan) or a *peer*
(it runs the plans its leader broadcasts). A topology command reaches every worker of the group at the
same step boundary: the leader gets it (from the coordinator), broadcasts it as a control plan, and every
member applies it (`NodeRuntime.command` on the leader, `follow` on peers).

Transition (ALGORITHMS.md §1.4), with `span` = the smallest aligned group covering every changed worker:
- `prepare(epoch, new)`: each changed worker builds its new runner (weight *views* of the boot store and a
  fresh KV cache for its new head slice; no weight is read or allocated); the span all-gathers the old
  leaders' block tables; every worker computes the same `plan_prepare` and moves the full blocks. The
  old groups keep decoding afterwards. A failure anywhere (e.g. no memory for the new cache) makes every
  worker ack `ok=False` and keep nothing: the old topology keeps serving; Abort then is a no-op.
- `commit(epoch)` at a step boundary: old leaders export their requests' full state, the span
  all-gathers it, every worker computes `plan_commit` (the delta: blocks written since prepare, requests
  that arrived since) and moves it; new leaders adopt the requests into fresh engines; roles switch.
  This is the only pause a stream sees.
- `abort(epoch)`: drops the prepared state (new caches, views); the old topology never stopped.
Epochs only grow: a command with an epoch at or below the committed one is refused (as is a commit of
an epoch that was not prepared).

Workers outside the span take no part in the collectives; they only advance their epoch and topology.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch

from nitsum.engine import migration
from nitsum.engine.engine import Engine
from nitsum.engine.params import EngineConfig, RequestOutput, SamplingParams
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

COMMAND_KINDS = ("prepare", "commit", "abort")


@dataclass(frozen=True)
class NodeCommand:
    """A topology command as it travels inside a control step plan (msgpack)."""

    kind: str
    epoch: int
    groups: tuple[tuple[int, int], ...] = ()  # prepare: the new topology as (start, tp) pairs

    def encode(self) -> bytes:
        return msgpack.packb([self.kind, self.epoch, [list(g) for g in self.groups]], use_bin_type=True)

    @staticmethod
    def decode(payload: bytes) -> NodeCommand:
        kind, epoch, groups = msgpack.unpackb(payload, raw=False)
        if kind not in COMMAND_KINDS:
            raise ValueError(f"unknown node command {kind!r}")
        return NodeCommand(kind, int(epoch), tuple((int(s), int(t)) for s, t in groups))


@dataclass(frozen=True)
class TransitionAck:
    """Mirrors the wire's TopologyAck (the worker shell adds its id)."""

    epoch: int
    ok: bool
    phase: str  # "prepare" | "commit" | "abort"
    reason: str = ""
    duration_ms: float = 0.0
    bytes_moved: int = 0  # KV bytes this worker sent to other workers


@dataclass
class _Prepared:
    epoch: int
    new: Topology
    span: Group | None  # None: this worker is outside the span (a bystander)
    plan: ReshardPlan | None = None
    runner: ModelRunner | None = None  # the new runner, when this worker's group changes
    timings_ms: dict[str, float] = field(default_factory=dict)


FailureHook = Callable[[str, int], None]


class NodeRuntime:
    def __init__(
        self,
        world: NodeWorld,
        cfg: EngineConfig,
        weights: dict[str, torch.Tensor],
        topology: Topology,
        failure_hook: FailureHook | None = None,
    ) -> None:
        assert topology.num_workers == world.size, "the topology covers the node's workers"
        self.world = world
        self.rank = world.rank
        self.cfg = cfg
        self.weights = weights
        # Read once at boot; a TP change reads nothing from disk.
        self.model_config = loader.load_config(cfg.model_dir)
        self.tokenizer = Tokenizer(cfg.model_dir, read_raw_config(cfg.model_dir))
        self.geometry = KVGeometry(self.model_config.num_layers, self.model_config.num_kv_heads, cfg.block_size)
        self._num_blocks_of = {
            tp: num_kv_blocks_for(self.model_config, tp, cfg.block_size, loader.dtype_of(cfg.dtype),
                                  cfg.num_kv_blocks, cfg.kv_cache_mb)
            for tp in world.levels
        }
        self._failure_hook = failure_hook
        self.topology = topology
        self.epoch = 0
        self._prepared: _Prepared | None = None
        self.engine: Engine | None = None
        self.runner: ModelRunner = self._new_runner(self.group)
        if self.is_leader:
            self.engine = self._new_engine(self.group, self.runner)
        self.last_ack: TransitionAck | None = None

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
        tp_group = self._tp_group(self.group)
        if tp_group.size > 1:
            tp_group.broadcast_bytes(StepPlan(kind=PLAN_KIND_CONTROL, step_id=0, control=cmd.encode()).encode())
        return self.apply(cmd)

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
        """Peer: run the leader's next plan. Returns its kind ("step", "control" or "shutdown")."""
        assert not self.is_leader, "the leader does not follow"
        plan = StepPlan.decode(self._tp_group(self.group).broadcast_bytes(None))
        if plan.kind == PLAN_KIND_STEP:
            self.runner.execute(plan)
        elif plan.kind == PLAN_KIND_CONTROL:
            self.last_ack = self.apply(NodeCommand.decode(plan.control))
        elif plan.kind == PLAN_KIND_NOOP:
            pass
        else:
            assert plan.kind == PLAN_KIND_SHUTDOWN, f"unexpected plan kind {plan.kind}"
        return plan.kind

    # -- the transition -----------------------------------------------------------------------------
    def apply(self, cmd: NodeCommand) -> TransitionAck:
        if cmd.kind == "prepare":
            ack = self.prepare(cmd.epoch, Topology.of(self.world.size, cmd.groups))
        elif cmd.kind == "commit":
            ack = self.commit(cmd.epoch)
        else:
            ack = self.abort(cmd.epoch)
        self.last_ack = ack
        return ack

    def prepare(self, epoch: int, new: Topology) -> TransitionAck:
        t0 = time.perf_counter()
        if epoch <= self.epoch:
            return TransitionAck(epoch, False, "prepare", f"stale epoch {epoch} (committed {self.epoch})")
        if self._prepared is not None:
            return TransitionAck(epoch, False, "prepare", f"epoch {self._prepared.epoch} is in progress")
        old = self.topology
        span = transition_span(old, new)
        if span is None or self.rank not in span.workers:
            self._prepared = _Prepared(epoch, new, None)
            return TransitionAck(epoch, True, "prepare", "not affected", _ms(t0))
        gone, born = changed_groups(old, new)
        my_old, my_new = old.group_of(self.rank), new.group_of(self.rank)
        ok, reason, runner = True, "", None
        try:
            if self._failure_hook is not None:
                self._failure_hook("prepare", epoch)
            if my_new in born:
                runner = self._new_runner(my_new)
        except (RuntimeError, MemoryError, ValueError) as exc:
            # An expected boundary failure (allocation, injected fault): every worker must still take
            # part in the exchange below so that all of them agree to refuse the epoch.
            ok, reason = False, f"worker {self.rank}: {type(exc).__name__}: {exc}"
        local = self._kv_snapshot(my_old, gone)
        parts = self.world.all_gather_bytes(
            msgpack.packb([ok, reason, [_kv_wire(r) for r in local]], use_bin_type=True), span.start, span.tp
        )
        decoded = [msgpack.unpackb(p, raw=False) for p in parts]
        failures = [r for good, r, _ in decoded if not good]
        if failures:
            return TransitionAck(epoch, False, "prepare", "; ".join(failures), _ms(t0))
        requests = [_kv_unwire(w) for _, _, entries in decoded for w in entries]
        plan = plan_prepare(old, new, requests, self.geometry, self._num_blocks_of)
        moved = self._move(plan, my_old, my_new, gone, born, runner)
        self._prepared = _Prepared(epoch, new, span, plan, runner, {"prepare": _ms(t0)})
        return TransitionAck(epoch, True, "prepare", "", _ms(t0), moved)

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
            states = migration.export_states(self.engine) if self.is_leader and my_old in gone else []
            local = self._kv_snapshot(my_old, gone)
            parts = self.world.all_gather_bytes(
                msgpack.packb([states, [_kv_wire(r) for r in local], self._step_id()], use_bin_type=True),
                span.start, span.tp,
            )
            decoded = [msgpack.unpackb(p, raw=False) for p in parts]
            requests = [_kv_unwire(w) for _, entries, _ in decoded for w in entries]
            assert prepared.plan is not None, "a prepared span worker has a plan"
            delta = plan_commit(prepared.plan, requests, self.geometry, self._num_blocks_of)
            moved = self._move(delta, my_old, my_new, gone, born, prepared.runner)
            if my_new in born:
                assert prepared.runner is not None, "a changed worker built its new runner at prepare"
                self.runner = prepared.runner
                self.engine = None
                if my_new.leader == self.rank:
                    engine = self._new_engine(my_new, prepared.runner)
                    engine._step_id = max(step for _, _, step in decoded)
                    placements = {p.request_id: p for p in delta.placements if p.dst_group == my_new}
                    states = [s for st, _, _ in decoded for s in st if s["id"] in placements]
                    migration.install_states(engine, states, placements)
                    engine.check_integrity()
                    self.engine = engine
        self.topology, self.epoch, self._prepared = new, epoch, None
        return TransitionAck(epoch, True, "commit", "", _ms(t0), moved)

    def abort(self, epoch: int) -> TransitionAck:
        prepared = self._prepared
        if prepared is not None and prepared.epoch == epoch:
            self._prepared = None  # the new runner, its cache and views go with it
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
