"""A node's partition of its devices (workers) into aligned TP groups, each with a role (standard library only).

One `Group` and one `Topology` for every part of the project: the policy and the simulator decide them, the
coordinator sends them, the node runtime serves them and the KV reshard planner moves KV between them.

A group `Group(start, tp, role)` is workers [start, start + tp), aligned (start % tp == 0), led by `start`.
Its `span` (start, tp) is what KV and communicators depend on; its role ("prefill", "decode" or "hybrid") only
says what its engine runs. Text form (`nitsum admin set-topology`, logs):
`[0-3 TP4 hybrid][4-5 TP2 decode][6 TP1 decode][7 TP1 decode]` (a TP1 group may also be written `[6-6 ...]`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROLES: tuple[str, ...] = ("prefill", "decode", "hybrid")


@dataclass(frozen=True, order=True)
class Group:
    """Workers (devices) [start, start + tp) serve as one TP=tp group; `start` (the lowest rank) leads it."""

    start: int
    tp: int
    role: str = "hybrid"

    @property
    def end(self) -> int:
        """Last device index (inclusive)."""
        return self.start + self.tp - 1

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.tp))

    @property
    def workers(self) -> range:
        return range(self.start, self.start + self.tp)

    @property
    def leader(self) -> int:
        return self.start

    @property
    def span(self) -> tuple[int, int]:
        """(start, tp): the group without its role (what its KV and communicator depend on)."""
        return (self.start, self.tp)

    def __str__(self) -> str:
        span = f"{self.start}" if self.tp == 1 else f"{self.start}-{self.end}"
        return f"[{span} TP{self.tp} {self.role}]"


_GROUP_RE = re.compile(r"\[\s*(\d+)(?:\s*-\s*(\d+))?\s+TP(\d+)\s+(\w+)\s*\]", re.IGNORECASE)


@dataclass(frozen=True)
class Topology:
    """A partition of one node's devices into aligned groups, ordered by first device. Built from groups it
    checks nothing (`validate` does); `of` refuses anything but a partition."""

    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        # Canonical order makes equal partitions compare equal however they were built.
        object.__setattr__(self, "groups", tuple(sorted(self.groups, key=lambda g: g.span)))

    def __str__(self) -> str:
        return "".join(str(g) for g in self.groups)

    @property
    def num_devices(self) -> int:
        return sum(g.tp for g in self.groups)

    @property
    def num_workers(self) -> int:
        """The node's workers: one per device (`num_devices`)."""
        return self.num_devices

    def shape(self) -> tuple[tuple[int, int], ...]:
        """The partition without roles: ((start, tp), ...)."""
        return tuple(g.span for g in self.groups)

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
        groups: list[Group] = []
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
            groups.append(Group(start, tp, role))
        if stripped[pos:].strip() or not groups:
            raise ValueError(f"cannot parse topology {text!r}; expected e.g. '[0-3 TP4 hybrid][4-5 TP2 decode]'")
        return cls(tuple(groups))

    @classmethod
    def uniform(cls, num_devices: int, tp: int, role: str = "hybrid") -> Topology:
        """num_devices/tp groups of TP=tp, all with one role."""
        assert num_devices % tp == 0, f"{num_devices} devices do not split into TP{tp} groups"
        return cls(tuple(Group(s, tp, role) for s in range(0, num_devices, tp)))

    @classmethod
    def of(cls, num_workers: int, pairs: Iterable[Sequence[int]], roles: Sequence[str] | None = None) -> Topology:
        """From (start, tp) pairs (and their roles, hybrid when None or empty), e.g. `Topology.of(4, [(0, 2),
        (2, 2)])`; raises ValueError unless they are an aligned partition of workers 0..num_workers-1."""
        pairs = [(int(s), int(t)) for s, t in pairs]
        if roles and len(roles) != len(pairs):
            raise ValueError(f"{len(roles)} roles for {len(pairs)} groups")
        names = list(roles) if roles else ["hybrid"] * len(pairs)
        topology = cls(tuple(Group(s, t, r) for (s, t), r in zip(pairs, names)))
        covered: list[int] = []
        for g in topology.groups:
            if g.tp < 1 or g.tp & (g.tp - 1):
                raise ValueError(f"group {g}: TP must be a power of two")
            if g.start % g.tp:
                raise ValueError(f"group {g}: not aligned (start must be divisible by TP)")
            covered.extend(g.workers)
        if covered != list(range(num_workers)):
            shown = "".join(str(g) for g in topology.groups)
            raise ValueError(f"groups {shown} do not partition workers 0..{num_workers - 1}")
        return topology

    def group_of(self, worker: int) -> Group:
        for g in self.groups:
            if worker in g.workers:
                return g
        raise KeyError(f"worker {worker} outside the node")

    def pairs(self) -> list[list[int]]:
        return [[g.start, g.tp] for g in self.groups]
