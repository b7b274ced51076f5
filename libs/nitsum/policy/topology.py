"""Adaptive TP policy (ALGORITHMS.md §1.5). Work in progress: the scored/fast-path engine lands next;
until then AdaptivePolicy keeps the boot layout (one TP=max_tp hybrid group per node)."""

from __future__ import annotations

from nitsum.policy.base import BasePolicy, PolicyConfig
from nitsum.policy.decisions import GroupSpec, Topology, TopologyDecision
from nitsum.policy.snapshot import ClusterSnapshot, NodeView

__all__ = ["AdaptivePolicy", "GroupSpec", "Topology"]


class AdaptivePolicy(BasePolicy):
    name = "adaptive"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)

    def initial_topology(self, node: NodeView) -> Topology:
        return Topology.uniform(node.num_devices, node.max_tp, "hybrid")

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        return [TopologyDecision(n.node_id, None, "adaptive: not implemented yet, keep", 0.0, "static") for n in snap.nodes]
