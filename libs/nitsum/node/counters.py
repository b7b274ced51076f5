"""What this worker's transitions moved and were planned to move, by path (metrics, tests, diagnostics)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

KV_HISTORY = 4096  # entries of kv_pairs / kv_tos kept


@dataclass
class KvCounters:
    bytes_by_path: dict[str, int] = field(default_factory=lambda: {"shm": 0, "tcp": 0, "p2p": 0})  # KV bytes
    # this worker moved into other workers' caches, and what the agreed plans gave it to move
    planned_by_path: dict[str, int] = field(default_factory=lambda: {"shm": 0, "tcp": 0, "p2p": 0})
    # (epoch, src, dst, path, bytes) of the migration flows of agreed plans with this worker as source, and the
    # IP_TOS of the TCP KV links it opened: the latest ones.
    kv_pairs: deque[tuple[int, int, int, str, int]] = field(default_factory=lambda: deque(maxlen=KV_HISTORY))
    kv_tos: deque[int] = field(default_factory=lambda: deque(maxlen=KV_HISTORY))

    def moved(self, by_path: dict[str, int]) -> None:
        for path, n in by_path.items():
            self.bytes_by_path[path] += n

    def planned(self, node, epoch: int, flows: list[tuple[int, int, int]]) -> None:
        """What an agreed plan gives this worker to move, by pair and path (local copies are no path)."""
        for src, dst, size in flows:
            path = node.kv_path_of(src, dst)
            if src == node.rank and path != "local":
                self.planned_by_path[path] += size
                self.kv_pairs.append((epoch, src, dst, path, size))
