"""The admin plane: JSON over NATS under `<ns>.admin.>` (the stock `nats req nitsum.admin.status ''` works).

Every command may carry an `id`; a repeated id gets the first answer again (idempotent retries).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from nitsum.wire.subjects import ADMIN_COMMANDS

MAX_REMEMBERED_IDS = 1024
ROLES = ("prefill", "decode", "hybrid")


class AdminPlane:
    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self._answers: OrderedDict[str, dict] = OrderedDict()

    async def subscribe(self) -> None:
        bus = self.coordinator.bus
        for command in ADMIN_COMMANDS:
            await bus.subscribe_json(bus.subjects.admin(command), self._handler(command))

    def _handler(self, command: str):
        method = getattr(self, "cmd_" + command.replace("-", "_"))

        async def handle(body: dict, _delivery) -> dict:
            command_id = body.get("id")
            if command_id is not None and not isinstance(command_id, str):
                return _error("bad_request", "'id' must be a string")
            if command_id and command_id in self._answers:
                return self._answers[command_id]
            answer = await method(body)
            if command_id:
                self._answers[command_id] = answer
                while len(self._answers) > MAX_REMEMBERED_IDS:
                    self._answers.popitem(last=False)
            return answer

        return handle

    async def cmd_status(self, _body: dict) -> dict:
        c = self.coordinator
        workers = []
        groups: dict[str, dict[str, Any]] = {}
        for worker_id, record in sorted(c.members.workers.items()):
            s = record.stats
            workers.append(
                {
                    "worker_id": worker_id,
                    "node_id": s.node_id,
                    "device_index": s.device_index,
                    "device": s.device,
                    "state": "draining" if record.draining_by_admin and s.state == "ready" else s.state,
                    "role": s.role,
                    "group_id": s.group_id,
                    "tp": s.tp,
                    "running": len(record.inflight()),
                    "waiting": s.num_waiting,
                    "kv_blocks_free": s.kv_blocks_free,
                    "kv_blocks_total": s.kv_blocks_total,
                    "model": s.model_name,
                    "leader": s.leader,
                    "epoch": s.epoch,
                    "in_world": s.in_world,
                    "generation": s.generation,
                    # who computed what: prompt tokens computed, KV hand-offs adopted, transfers failed
                    "prefill_tokens_computed": s.num_prefill_tokens_computed,
                    "kv_imported": s.num_kv_imported,
                    "transfer_failures": s.num_transfer_failures,
                }
            )
            group = groups.setdefault(
                s.group_id, {"group_id": s.group_id, "tp": s.tp, "role": s.role, "node_id": s.node_id, "members": []}
            )
            group["members"].append(worker_id)
        depth = c.members.outstanding_by_tier()
        return {
            "ok": True,
            "policy": c.policy_spec,
            "epoch": c.transitions.epoch,  # the latest topology epoch this coordinator started
            "workers": workers,
            "groups": list(groups.values()),
            "queue_depth": {tier: depth.get(tier, 0) for tier in ("interactive", "background")},
            "requests_in_flight": len(c.members.requests),
            "last_decisions": c.last_decisions,
            "transitions": c.transitions.history[-5:],
            "reforms": c.reforms.history[-5:],
            "pinned_nodes": sorted(c.pinned_nodes),
        }

    async def cmd_set_policy(self, body: dict) -> dict:
        spec = body.get("policy")
        if not isinstance(spec, str) or not spec:
            return _error("bad_request", "set-policy needs 'policy': adaptive | static-tp:K | disagg | static-hybrid")
        previous = self.coordinator.policy_spec
        problem = self.coordinator.set_policy(spec)
        if problem:
            return _error("bad_policy", problem)
        return {"ok": True, "policy": spec, "previous": previous}

    async def cmd_set_topology(self, body: dict) -> dict:
        topology = body.get("topology")
        if not isinstance(topology, str) or not topology:
            return _error(
                "bad_request", "set-topology needs 'topology', e.g. '[0-1 TP2 hybrid][2 TP1 decode][3 TP1 decode]'"
            )
        from nitsum.topology import Topology
        from nitsum_services.coordinator.transition import TransitionError

        node_id = body.get("node_id", "node0")
        if not isinstance(node_id, str):
            return _error("bad_request", "'node_id' must be a string")
        try:
            target = Topology.parse(topology)
        except (ValueError, AssertionError) as exc:
            return _error("bad_topology", f"cannot parse {topology!r}: {exc}")
        try:
            report = await self.coordinator.transitions.apply(node_id, target, "admin set-topology")
        except TransitionError as exc:
            return _error("cannot_change", str(exc))
        # A topology set by hand holds: the policy stops changing this node until the next set-policy.
        self.coordinator.pinned_nodes.add(node_id)
        if not report["ok"]:
            return {
                "ok": False,
                "error": {"code": "transition_failed", "message": report.get("error", "")},
                "transition": report,
            }
        return {"ok": True, "transition": report}

    async def cmd_drain(self, body: dict) -> dict:
        worker_id = body.get("worker_id")
        record = self.coordinator.members.workers.get(worker_id) if isinstance(worker_id, str) else None
        if record is None:
            return _error("unknown_worker", f"no worker {worker_id!r}")
        undo = body.get("undo", False) is True
        record.draining_by_admin = not undo
        return {"ok": True, "worker_id": worker_id, "draining": record.draining_by_admin}

    async def cmd_role(self, body: dict) -> dict:
        worker_id, role = body.get("worker_id"), body.get("role")
        if role not in ROLES:
            return _error("bad_request", f"'role' must be one of {', '.join(ROLES)}")
        if not isinstance(worker_id, str) or worker_id not in self.coordinator.members.workers:
            return _error("unknown_worker", f"no worker {worker_id!r}")
        from nitsum.bus import BusError
        from nitsum.wire.messages import RoleChange, TopologyAck

        bus = self.coordinator.bus
        try:
            ack = await bus.request(
                bus.subjects.worker_control(worker_id), RoleChange(worker_id, role), 10.0, expected=TopologyAck
            )
        except BusError as exc:
            return _error("worker_unreachable", f"{worker_id}: {exc}")
        if not ack.ok:
            return _error("cannot_change", ack.reason)
        return {"ok": True, "worker_id": worker_id, "role": role, "change": ack.reason}

    async def cmd_reform_node(self, body: dict) -> dict:
        """Re-form a node's world now (what the coordinator also does by itself): every worker at TP=1 joins
        a new world generation, keeping its engine and requests."""
        from nitsum_services.coordinator.reform import ReformError

        node_id = body.get("node_id", "node0")
        if not isinstance(node_id, str) or not node_id:
            return _error("bad_request", "'node_id' must be a non-empty string")
        try:
            report = await self.coordinator.reforms.reform(node_id, "admin reform-node")
        except ReformError as exc:
            return _error("cannot_reform", str(exc))
        if not report["ok"]:
            return {"ok": False, "error": {"code": "reform_failed", "message": report["error"]}, "reform": report}
        return {"ok": True, "reform": report}


def _error(code: str, message: str) -> dict:
    return {"ok": False, "error": {"code": code, "message": message}}
