"""Moving KV bytes between engines: the executor under a TP change, and the P/D export's byte form.

Only byte moves live here; a request's state (what it is, how an engine adopts it) is the engine's own API
(`Engine.export_states` / `install_states` / `snapshot_kv` / `export_kv` / `import_request`, built on
`engine/request_state.py`).
- `execute_transfers`: this worker's part of a `nitsum.kv.reshard` plan's KV moves, all pairs at once (every
  send and receive is posted before any is waited on). A move within one worker is a local copy; between
  workers it is a point-to-point message over the node's world (gloo on CPU, NCCL peer copies on CUDA).
- `KVExport`: one request's state and KV, in the one form it travels in: a msgpack header and one payload per
  layer (`header`, `layer_bytes`, `from_layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from nitsum.kv.reshard import Transfer, kv_head_range
from nitsum.topology import Group


def execute_transfers(
    world: Any,
    transfers: SequenceABC[Transfer],
    me: int,
    old_kv: torch.Tensor | None,
    old_heads: tuple[int, int] | None,
    new_kv: torch.Tensor | None,
    new_heads: tuple[int, int] | None,
) -> int:
    """Run this worker's part of `transfers`; returns the bytes it sent to other workers.

    `old_kv`/`new_kv`: [layers, K/V, blocks, block_size, local_kv_heads, head_dim]; `*_heads` the global KV
    heads [start, end) each holds. A transfer's index in the plan is its message tag, so every pair of
    workers matches its sends and receives without further coordination.
    """
    sends: list[tuple[Any, torch.Tensor]] = []
    recvs: list[tuple[Transfer, torch.Tensor, Any]] = []
    bytes_sent = 0
    for tag, t in enumerate(transfers):
        if t.src_worker == me:
            assert old_kv is not None and old_heads is not None, f"worker {me} sends KV it does not hold"
            src_index = torch.tensor(t.src_block_ids, dtype=torch.long, device=old_kv.device)
            h0, h1 = t.head_start - old_heads[0], t.head_end - old_heads[0]
            # [layers', 2, n, block_size, heads', head_dim]
            buf = old_kv[t.layer_start : t.layer_end, :, src_index, :, h0:h1].contiguous()
            if t.dst_worker == me:
                _write(new_kv, new_heads, t, buf)
            else:
                sends.append((world.isend(buf, t.dst_worker, tag), buf))
                bytes_sent += buf.numel() * buf.element_size()
        elif t.dst_worker == me:
            assert new_kv is not None, f"worker {me} receives KV but has no new cache"
            shape = (
                t.layer_end - t.layer_start,
                2,
                t.num_blocks,
                new_kv.shape[3],
                t.head_end - t.head_start,
                new_kv.shape[5],
            )
            buf = torch.empty(shape, dtype=new_kv.dtype, device=new_kv.device)
            recvs.append((t, buf, world.irecv(buf, t.src_worker, tag)))
    for t, buf, handle in recvs:
        handle.wait()
        _write(new_kv, new_heads, t, buf)
    for handle, _ in sends:
        handle.wait()
    return bytes_sent


def _write(new_kv: torch.Tensor | None, new_heads: tuple[int, int] | None, t: Transfer, buf: torch.Tensor) -> None:
    assert new_kv is not None and new_heads is not None, "a KV write needs the new cache"
    dst_index = torch.tensor(t.dst_block_ids, dtype=torch.long, device=new_kv.device)
    h0, h1 = t.head_start - new_heads[0], t.head_end - new_heads[0]
    new_kv[t.layer_start : t.layer_end, :, dst_index, :, h0:h1] = buf


def heads_of(num_kv_heads: int, group: Group, worker: int) -> tuple[int, int]:
    return kv_head_range(num_kv_heads, group.tp, worker - group.start)


# -- one engine's blocks out and in (P/D hand-offs, stage-1 prefix reuse) ---------------------------------
def gather_blocks(cache: torch.Tensor, block_ids: SequenceABC[int]) -> torch.Tensor:
    """Blocks `block_ids` of a [layers, K/V, blocks, ...] cache, copied to the CPU: [layers, K/V, n, ...]."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    return cache[:, :, index].cpu()


def scatter_blocks(
    cache: torch.Tensor, block_ids: SequenceABC[int], kv: torch.Tensor, positions: SequenceABC[int] | None = None
) -> None:
    """Write `kv` ([layers, K/V, n, ...]; only its blocks `positions` when given) into blocks `block_ids`."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    if positions is not None:
        kv = kv[:, :, torch.tensor(list(positions), dtype=torch.long)]
    cache[:, :, index] = kv.to(device=cache.device, dtype=cache.dtype)


# -- P/D disaggregation: one request's KV out of one engine and into another ---------------------------
@dataclass(frozen=True)
class KVExport:
    """A request's full state and the KV of its computed tokens, as one rank holds it.

    `kv`: [layers, K/V, num_blocks, block_size, heads, head_dim] for global KV heads `heads`; a TP=1
    engine holds them all. On the wire: `header()` (msgpack: state, tokens, heads, dtype, one layer's shape)
    and `layer_bytes(i)` per layer; `from_layers` puts them back together.
    """

    state: dict[str, Any]
    num_tokens: int
    heads: tuple[int, int]
    kv: torch.Tensor

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[0])

    def header(self) -> bytes:
        dtype = str(self.kv.dtype).removeprefix("torch.")
        layer_shape = list(self.kv.shape[1:])
        return msgpack.packb([self.state, self.num_tokens, list(self.heads), dtype, layer_shape], use_bin_type=True)

    def layer_bytes(self, layer: int) -> bytes:
        return layer_bytes(self.kv, layer)

    @staticmethod
    def from_layers(header: bytes, layers: Mapping[int, bytes]) -> KVExport:
        """The export from its `header()` and every layer's `layer_bytes` (ValueError/RuntimeError: malformed)."""
        state, num_tokens, heads, dtype, layer_shape = msgpack.unpackb(header, raw=False)
        kv = stack_layers(layers, dtype, layer_shape)
        return KVExport(state, int(num_tokens), (int(heads[0]), int(heads[1])), kv)


def layer_bytes(kv: torch.Tensor, layer: int) -> bytes:
    """Layer `layer` of a [layers, ...] KV tensor as raw bytes."""
    return kv[layer].contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()


def stack_layers(layers: Mapping[int, bytes], dtype: str, layer_shape: SequenceABC[int]) -> torch.Tensor:
    """Layers 0..n-1 of `layer_bytes` back into one [layers, *layer_shape] tensor of `dtype`."""
    torch_dtype = getattr(torch, str(dtype), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"layers {sorted(layers)[:8]} are not 0..{len(layers) - 1}")
    parts = [
        torch.frombuffer(bytearray(layers[i]), dtype=torch.uint8).view(torch_dtype).view(list(layer_shape))
        for i in range(len(layers))
    ]
    return torch.stack(parts)
