"""The layouts the adaptive policy scores from a node's current one (topology.py, "candidates"): aligned
partitions a few merges or splits away, the uniform and two-lane layouts, every static layout, and the direction
in which the latency tier's prompts prefill sooner (the fast path's restriction)."""

from __future__ import annotations

from nitsum.policy.baselines import layout_topology, static_layouts
from nitsum.policy.costmodel import CostModel
from nitsum.policy.estimate import NodeLoad
from nitsum.policy.phases import Shape
from nitsum.topology import Topology


def mean_tp(shape: Shape) -> float:
    """Device-weighted mean TP: the TP the average device runs at (the direction of a change)."""
    devices = sum(k for _, k in shape)
    return sum(k * k for _, k in shape) / devices


def _merges(shape: Shape, max_tp: int) -> list[Shape]:
    out = []
    for i in range(len(shape) - 1):
        (s1, k1), (s2, k2) = shape[i], shape[i + 1]
        if k1 == k2 and 2 * k1 <= max_tp and s1 % (2 * k1) == 0 and s2 == s1 + k1:
            out.append(shape[:i] + ((s1, 2 * k1),) + shape[i + 2 :])
    return out


def _splits(shape: Shape, min_tp: int) -> list[Shape]:
    out = []
    for i, (s, k) in enumerate(shape):
        if k // 2 >= min_tp and k >= 2:
            h = k // 2
            out.append(shape[:i] + ((s, h), (s + h, h)) + shape[i + 1 :])
    return out


def _uniform(num_devices: int, k: int) -> Shape:
    return tuple((s, k) for s in range(0, num_devices, k))


def candidate_shapes(current: Shape, num_devices: int, levels: tuple[int, ...], max_steps: int) -> list[Shape]:
    """Partitions considered from `current` (itself excluded), in a deterministic order."""
    min_tp, max_tp = levels[0], levels[-1]
    seen = {current}
    frontier = [current]
    out: list[Shape] = []
    for _ in range(max_steps):
        nxt = []
        for sh in frontier:
            for cand in _merges(sh, max_tp) + _splits(sh, min_tp):
                if cand not in seen:
                    seen.add(cand)
                    nxt.append(cand)
                    out.append(cand)
        frontier = nxt
    half = num_devices // 2
    extra = [_uniform(num_devices, k) for k in levels if num_devices % k == 0]
    if half >= 1:
        for hi in levels:
            for lo in levels:
                if lo < hi <= half and half % hi == 0:
                    extra.append(_uniform(half, hi) + tuple((half + s, k) for s, k in _uniform(half, lo)))
    for cand in extra:
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
    return out


def faster_prefill_direction(cost: CostModel, levels: tuple[int, ...], load: NodeLoad) -> int:
    """The direction of a change (+1: mean TP up, -1: down) in which the latency tier's prompts prefill sooner.
    On a data-sheet roofline that is up (consolidate for a surge); on a measured table it may be down (the
    measured CPU table's TP>1 steps are slower than TP1's)."""
    prompts = [t.prompt_tokens for t in load.tiers if t.latency_sensitive and t.queued]
    prompt = max(prompts, default=1)
    lo, hi = min(levels), max(levels)
    return 1 if cost.prefill_time_ms(hi, prompt) <= cost.prefill_time_ms(lo, prompt) else -1


def static_candidates(num_devices: int, levels: tuple[int, ...]) -> list[Topology]:
    """Every static layout of a node at these TP levels (baselines.static_layouts), as topologies."""
    return [layout_topology(layout) for layout in static_layouts(num_devices, levels)]
