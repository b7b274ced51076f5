"""Chained block hashes for automatic prefix caching.

A full block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole
prefixes. The hash is SHA-256 based (not Python's salted `hash`), so it is identical across processes and
machines: it is also the key that a stage-1 KV-reuse fetch asks another worker for.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent hash of the first block of every sequence.
NONE_HASH = 0

_MASK_63_BITS = (1 << 63) - 1


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """63-bit hash of one full block given its parent's hash (fits msgpack/int64 everywhere)."""
    digest = hashlib.sha256()
    digest.update(struct.pack("<Q", parent_hash))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest()[:8], "little") & _MASK_63_BITS


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH) -> list[int]:
    """Hashes of every *full* block of `token_ids` (a trailing partial block has none)."""
    assert block_size > 0, "block_size must be positive"
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
