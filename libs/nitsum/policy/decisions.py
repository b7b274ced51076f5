"""Outputs of every policy decision, and the `Policy` protocol that produces them.

A `Policy` is a synchronous, deterministic object: each method takes a read-only `ClusterSnapshot`
(`snapshot.py`) and returns a frozen decision. The coordinator and the simulator call the same methods:

    decide_topology(snap) -> list[TopologyDecision]   one per node; target None = keep what runs
    route(snap, request)  -> RouteDecision             group_id None = cannot place now, keep it queued
    admit(snap, request)  -> AdmissionDecision         admit False carries 429/503 + Retry-After seconds
    shed(snap)            -> list[str]                 request ids to drop now, background tier first
    initial_topology(node) -> Topology                 what to build at boot

`Topology` has a text form used by `nitsum admin set-topology` and in logs:
`[0-3 TP4 hybrid][4-5 TP2 decode][6 TP1 decode][7 TP1 decode]` (a TP1 group may also be written `[6-6 ...]`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from nitsum.policy.snapshot import ROLES, ClusterSnapshot, NodeView, RequestView

TOPOLOGY_PATHS: tuple[str, ...] = ("fast", "scored", "static")


@dataclass(frozen=True, order=True)
class GroupSpec:
    """One group of a target topology: devices [start, start + tp), aligned (start % tp == 0)."""

    start: int
    tp: int
    role: str

    @property
    def end(self) -> int:
        """Last device index (inclusive)."""
        return self.start + self.tp - 1

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.tp))

    def __str__(self) -> str:
        span = f"{self.start}" if self.tp == 1 else f"{self.start}-{self.end}"
        return f"[{span} TP{self.tp} {self.role}]"


_GROUP_RE = re.compile(r"\[\s*(\d+)(?:\s*-\s*(\d+))?\s+TP(\d+)\s+(\w+)\s*\]", re.IGNORECASE)


@dataclass(frozen=True)
class Topology:
    """A partition of one node's devices into aligned groups, ordered by first device."""

    groups: tuple[GroupSpec, ...]

    def __post_init__(self) -> None:
        # Canonical order makes equal partitions compare equal however they were built.
        ordered = tuple(sorted(self.groups, key=lambda g: g.start))
        if ordered != self.groups:
            object.__setattr__(self, "groups", ordered)

    def __str__(self) -> str:
        return "".join(str(g) for g in self.groups)

    @property
    def num_devices(self) -> int:
        return sum(g.tp for g in self.groups)

    def shape(self) -> tuple[tuple[int, int], ...]:
        """The partition without roles: ((start, tp), ...)."""
        return tuple((g.start, g.tp) for g in self.groups)

    def validate(self, num_devices: int, min_tp: int = 1, max_tp: int | None = None) -> None:
        """Raise ValueError unless this is an aligned partition of exactly devices 0..num_devices-1."""
        max_tp = num_devices if max_tp is None else max_tp
        if not self.groups:
            raise ValueError("topology has no groups")
        expected = 0
        for g in self.groups:
            if g.role not in ROLES:
                raise ValueError(f"{g}: role must be one of {', '.join(ROLES)}")
            if g.tp < 1 or g.tp & (g.tp - 1):
                raise ValueError(f"{g}: TP must be a power of two")
            if not min_tp <= g.tp <= max_tp:
                raise ValueError(f"{g}: TP must be between {min_tp} and {max_tp}")
            if g.start % g.tp:
                raise ValueError(f"{g}: not aligned (start must be a multiple of TP)")
            if g.start != expected:
                raise ValueError(f"{g}: expected a group starting at device {expected} (gap or overlap)")
            expected = g.start + g.tp
        if expected != num_devices:
            raise ValueError(f"topology covers devices 0-{expected - 1}, node has {num_devices}")

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Parse '[0-3 TP4 hybrid][4-5 TP2 decode]'; raises ValueError on anything else."""
        stripped = text.strip()
        groups: list[GroupSpec] = []
        pos = 0
        for m in _GROUP_RE.finditer(stripped):
            if stripped[pos : m.start()].strip():
                raise ValueError(f"cannot parse topology {text!r} near {stripped[pos : m.start()]!r}")
            pos = m.end()
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) is not None else start
            tp = int(m.group(3))
            role = m.group(4).lower()
            if end - start + 1 != tp:
                raise ValueError(f"group [{start}-{end}] spans {end - start + 1} devices but says TP{tp}")
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} in {text!r}; roles: {', '.join(ROLES)}")
            groups.append(GroupSpec(start, tp, role))
        if stripped[pos:].strip() or not groups:
            raise ValueError(f"cannot parse topology {text!r}; expected e.g. '[0-3 TP4 hybrid][4-5 TP2 decode]'")
        return cls(tuple(groups))

    @classmethod
    def uniform(cls, num_devices: int, tp: int, role: str = "hybrid") -> Topology:
        """num_devices/tp groups of TP=tp, all with one role."""
        assert num_devices % tp == 0, f"{num_devices} devices do not split into TP{tp} groups"
        return cls(tuple(GroupSpec(s, tp, role) for s in range(0, num_devices, tp)))

    @classmethod
    def of_node(cls, node: NodeView) -> Topology:
        """The topology a node runs now."""
        return cls(tuple(GroupSpec(g.devices[0], g.tp, g.role) for g in node.groups))


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
