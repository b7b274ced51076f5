"""Pre-copy of a TP transition's full KV blocks while the old groups keep decoding (ALGORITHMS.md §1.3 step 1).

The reshard plan's transfers are grouped into *migration flows*, one per (source worker, destination
worker) pair, and each flow is cut into chunks of at most `chunk_bytes` (whole blocks; at least one).
`plan_flows` is a pure function of the plan, so every worker computes the same flows and chunk indices.

A source writes a chunk one-sidedly into the destination's new cache, which lives in shared memory
(`nitsum.transfer.shm`) when both are on one host: no receive has to be posted, so a chunk runs whenever the
*source's* group is between two of its own steps. A destination on another host has a receiver thread that
writes the chunks arriving over TCP (`kv_tcp.KvLinks`) and acks each after the write; the source counts a
chunk done only on its ack. Across hosts a chunk goes on the pair's connection of its class: the DSCP of the
level its flow's permit grants (`run`'s `classes`), the lowest level's without one, and the delta's
STAGE_M_DSCP for what the commit copies (`finish_mine`, `copy_transfers_one_sided`). Either way the destination's step thread takes no part. Groups
of a span are not in lockstep; that is why pre-copy cannot use paired send/recv.

A chunk whose link failed is marked done all the same (the group must agree on what is left) and the
failure is kept in `PreCopy.error`: the commit's exchange carries it, and every worker keeps the old
topology.

The leader of each old group drives its members' chunks: it broadcasts which (flow, chunk) items to run at
one of its step boundaries, and every member runs the items whose source it is and marks all of them
done. So the members of a group always agree on what is left; at commit each worker runs whatever of its
own is still left (normally nothing) before the delta.

Full blocks are immutable while their request holds them; a request that finishes or is preempted during
pre-copy may see its old blocks reused, which is harmless: commit re-plans it (drops it, or moves it
afresh) and only the blocks that commit keeps were copied while they were still its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from nitsum.kv.reshard import Transfer
from nitsum.transfer.framing import TransferError
from nitsum.transfer.kv_link import KvLinks
from nitsum.transfer.kv_tcp import IO_TIMEOUT_S, LOWEST_DSCP, STAGE_M_DSCP

# ~2-3 ms of gather-copy on a loaded CPU core (measured ~1.5-2 GiB/s): a small bump on a 25-40 ms decode
# step of the ~27M-param model, and few enough chunks that pre-copy spans only a handful of steps.
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Chunk:
    transfer: int  # index into the plan's transfers
    start: int  # block range [start, end) of that transfer
    end: int
    size_bytes: int


@dataclass(frozen=True)
class MigrationFlow:
    index: int
    src_worker: int
    dst_worker: int
    size_bytes: int
    chunks: tuple[Chunk, ...]

    @property
    def local(self) -> bool:
        """A copy inside one worker (old cache -> its new cache): no link is involved."""
        return self.src_worker == self.dst_worker


def transfer_block_bytes(t: Transfer, block_size: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one block of a transfer: K and V of its layers and heads."""
    return (t.layer_end - t.layer_start) * 2 * block_size * (t.head_end - t.head_start) * head_dim * itemsize


def plan_flows(
    transfers: Sequence[Transfer], block_bytes: Callable[[Transfer], int], chunk_bytes: int
) -> tuple[MigrationFlow, ...]:
    """One flow per (src, dst) pair in pair order; each transfer's blocks cut into chunks <= chunk_bytes."""
    assert chunk_bytes > 0, "chunks need a positive size"
    by_pair: dict[tuple[int, int], list[Chunk]] = {}
    for index, t in enumerate(transfers):
        per_block = block_bytes(t)
        step = max(1, chunk_bytes // max(per_block, 1))
        chunks = by_pair.setdefault((t.src_worker, t.dst_worker), [])
        for start in range(0, t.num_blocks, step):
            end = min(start + step, t.num_blocks)
            chunks.append(Chunk(index, start, end, (end - start) * per_block))
    return tuple(
        MigrationFlow(i, src, dst, sum(c.size_bytes for c in chunks), tuple(chunks))
        for i, ((src, dst), chunks) in enumerate(sorted(by_pair.items()))
    )


def copy_blocks(
    t: Transfer,
    start: int,
    end: int,
    old_kv: torch.Tensor,
    old_heads: tuple[int, int],
    dst_kv: torch.Tensor,
    dst_heads: tuple[int, int],
) -> None:
    """Blocks [start, end) of transfer `t` from this worker's old cache into a destination's new cache.

    Caches: [layers, K/V, blocks, block_size, local_kv_heads, head_dim]; `*_heads` the global KV heads
    [first, end) each holds. Advanced indexing on the block axis gathers into a temporary (one chunk)."""
    src_index = torch.tensor(t.src_block_ids[start:end], dtype=torch.long, device=old_kv.device)
    dst_index = torch.tensor(t.dst_block_ids[start:end], dtype=torch.long, device=dst_kv.device)
    h0, h1 = t.head_start - old_heads[0], t.head_end - old_heads[0]
    g0, g1 = t.head_start - dst_heads[0], t.head_end - dst_heads[0]
    dst_kv[t.layer_start : t.layer_end, :, dst_index, :, g0:g1] = old_kv[
        t.layer_start : t.layer_end, :, src_index, :, h0:h1
    ]


class PreCopy:
    """One worker's view of its old group's pre-copy: which chunks are done, and running its own."""

    def __init__(
        self,
        me: int,
        group_workers: Iterable[int],
        transfers: Sequence[Transfer],
        flows: Sequence[MigrationFlow],
        old_kv: torch.Tensor | None,
        old_heads: tuple[int, int] | None,
        dst_caches: Mapping[int, tuple[torch.Tensor, tuple[int, int]]],
        links: KvLinks | None = None,
    ) -> None:
        members = set(group_workers)
        self.me = me
        self.transfers = tuple(transfers)
        # Only the flows whose source is in this worker's old group: that group's leader drives them.
        self.flows = tuple(f for f in flows if f.src_worker in members)
        self.old_kv = old_kv
        self.old_heads = old_heads
        self.dst_caches = dict(dst_caches)
        self.links = links  # destinations on other hosts (TCP); every other one is in dst_caches
        self.done: set[tuple[int, int]] = set()
        self.bytes_sent = 0  # to other workers' caches
        self.bytes_by_path = {"shm": 0, "tcp": 0}  # the same, by path
        self.bytes_local = 0  # within this worker
        self.error = ""  # the first failed link (its chunks count as done, unsent)
        self._by_index = {f.index: f for f in self.flows}

    @property
    def total_chunks(self) -> int:
        return sum(len(f.chunks) for f in self.flows)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.total_chunks

    def flow_done(self, index: int) -> bool:
        """Every chunk of this flow is copied."""
        return all((index, c) in self.done for c in range(len(self.flow(index).chunks)))

    def flow(self, index: int) -> MigrationFlow:
        return self._by_index[index]

    def next_items(self) -> list[tuple[int, int]]:
        """The next undone chunk of every unfinished flow (one round of all pairs at once)."""
        items = []
        for f in self.flows:
            left = [c for c in range(len(f.chunks)) if (f.index, c) not in self.done]
            if left:
                items.append((f.index, left[0]))
        return items

    def next_items_of(self, indices: Iterable[int]) -> list[tuple[int, int]]:
        """The next undone chunk of each of these flows that has one left (the flows a permit allows)."""
        items = []
        for i in indices:
            left = [c for c in range(len(self.flow(i).chunks)) if (i, c) not in self.done]
            if left:
                items.append((i, left[0]))
        return items

    def run(
        self,
        items: Iterable[tuple[int, int]],
        classes: Mapping[int, int] | None = None,
        default_dscp: int = LOWEST_DSCP,
    ) -> int:
        """Run the items this worker is the source of, mark all done; returns bytes sent to others (over
        TCP: acked). Chunks for other hosts all go out first, then their acks are awaited. `classes`: flow
        index -> DSCP of the level its permit grants; a flow not in it goes at `default_dscp` (pre-copy: the
        lowest level's, as a flow without a permit)."""
        classes = classes or {}
        sent = 0
        for flow_index, chunk_index in items:
            key = (flow_index, chunk_index)
            flow = self._by_index.get(flow_index)
            assert flow is not None and 0 <= chunk_index < len(flow.chunks), f"no chunk {key} in this group"
            if key in self.done:
                continue
            if flow.src_worker == self.me:
                chunk = flow.chunks[chunk_index]
                assert self.old_kv is not None and self.old_heads is not None, f"worker {self.me} holds no old KV"
                t = self.transfers[chunk.transfer]
                if self.links is not None and flow.dst_worker in self.links:
                    self._send(flow.dst_worker, t, chunk.start, chunk.end, classes.get(flow_index, default_dscp))
                else:
                    dst_kv, dst_heads = self.dst_caches[flow.dst_worker]
                    copy_blocks(t, chunk.start, chunk.end, self.old_kv, self.old_heads, dst_kv, dst_heads)
                    if flow.local:
                        self.bytes_local += chunk.size_bytes
                    else:
                        self.bytes_by_path["shm"] += chunk.size_bytes
                        sent += chunk.size_bytes
            self.done.add(key)
        acked = self._acks()
        self.bytes_sent += sent + acked
        return sent + acked

    def _send(self, dst: int, t: Transfer, start: int, end: int, dscp: int) -> None:
        assert self.links is not None and self.old_kv is not None and self.old_heads is not None
        link = self.links.link(dst)
        if link.broken:
            return
        try:
            link.send(t, start, end, self.old_kv, self.old_heads, dscp)  # a class's first chunk connects it
        except Exception as exc:  # noqa: BLE001 -- any failure is this link's: the span then refuses together
            self._broke(link, exc)

    def _acks(self) -> int:
        """Wait for every chunk sent on a link; bytes acked."""
        acked = 0
        deadline = time.monotonic() + IO_TIMEOUT_S  # one budget for every link (they were all sent to already)
        for link in self.links.links.values() if self.links is not None else ():
            if link.broken or not link.in_flight:
                continue
            try:
                acked += link.wait(deadline)
            except Exception as exc:  # noqa: BLE001 -- as in _send
                self._broke(link, exc)
        self.bytes_by_path["tcp"] += acked
        return acked

    def _broke(self, link, exc: Exception) -> None:
        what = str(exc) if isinstance(exc, TransferError) else f"{type(exc).__name__}: {exc}"
        link.broken = f"worker {self.me}: KV link to worker {link.dst} failed: {what}"
        self.error = self.error or link.broken

    def finish_mine(self) -> int:
        """Run every chunk of this worker's own that is still left (at commit); bytes sent to others. Inside
        the commit's pause, not under a permit: the delta's class, STAGE_M_DSCP."""
        return self.run(
            [
                (f.index, c)
                for f in self.flows
                if f.src_worker == self.me
                for c in range(len(f.chunks))
                if (f.index, c) not in self.done
            ],
            default_dscp=STAGE_M_DSCP,
        )


def copy_transfers_one_sided(
    me: int,
    transfers: Sequence[Transfer],
    old_kv: torch.Tensor | None,
    old_heads: tuple[int, int] | None,
    dst_caches: Mapping[int, tuple[torch.Tensor, tuple[int, int]]],
    links: KvLinks | None = None,
    block_bytes: Callable[[Transfer], int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[dict[str, int], str]:
    """Whole transfers whose source is `me` (the commit's delta), straight into the destinations' caches:
    mapped ones written here, those on other hosts sent over `links` in chunks of at most `chunk_bytes` and
    acked (every byte written there) before this returns; across hosts in the delta's class STAGE_M_DSCP (the
    cutover waits for these bytes: no permit, the highest class used for urgent stage-M traffic). Returns (bytes written into other workers' caches
    by path "shm" / "tcp", the first link failure or "")."""
    mine = [t for t in transfers if t.src_worker == me]
    if mine:
        assert old_kv is not None and old_heads is not None, f"worker {me} sends KV it does not hold"
    remote = [t for t in mine if links is not None and t.dst_worker in links]
    by_path = {"shm": 0, "tcp": 0}
    for t in mine:
        if links is not None and t.dst_worker in links:
            continue
        dst_kv, dst_heads = dst_caches[t.dst_worker]
        copy_blocks(t, 0, t.num_blocks, old_kv, old_heads, dst_kv, dst_heads)
        if t.dst_worker != me:
            by_path["shm"] += (
                t.num_blocks
                * (t.layer_end - t.layer_start)
                * 2
                * old_kv.shape[3]
                * (t.head_end - t.head_start)
                * old_kv.shape[5]
                * old_kv.element_size()
            )
    if not remote:
        return by_path, ""
    assert links is not None and block_bytes is not None, "TCP destinations need the chunk geometry"
    # The same chunking as pre-copy: one flow per pair, whole blocks, at most chunk_bytes a frame.
    flows = plan_flows(remote, block_bytes, chunk_bytes)
    pre = PreCopy(me, [me], remote, flows, old_kv, old_heads, {}, links)
    pre.run([(f.index, c) for f in flows for c in range(len(f.chunks))], default_dscp=STAGE_M_DSCP)
    by_path["tcp"] = pre.bytes_by_path["tcp"]
    return by_path, pre.error
