"""Outputs of every policy decision, and the `Policy` protocol that produces them.

A `Policy` is a synchronous, deterministic object: each method takes a read-only `ClusterSnapshot`
(`snapshot.py`) and returns a frozen decision. The coordinator and the simulator call the same methods:

    decide_topology(snap) -> list[TopologyDecision]   one per node; target None = keep what runs
    route(snap, request)  -> RouteDecision             group_id None = cannot place now, keep it queued
    admit(snap, request)  -> AdmissionDecision         admit False carries 429/503 + Retry-After seconds
    shed(snap)            -> list[str]                 request ids to drop now, background tier first
    initial_topology(node) -> Topology                 what to build at boot

`Topology` (`nitsum.topology`, with its text form) is what a topology decision targets; `node_topology(node)`
is the one a node runs now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from nitsum.policy.snapshot import ClusterSnapshot, NodeView, RequestView
from nitsum.topology import Group, Topology

TOPOLOGY_PATHS: tuple[str, ...] = ("fast", "scored", "static")


def node_topology(node: NodeView) -> Topology:
    """The topology a node runs now."""
    return Topology(tuple(Group(g.devices[0], g.tp, g.role) for g in node.groups))


@dataclass(frozen=True)
class TopologyDecision:
    node_id: str
    target: Topology | None  # None: keep the current topology
    reason: str
    score_gain: float = 0.0  # estimated weighted-goodput gain of target over current (0 when kept)
    path: str = "static"  # "fast" | "scored" | "static"


@dataclass(frozen=True)
class RouteDecision:
    request_id: str
    group_id: str | None  # None: no group can take it now; keep it queued
    reason: str
    slack_ms: float = 0.0  # estimated slack on the chosen group (negative: it will miss)


@dataclass(frozen=True)
class AdmissionDecision:
    request_id: str
    admit: bool
    status: int = 200  # 200 when admitted; 429 (over a queue bound, or hopeless) or 503 (no healthy group)
    retry_after_s: float = 0.0
    reason: str = ""


@runtime_checkable
class Policy(Protocol):
    """What the coordinator and the simulator call. Implementations are pure and deterministic."""

    name: str

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]: ...

    def route(self, snap: ClusterSnapshot, request: RequestView) -> RouteDecision: ...

    def admit(self, snap: ClusterSnapshot, request: RequestView) -> AdmissionDecision: ...

    def shed(self, snap: ClusterSnapshot) -> list[str]: ...

    def initial_topology(self, node: NodeView) -> Topology: ...
