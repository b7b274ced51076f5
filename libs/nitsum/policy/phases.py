"""Phase assignment: which role (prefill / decode / hybrid) each group of a candidate partition plays.

The scorer (topology.py) tries, for each partition, the variants returned here and keeps the best:
1. all hybrid — chunked prefill mixed with decode; the default, and the only choice for one group;
2. P/D split — when there is queued prefill work and at least two groups: the highest-TP groups prefill
   (prefill is compute-bound and latency-critical: it gains most from TP), the rest decode. If every group
   has the same TP, the first half prefills;
3. further P/D splits of a partition of 4 or more equal-TP groups: a quarter and three quarters of them prefill
   (8 x TP1 of a small model: 2 prefill + 6 decode, 6 + 2).
"""

from __future__ import annotations

from nitsum.topology import Group

Shape = tuple[tuple[int, int], ...]  # ((start, tp), ...)


def all_hybrid(shape: Shape) -> tuple[Group, ...]:
    return tuple(Group(s, k, "hybrid") for s, k in shape)


def prefill_decode_split(shape: Shape) -> tuple[Group, ...] | None:
    if len(shape) < 2:
        return None
    top = max(k for _, k in shape)
    prefill = {i for i, (_, k) in enumerate(shape) if k == top}
    if len(prefill) == len(shape):
        prefill = set(range(len(shape) // 2))
    return tuple(Group(s, k, "prefill" if i in prefill else "decode") for i, (s, k) in enumerate(shape))


def prefill_count_splits(shape: Shape) -> list[tuple[Group, ...]]:
    """Role splits of a partition whose groups all have one TP (4 or more of them): the first n prefill, the
    rest decode, for n = a quarter and three quarters of the groups (half is prefill_decode_split's)."""
    n = len(shape)
    if n < 4 or len({k for _, k in shape}) != 1:
        return []
    counts = sorted({max(n // 4, 1), 3 * n // 4} - {n // 2})
    return [tuple(Group(s, k, "prefill" if i < c else "decode") for i, (s, k) in enumerate(shape)) for c in counts]


def role_variants(shape: Shape, prefill_pending: bool) -> list[tuple[Group, ...]]:
    out = [all_hybrid(shape)]
    if prefill_pending:
        pd = prefill_decode_split(shape)
        if pd is not None:
            out.append(pd)
        out.extend(prefill_count_splits(shape))
    return out
