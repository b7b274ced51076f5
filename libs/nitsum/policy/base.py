"""What every policy shares: its frozen config, cost models per device kind, routing, admission, shedding.

Subclasses (baselines.py, topology.py) supply `name`, `initial_topology` and `decide_topology`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nitsum.policy import admission, routing
from nitsum.policy.costmodel import CostModel, DeviceSpec, ModelSpec, device_spec, model_spec
from nitsum.policy.decisions import AdmissionDecision, RouteDecision, TopologyDecision, node_topology
from nitsum.policy.snapshot import ClusterSnapshot, GroupView, NodeView, RequestView
from nitsum.policy.steptable import DeviceStepTable
from nitsum.topology import Topology


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of every policy. Built once (env + CLI by the caller), never mutated."""

    model: ModelSpec = field(default_factory=lambda: model_spec("tiny"))
    # Device tables by kind; kinds not listed fall back to costmodel.device_spec(kind).
    devices: tuple[tuple[str, DeviceSpec], ...] = ()
    # Measured step-time tables by kind (steptable.py); a kind listed here prices steps from its table.
    step_tables: tuple[tuple[str, DeviceStepTable], ...] = ()
    block_size_tokens: int = 16
    epoch_ms: float = 1000.0  # NITSUM_RECONFIG_INTERVAL_MS
    # A request is latency-sensitive (routed to high TP) when its TTFT target is at most this.
    latency_sensitive_ttft_ms: float = 1000.0
    queue_bounds: tuple[tuple[str, int], ...] = (("interactive", 256), ("background", 4096))
    chunk_tokens: int = 512  # chunked-prefill size on hybrid groups
    prefill_batch_tokens: int = 8192  # tokens per step on prefill-role groups (head-of-line delay estimate)
    # Adaptive policy (topology.py):
    horizon_ms: float = 5000.0  # goodput is estimated over this much future
    reconfig_lambda_per_ms: float = 0.05  # weighted requests lost per ms of reconfiguration cost
    hysteresis_margin: float = 5.0  # switch only when the gain exceeds this (weighted requests)
    # ... and exceeds this fraction of the current layout's score: with arrival streams in the estimate the
    # scores grow with the load, and a fixed margin alone let noise in the measured rates flip the layout.
    hysteresis_fraction: float = 0.1
    min_dwell_ms: float = 3000.0  # no change sooner than this after the last one
    # With measured arrivals: no change until this long after the arrival stream last shifted (or measuring
    # began): the sliding window (5 s in the simulator and the coordinator) must hold the new load only.
    shift_settle_ms: float = 10_000.0
    # A change made before a detected shift of the stream was chosen for the old load: once the window (5 s in
    # both callers) has had this long past the shift, the node may revise it inside the settle time, once, and
    # that revision is the change this load allows (rule 25; not the boot choice, not once the stream stopped).
    shift_revise_ms: float = 5000.0
    max_steps: int = 2  # candidates: at most this many merge/split steps from the current topology
    interactive_backlog_threshold: int = 1  # fast path: queued latency-sensitive requests to call it a surge

    def __post_init__(self) -> None:
        assert self.block_size_tokens > 0, "block_size_tokens must be > 0"
        assert self.epoch_ms > 0, "epoch_ms must be > 0"
        assert self.horizon_ms > 0, "horizon_ms must be > 0"
        assert self.max_steps >= 1, "max_steps must be >= 1"

    @property
    def queue_bound_map(self) -> dict[str, int]:
        return dict(self.queue_bounds)


class BasePolicy:
    name = "base"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._devices = dict(self.config.devices)
        self._costs: dict[str, CostModel] = {}  # memo only: cost models are pure
        self._bounds = self.config.queue_bound_map

    # -- helpers ------------------------------------------------------------------------------------------
    def cost_for(self, node: NodeView) -> CostModel:
        cm = self._costs.get(node.device_kind)
        if cm is None:
            dev = self._devices.get(node.device_kind) or device_spec(node.device_kind)
            steps = dict(self.config.step_tables).get(node.device_kind)
            cm = self._costs[node.device_kind] = CostModel(self.config.model, dev, steps=steps)
        return cm

    def latency_sensitive(self, r: RequestView) -> bool:
        return r.ttft_ms <= self.config.latency_sensitive_ttft_ms

    def allowed_group(self, r: RequestView, g: GroupView) -> bool:
        """Baselines that dedicate groups to tiers override this."""
        return True

    # -- Policy protocol ----------------------------------------------------------------------------------
    def initial_topology(self, node: NodeView) -> Topology:
        raise NotImplementedError

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        raise NotImplementedError

    def route(self, snap: ClusterSnapshot, request: RequestView) -> RouteDecision:
        return routing.route_by_slack(
            snap,
            request,
            self.cost_for,
            self.latency_sensitive(request),
            self.config.block_size_tokens,
            allowed_groups=lambda g: self.allowed_group(request, g),
        )

    def admit(self, snap: ClusterSnapshot, request: RequestView) -> AdmissionDecision:
        return admission.admit(snap, request, self.cost_for, self._bounds, self.config.epoch_ms)

    def shed(self, snap: ClusterSnapshot) -> list[str]:
        return admission.shed(snap, self.cost_for, self._bounds)

    def _keep_static(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        """Static layouts: restore the layout if the node runs anything else, otherwise keep."""
        out = []
        for node in snap.nodes:
            try:
                want = self.initial_topology(node)
            except ValueError as exc:
                # The node as seen now cannot hold the layout: at boot, before all its workers registered (one
                # known device allows TP1 only), or with a device lost. Nothing to do until it can.
                out.append(
                    TopologyDecision(node.node_id, None, f"{self.name}: cannot lay out now: {exc}", 0.0, "static")
                )
                continue
            have = node_topology(node)
            if have == want:
                out.append(TopologyDecision(node.node_id, None, f"{self.name}: static layout", 0.0, "static"))
            else:
                out.append(TopologyDecision(node.node_id, want, f"{self.name}: restore static layout", 0.0, "static"))
        return out
