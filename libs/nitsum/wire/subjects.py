"""Every NATS subject nitsum uses. No service writes a subject string of its own.

All subjects live under one namespace (`NITSUM_NAMESPACE`, default `nitsum`) so that several meshes can
share one NATS cluster. Admin subjects are JSON (so the stock `nats` CLI works); every other subject
carries msgpack frames from nitsum.wire.codec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

ADMIN_COMMANDS = ("status", "set-policy", "set-topology", "drain", "role", "reform-node")


def check_token(value: str, what: str) -> str:
    """A subject token must not contain dots, wildcards or spaces (it would change the subject's meaning)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token (letters, digits, '_' and '-' only)")
    return value


@dataclass(frozen=True)
class Subjects:
    namespace: str = "nitsum"

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    # request path
    @property
    def submit(self) -> str:
        """gateway → coordinator (request/reply): SubmitRequest → SubmitReply | ErrorReply."""
        return f"{self.namespace}.req.submit"

    def worker_run(self, worker_id: str) -> str:
        """coordinator → one group leader (request/reply): RunRequest → RunAck."""
        return f"{self.namespace}.worker.{check_token(worker_id, 'worker id')}.run"

    def worker_control(self, worker_id: str) -> str:
        """coordinator → one worker: topology Prepare/Commit/Abort, NodeReform, RoleChange (request/reply → TopologyAck)."""
        return f"{self.namespace}.worker.{check_token(worker_id, 'worker id')}.control"

    def worker_kv(self, worker_id: str) -> str:
        """worker → worker (request/reply): KvLayer → KvAck (P/D hand-off, stage-1 prefix blocks)."""
        return f"{self.namespace}.worker.{check_token(worker_id, 'worker id')}.kv"

    def worker_kv_fetch(self, worker_id: str) -> str:
        """worker → the worker holding a prefix (request/reply): KvFetch → KvFetchReply."""
        return f"{self.namespace}.worker.{check_token(worker_id, 'worker id')}.kvfetch"

    def worker_handoff(self, worker_id: str) -> str:
        """a node-world prefill leader → a decode leader of its world (request/reply): NodeHandoffOffer →
        NodeHandoffReady, NodeHandoffCommit → TopologyAck (the KV itself moves cache to cache)."""
        return f"{self.namespace}.worker.{check_token(worker_id, 'worker id')}.handoff"

    def stream(self, request_id: str, worker_id: str = "*") -> str:
        """worker → gateway: TokenChunk frames of one request, `<ns>.stream.<worker id>.<request id>`. A worker
        publishes under its own id (with per-worker NATS identities it may publish nowhere else), so the
        gateway knows which worker sent each frame; the default `*` is the gateway's subscription."""
        worker = worker_id if worker_id == "*" else check_token(worker_id, "worker id")
        return f"{self.namespace}.stream.{worker}.{check_token(request_id, 'request id')}"

    def stream_sender(self, subject: str) -> str:
        """The worker id in a stream subject (what NATS let that worker publish)."""
        parts = subject.split(".")
        return parts[2] if len(parts) == 4 and parts[1] == "stream" else ""

    def gateway_frames(self, gateway_id: str, worker_id: str = "*") -> str:
        """worker → one gateway: TokenBatch frames (one per engine step, every request of that gateway),
        `<ns>.stream.<worker id>.gw.<gateway id>` -- five tokens, so no per-request subscription (four) matches
        it, and under the worker's own `<ns>.stream.<id>.>` permission. A gateway puts this subject (with `*`)
        in SubmitRequest.stream_subject; the default `*` is the gateway's subscription."""
        worker = worker_id if worker_id == "*" else check_token(worker_id, "worker id")
        return f"{self.namespace}.stream.{worker}.gw.{check_token(gateway_id, 'gateway id')}"

    def frames_gateway(self, subject: str) -> str:
        """The gateway id of a `gateway_frames` subject ("" for anything else, e.g. a per-request stream)."""
        parts = subject.split(".")
        if len(parts) == 5 and parts[0] == self.namespace and parts[1] == "stream" and parts[3] == "gw":
            return parts[4] if _TOKEN.match(parts[4]) else ""
        return ""

    @property
    def abort(self) -> str:
        """anyone → all workers (broadcast): AbortRequest."""
        return f"{self.namespace}.req.abort"

    # membership
    @property
    def worker_stats(self) -> str:
        """workers → coordinator: WorkerStats heartbeats."""
        return f"{self.namespace}.stats.worker"

    @property
    def worker_lost(self) -> str:
        """coordinator → gateways: WorkerLost."""
        return f"{self.namespace}.event.worker_lost"

    @property
    def coordinator_up(self) -> str:
        """coordinator → workers (broadcast, empty payload): a (re)started coordinator asks for fresh stats."""
        return f"{self.namespace}.event.coordinator_up"

    # flows
    @property
    def flow_submit(self) -> str:
        """transfer agents → flow-scheduler: FlowSubmit (request/reply → FlowPermit)."""
        return f"{self.namespace}.flow.submit"

    @property
    def flow_done(self) -> str:
        """transfer agents → flow-scheduler: FlowCompletion."""
        return f"{self.namespace}.flow.done"

    @property
    def flow_progress(self) -> str:
        """prefill workers → flow-scheduler: LayerProgress at each layer boundary of a unit."""
        return f"{self.namespace}.flow.progress"

    @property
    def flow_pruned(self) -> str:
        """flow-scheduler → gateways and coordinator: FlowPruned (a request's flows were pruned; retry it)."""
        return f"{self.namespace}.flow.pruned"

    def flow_permit(self, worker_id: str) -> str:
        """flow-scheduler → one transfer agent: FlowPermit updates (promotions)."""
        return f"{self.namespace}.flow.permit.{check_token(worker_id, 'worker id')}"

    # admin (JSON)
    def admin(self, command: str) -> str:
        if command not in ADMIN_COMMANDS:
            raise ValueError(f"unknown admin command {command!r}; known: {', '.join(ADMIN_COMMANDS)}")
        return f"{self.namespace}.admin.{command}"

    @property
    def admin_wildcard(self) -> str:
        return f"{self.namespace}.admin.>"

    # health probes used by /ready
    @property
    def ping(self) -> str:
        return f"{self.namespace}.ping"
