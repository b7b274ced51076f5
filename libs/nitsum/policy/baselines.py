"""Baseline policies behind the same `Policy` interface (ALGORITHMS.md §1.5), for comparisons.

- `StaticTP(k)`       — `static-tp:K`: every node split into D/k replicas of TP=k, all hybrid (chunked
                        prefill + decode). Never changes.
- `Disagg(p, d)`      — `disagg[:P/D]`: DistServe-like fixed P/D disaggregation. The first half of the
                        devices form prefill groups of TP=p, the second half decode groups of TP=d
                        (defaults: p = half the node capped at max_tp, d = max(min_tp, 2) capped at p).
- `StaticHybrid(h, l)` — `static-hybrid[:H/L]`: a fixed two-lane layout. The first half of the devices
                        form hybrid groups of TP=h (latency lane: routing sends latency-sensitive requests to
                        the highest TP), the second half hybrid groups of TP=l (throughput lane).
                        Defaults: h = half the node capped at max_tp, l = min_tp.

All of them route by slack, admit and shed exactly like the adaptive policy (base.py), so a comparison
isolates the topology decision. If a node runs another layout (after a policy switch), they restore theirs.
"""

from __future__ import annotations

from nitsum.policy.base import BasePolicy, PolicyConfig
from nitsum.policy.decisions import TopologyDecision
from nitsum.policy.snapshot import ClusterSnapshot, NodeView
from nitsum.topology import Group, Topology


def _check_level(node: NodeView, tp: int, what: str) -> None:
    if tp not in node.allowed_tp_levels():
        raise ValueError(
            f"{what}: TP{tp} is not an allowed level on node {node.node_id} "
            f"(allowed: {', '.join(map(str, node.allowed_tp_levels()))})"
        )


def _lane(start: int, num_devices: int, tp: int, role: str) -> list[Group]:
    assert num_devices % tp == 0 and start % tp == 0, f"lane of {num_devices} devices at {start} cannot be TP{tp}"
    return [Group(s, tp, role) for s in range(start, start + num_devices, tp)]


def _half_tp(node: NodeView) -> int:
    """Largest allowed TP that fits in half the node (at least min_tp)."""
    half = max(node.num_devices // 2, 1)
    fitting = [k for k in node.allowed_tp_levels() if k <= half]
    return max(fitting) if fitting else node.min_tp


class StaticTP(BasePolicy):
    def __init__(self, tp: int, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        if tp < 1 or tp & (tp - 1):
            raise ValueError(f"static-tp:{tp}: TP must be a power of two >= 1")
        self.tp = tp
        self.name = f"static-tp:{tp}"

    def initial_topology(self, node: NodeView) -> Topology:
        _check_level(node, self.tp, self.name)
        if node.num_devices % self.tp:
            raise ValueError(
                f"{self.name}: node {node.node_id} has {node.num_devices} devices, not a multiple of {self.tp}"
            )
        return Topology.uniform(node.num_devices, self.tp, "hybrid")

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        return self._keep_static(snap)


class Disagg(BasePolicy):
    def __init__(
        self, prefill_tp: int | None = None, decode_tp: int | None = None, config: PolicyConfig | None = None
    ) -> None:
        super().__init__(config)
        self.prefill_tp = prefill_tp
        self.decode_tp = decode_tp
        self.name = "disagg" if prefill_tp is None else f"disagg:{prefill_tp}/{decode_tp}"

    def initial_topology(self, node: NodeView) -> Topology:
        if node.num_devices < 2:
            # One device cannot be split into a prefill and a decode side: serve both phases on it.
            return Topology.uniform(node.num_devices, node.num_devices, "hybrid")
        half = node.num_devices // 2
        p = self.prefill_tp if self.prefill_tp is not None else _half_tp(node)
        d = self.decode_tp if self.decode_tp is not None else min(max(node.min_tp, 2), p)
        _check_level(node, p, f"{self.name} prefill")
        _check_level(node, d, f"{self.name} decode")
        if half % p or half % d:
            raise ValueError(
                f"{self.name}: half of node {node.node_id} ({half} devices) does not split into "
                f"TP{p} prefill and TP{d} decode groups"
            )
        return Topology(tuple(_lane(0, half, p, "prefill") + _lane(half, node.num_devices - half, d, "decode")))

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        return self._keep_static(snap)


class StaticHybrid(BasePolicy):
    def __init__(
        self, high_tp: int | None = None, low_tp: int | None = None, config: PolicyConfig | None = None
    ) -> None:
        super().__init__(config)
        self.high_tp = high_tp
        self.low_tp = low_tp
        self.name = "static-hybrid" if high_tp is None else f"static-hybrid:{high_tp}/{low_tp}"

    def initial_topology(self, node: NodeView) -> Topology:
        if node.num_devices < 2:
            return Topology.uniform(node.num_devices, node.num_devices, "hybrid")
        half = node.num_devices // 2
        h = self.high_tp if self.high_tp is not None else _half_tp(node)
        low = self.low_tp if self.low_tp is not None else node.min_tp
        _check_level(node, h, f"{self.name} high lane")
        _check_level(node, low, f"{self.name} low lane")
        if half % h or half % low:
            raise ValueError(
                f"{self.name}: half of node {node.node_id} ({half} devices) does not split into "
                f"TP{h} and TP{low} groups"
            )
        return Topology(tuple(_lane(0, half, h, "hybrid") + _lane(half, node.num_devices - half, low, "hybrid")))

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        return self._keep_static(snap)


_ROLE_OF = {"": "hybrid", "h": "hybrid", "p": "prefill", "d": "decode"}
_SUFFIX = {"hybrid": "", "prefill": "p", "decode": "d"}


def parse_layout(text: str) -> tuple[tuple[int, str], ...]:
    """`4+2+2`, `4p+2d+2d`: groups as TP[role], role h (hybrid, the default), p (prefill) or d (decode)."""
    out = []
    for part in text.split("+"):
        part = part.strip().lower()
        digits = part.rstrip("hpd")
        role = _ROLE_OF[part[len(digits) :]] if len(part) - len(digits) <= 1 else None
        if not digits.isdigit() or role is None:
            raise ValueError(f"bad layout {text!r}: {part!r} is not TP[h|p|d]")
        tp = int(digits)
        if tp < 1 or tp & (tp - 1):
            raise ValueError(f"bad layout {text!r}: TP {tp} must be a power of two >= 1")
        out.append((tp, role))
    return tuple(out)


def layout_name(groups: tuple[tuple[int, str], ...]) -> str:
    return "+".join(f"{tp}{_SUFFIX[role]}" for tp, role in groups)


def layout_topology(groups: tuple[tuple[int, str], ...]) -> Topology:
    """Groups placed largest TP first (so every group is aligned), in the given order within a TP."""
    placed, start = [], 0
    for tp, role in sorted(groups, key=lambda g: -g[0]):
        placed.append(Group(start, tp, role))
        start += tp
    return Topology(tuple(placed))


def static_layouts(num_devices: int, levels: tuple[int, ...]) -> list[tuple[tuple[int, str], ...]]:
    """Every static layout of a node: each partition of its devices into aligned groups at the allowed levels,
    all hybrid; and every P/D split with prefill groups of one size and decode groups of one size (any
    number of each, at least one of each). Largest groups first."""

    def partitions(n: int, most: int) -> list[tuple[int, ...]]:
        if n == 0:
            return [()]
        return [(k,) + rest for k in sorted(levels, reverse=True) if k <= min(n, most) for rest in partitions(n - k, k)]

    out = [tuple((k, "hybrid") for k in part) for part in partitions(num_devices, num_devices)]
    for p in levels:
        for d in levels:
            for n_p in range(1, num_devices // p + 1):
                rest = num_devices - n_p * p
                if rest <= 0 or rest % d:
                    continue
                out.append(tuple([(p, "prefill")] * n_p + [(d, "decode")] * (rest // d)))
    return out


class StaticLayout(BasePolicy):
    """`static:<layout>` (e.g. `static:4+2+2`, `static:4p+2d+2d`): any fixed layout, never changed."""

    def __init__(self, layout: str, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.groups = parse_layout(layout)
        self.name = f"static:{layout_name(self.groups)}"

    def initial_topology(self, node: NodeView) -> Topology:
        for tp, _ in self.groups:
            _check_level(node, tp, self.name)
        if sum(tp for tp, _ in self.groups) != node.num_devices:
            raise ValueError(
                f"{self.name}: {sum(tp for tp, _ in self.groups)} devices, node {node.node_id} has {node.num_devices}"
            )
        return layout_topology(self.groups)

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        return self._keep_static(snap)
