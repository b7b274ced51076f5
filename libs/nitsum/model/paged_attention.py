"""Decode attention that reads the paged KV cache in place: torch's flex attention with a block mask whose KV
blocks are each sequence's physical cache blocks (no gather copy of K/V).

The gather path (`model.Attention`, `DecodeGroup`) copies every decode row's blocks into a contiguous buffer
and runs SDPA on it: on a GPU that copy moves as many bytes as the attention reads. Here the whole cache of one
layer, `[num_blocks, block_size, H_kv, D]`, is seen as one KV sequence `[1, H_kv, num_blocks * block_size, D]`
(a view), and a `BlockMask` with KV block size = the cache's block size says which blocks each query row (one
decode sequence) attends: its full blocks (no mask evaluated inside them) and its last, partly filled block,
where `mask_mod` keeps the first `context % block_size` slots. A block's order inside a sequence does not
matter to attention (softmax over a set of keys), so the physical order of the block table is fine.

`decode_attention` (NITSUM_DECODE_ATTENTION) picks the path: "auto" (flex on CUDA, gather on CPU), "flex" or
"gather". The flex call is `torch.compile`d once per process (dynamic shapes): torch's eager flex attention is a
reference implementation that materialises the scores over the whole cache, and it does not serve the batch-
broadcast KV used here correctly (seen on torch 2.13 CPU), so this path is never run eagerly. The compile costs
seconds to tens of seconds at the first decode step (and a recompile when the batch first changes size).
"""

from __future__ import annotations

import torch

DECODE_ATTENTION_CHOICES = ("auto", "flex", "gather")
_compiled = None


def resolve_decode_attention(name: str, device: torch.device | str, block_size: int = 16) -> str:
    """ "flex" or "gather" for a setting's value on `device`. On CUDA flex needs cache blocks of a multiple of 16
    tokens (the compiled kernel's smallest KV tile): "auto" falls back to gather below that, "flex" refuses."""
    if name not in DECODE_ATTENTION_CHOICES:
        raise ValueError(f"decode attention must be one of {', '.join(DECODE_ATTENTION_CHOICES)}, got {name!r}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "flex" if cuda and block_size % 16 == 0 else "gather"
    if name == "flex" and cuda and block_size % 16:
        raise ValueError(f"flex decode attention on CUDA needs a block size that is a multiple of 16, got {block_size}")
    return name


# Recompiles allowed before torch._dynamo gives up on a compiled function. Each dtype, head layout (a TP level)
# and the first batch sizes cost one; past the limit dynamo would run flex attention eagerly, which is wrong
# here (see the module docstring), so hitting the limit is made an error instead.
RECOMPILE_LIMIT = 64
# Q rows per sparse block of the mask: one block covers the single query token of a decode row (any
# BLOCK_M the kernels pick up to 128 divides it).
Q_BLOCK = 128


def compiled_flex_attention():
    """`flex_attention` compiled once per process, with dynamic shapes (batch and cache sizes vary)."""
    global _compiled
    if _compiled is None:
        from torch._dynamo import config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("recompile_limit", "cache_size_limit"):  # torch >= 2.7 / older
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))
        if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
            dynamo_config.fail_on_recompile_limit_hit = True
        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


def kernel_options(block_size: int) -> dict:
    """Tile sizes for the compiled kernel: its KV tile (BLOCK_N) must divide the mask's KV block, which is the
    cache block (16 by default, smaller than the kernels' default tiles of 64-128), and one query token needs no
    tall Q tile (BLOCK_M)."""
    block_n = 16
    while block_n * 2 <= min(block_size, 64) and block_size % (block_n * 2) == 0:
        block_n *= 2
    return {"BLOCK_M": 16, "BLOCK_N": block_n}


class FlexDecode:
    """One runner's paged decode attention: `block_mask` once per step, `attend` once per layer.

    The mask_mod reads two per-row tensors kept here across steps (the physical id of each row's partial
    block, -1 when its last block is full, and how many of that block's slots hold keys), updated in place,
    so that the compiled call sees the same function and the same tensors on every step (no recompile)."""

    def __init__(self, block_size: int, num_blocks: int, device: torch.device | str, capacity: int = 256) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.calls = 0  # flex calls made (tests check the path ran)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self._partial_block = torch.full((capacity,), -1, dtype=torch.int32, device=self.device)
        self._partial_len = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        partial_block, partial_len, bs = self._partial_block, self._partial_len, self.block_size

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx // bs != partial_block[b]) | (kv_idx % bs < partial_len[b])

        self._mask_mod = mask_mod

    def block_mask(self, block_tables: list, context_lens: list[int]):
        """The step's BlockMask: row i attends the first `context_lens[i]` slots of `block_tables[i]`."""
        from torch.nn.attention.flex_attention import BlockMask

        rows, bs, dev = len(block_tables), self.block_size, self.device
        if rows > self._partial_block.numel():
            self._grow(max(rows, 2 * self._partial_block.numel()))
        num_full = [n // bs for n in context_lens]
        width = max(-(-n // bs) for n in context_lens)
        table = [list(t[: -(-n // bs)]) + [0] * (width - -(-n // bs)) for t, n in zip(block_tables, context_lens)]
        partial = [t[f] if n % bs else -1 for t, f, n in zip(table, num_full, context_lens)]
        flat = num_full + [n % bs for n in context_lens] + partial + [b for t in table for b in t]
        small = torch.tensor(flat, dtype=torch.int32).to(dev, non_blocking=True)  # one copy to the device
        full_n, part_len, part_block = small[:rows], small[rows : 2 * rows], small[2 * rows : 3 * rows]
        tables = small[3 * rows :].view(rows, width)
        self._partial_block[:rows].copy_(part_block)
        self._partial_len[:rows].copy_(part_len)
        # The mask spans the whole cache in the KV dimension: every index array is num_blocks wide.
        full_idx = torch.zeros(rows, self.num_blocks, dtype=torch.int32, device=dev)
        full_idx[:, :width] = tables
        part_idx = torch.zeros(rows, self.num_blocks, dtype=torch.int32, device=dev)
        part_idx[:, 0] = part_block.clamp(min=0)
        part_n = (part_len > 0).to(torch.int32)
        return BlockMask.from_kv_blocks(
            part_n[:, None, None],
            part_idx[:, None, None, :],
            full_n[:, None, None],
            full_idx[:, None, None, :],
            BLOCK_SIZE=(Q_BLOCK, bs),
            mask_mod=self._mask_mod,
            seq_lengths=(1, self.num_blocks * bs),
            compute_q_blocks=False,
        )

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask, scale: float
    ) -> torch.Tensor:
        """q: [rows, H, D] (one query token per row); caches: [num_blocks, block_size, H_kv, D]. -> [rows, H, D]."""
        num_blocks, bs, h_kv, d = k_cache.shape
        k = k_cache.view(1, num_blocks * bs, h_kv, d).transpose(1, 2)  # [1, H_kv, S, D], a view
        v = v_cache.view(1, num_blocks * bs, h_kv, d).transpose(1, 2)
        self.calls += 1
        options = kernel_options(bs) if q.is_cuda else None  # (the CPU kernel picks its own tiles)
        out = compiled_flex_attention()(
            q.unsqueeze(2),
            k,
            v,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=q.shape[1] != h_kv,
            kernel_options=options,
        )
        return out.squeeze(2)
