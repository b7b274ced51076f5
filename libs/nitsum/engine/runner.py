"""The model runner: loads weights, owns the paged KV tensors, turns a `StepPlan` into one forward.

Every rank of a TP group runs `execute` on the same plan; only the leader uses the logits.
"""

from __future__ import annotations

import torch

from nitsum.engine.plan import StepPlan
from nitsum.model import loader
from nitsum.model.model import (
    AttentionMetadata,
    DecodeGroup,
    MultiTokenSpan,
    Workspace,
    build_model,
    pack_for_fusion,
    rope_step_tables,
    rope_tables,
)
from nitsum.model.paged_attention import FlexDecode, resolve_decode_attention
from nitsum.parallel import TPGroup
from nitsum.parallel.weights import ResidentWeights


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        group: TPGroup,
        device: str = "cpu",
        dtype: str = "float32",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_mb: int = 64,
        weights: dict[str, torch.Tensor] | ResidentWeights | None = None,
        config: loader.ModelConfig | None = None,
        allocate_kv_cache: bool = True,
        decode_attention: str = "auto",
    ) -> None:
        """`weights` (full-size tensors, e.g. a shared store's, or a device's `ResidentWeights` boot copy)
        are used as they are: this rank's parameters become views of them and nothing is read from disk or
        allocated. Without them the checkpoint is loaded. `allocate_kv_cache=False`: `kv_cache` stays None
        until the owner attaches one of `kv_cache_shape` (a node worker's runners for other TP levels, built
        ahead of any change: their cache is the one a transition allocates)."""
        self.group = group
        self.device = torch.device(group.device if group.size > 1 else device)
        self.dtype = loader.dtype_of(dtype)
        self.block_size = block_size
        self.config = config or loader.load_config(model_dir)
        self.config.check_tp(group.size)
        if isinstance(weights, ResidentWeights) and not _same_device(weights.device, self.device):
            raise ValueError(f"resident weights are on {weights.device}, the runner computes on {self.device}")
        # Full-size weights stay referenced: this rank's parameters are views into them.
        if weights is None:
            weights = loader.load_weights(model_dir, self.dtype, str(self.device))
            if group.size == 1:
                # Our own copy at TP=1: lay q/k/v and gate/up back to back so those matmuls run fused.
                # (At TP>1, and on a shared store's views, the projections stay separate matmuls.)
                weights = pack_for_fusion(weights, self.config)
        self.weights = weights
        if isinstance(weights, ResidentWeights):
            shards = weights.shards(self.config, group.rank, group.size)
        else:
            shards = loader.shard_weights(self.weights, self.config, group.rank, group.size)
        self.model = build_model(self.config, group, shards)
        self.max_model_len = self.config.max_model_len
        cos, sin = rope_tables(self.config, self.max_model_len, self.dtype, str(self.device))
        # Tables as the layers use them ([T, 1, D], sin sign-folded), made once here rather than per step.
        self._cos, self._signed_sin = (t.squeeze(1) for t in rope_step_tables(cos, sin))

        cfg = self.config
        self.num_kv_heads = loader.kv_heads_per_rank(cfg, group.size)
        self.num_kv_blocks = num_kv_blocks_for(cfg, group.size, block_size, self.dtype, num_kv_blocks, kv_cache_mb)
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]
        self.kv_cache_shape = (cfg.num_layers, 2, self.num_kv_blocks, block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_cache: torch.Tensor | None = (
            torch.zeros(self.kv_cache_shape, dtype=self.dtype, device=self.device) if allocate_kv_cache else None
        )
        self.workspace = Workspace()  # reused gather buffers of the decode attention
        # Decode attention in place over the paged cache (flex attention) or through the gather; see paged_attention.
        self.decode_attention = resolve_decode_attention(decode_attention, self.device, block_size)
        self.flex = FlexDecode(block_size, self.num_kv_blocks, self.device) if self.decode_attention == "flex" else None

    def _decode_group(self, chunks: list, positions: list[int], start: int, end: int) -> DecodeGroup:
        """Decode rows [start, end) (contexts ascending): block tables padded to the group's longest."""
        bs, dev = self.block_size, self.device
        context = positions[end - 1] + 1
        max_blocks = -(-context // bs)
        ids: list[int] = []
        for chunk in chunks[start:end]:
            table = chunk.block_table[:max_blocks]
            ids.extend(table)
            if len(table) < max_blocks:
                ids.extend([0] * (max_blocks - len(table)))  # padding: masked out (or sliced off)
        mask = None
        if positions[start] + 1 < context:
            lens = torch.tensor(positions[start:end], device=dev) + 1
            keep = torch.arange(context, device=dev)[None, :] < lens[:, None]
            # Additive float mask, made once per step: SDPA would otherwise convert a bool mask in every
            # layer (same values: 0 where attended, -inf elsewhere).
            mask = torch.zeros(keep.shape, dtype=self.dtype, device=dev).masked_fill_(~keep, float("-inf"))[
                :, None, None, :
            ]
        return DecodeGroup(start, end - start, torch.tensor(ids, dtype=torch.long, device=dev), context, mask)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits [num_sampled_chunks, vocab] (fp32), rows in plan order of the chunks with `sample`."""
        bs = self.block_size
        dev = self.device
        chunks = plan.chunks
        # One-token chunks first, in context order: their attention runs batched, in groups of similar
        # context (`decode_groups`). Then fresh prompts grouped by length (each group is one batched causal
        # call), then chunks that extend a cached prefix.
        singles = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        multis = sorted(
            (i for i, c in enumerate(chunks) if len(c.token_ids) > 1),
            key=lambda i: (chunks[i].start_pos > 0, 0 if chunks[i].start_pos else len(chunks[i].token_ids)),
        )

        # Token ids, positions and KV slots go to the device as one tensor (one copy, then views).
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        groups: list[DecodeGroup] = []
        flex = None
        if singles:
            # Rows in context order, so that rows of similar context can share an attention call.
            singles.sort(key=lambda i: chunks[i].start_pos)
            single_chunks = [chunks[i] for i in singles]
            positions = [c.start_pos for c in single_chunks]
            token_ids = [c.token_ids[0] for c in single_chunks]
            slots = [c.block_table[pos // bs] * bs + pos % bs for c, pos in zip(single_chunks, positions)]
            last_row = {i: row for row, i in enumerate(singles)}
            if self.flex is not None:
                flex = (
                    self.flex,
                    self.flex.block_mask([c.block_table for c in single_chunks], [p + 1 for p in positions]),
                )
            else:
                for start, end in decode_groups([-(-(pos + 1) // bs) for pos in positions]):
                    groups.append(self._decode_group(single_chunks, positions, start, end))
        multi: list[MultiTokenSpan] = []
        for i in multis:
            chunk = chunks[i]
            row0 = len(token_ids)
            n = len(chunk.token_ids)
            start, end = chunk.start_pos, chunk.start_pos + n
            table = chunk.block_table
            token_ids.extend(chunk.token_ids)
            chunk_positions = range(start, end)
            positions.extend(chunk_positions)
            slots.extend(table[pos // bs] * bs + pos % bs for pos in chunk_positions)
            last_row[i] = row0 + n - 1
            prev = multi[-1] if multi else None
            if start == 0 and prev is not None and prev.start_pos == 0 and prev.num_tokens == n:
                prev.num_seqs += 1  # rows are consecutive: same batched call
                continue
            mask = None
            if start > 0:
                q_pos = torch.arange(start, end, device=dev)
                mask = torch.arange(end, device=dev)[None, :] <= q_pos[:, None]
            multi.append(
                MultiTokenSpan(
                    token_start=row0,
                    num_tokens=n,
                    start_pos=start,
                    block_table=torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=dev),
                    mask=mask,
                )
            )

        num_tokens = len(token_ids)
        sample_rows = [last_row[i] for i, c in enumerate(chunks) if c.sample]
        packed = torch.tensor(token_ids + positions + slots + sample_rows, dtype=torch.long, device=dev)
        ids_tensor, pos_tensor, slot_tensor, rows = packed.split((num_tokens, num_tokens, num_tokens, len(sample_rows)))
        meta = AttentionMetadata(
            slot_mapping=slot_tensor,
            num_single=len(singles),
            decode_groups=groups,
            multi=multi,
            workspace=self.workspace,
            flex=flex,
        )
        cos = self._cos.index_select(0, pos_tensor).unsqueeze(1)
        sin = self._signed_sin.index_select(0, pos_tensor).unsqueeze(1)
        hidden = self.model.forward(ids_tensor, cos, sin, meta, self.kv_cache, rope_prepared=True)
        if not sample_rows:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        if len(sample_rows) < num_tokens or sample_rows != list(range(num_tokens)):
            hidden = hidden.index_select(0, rows)  # (a decode-only step samples every row, in order)
        return self.model.compute_logits(hidden).float()


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device, where "cuda" (no index) means the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    return (a.index if a.index is not None else torch.cuda.current_device()) == (
        b.index if b.index is not None else torch.cuda.current_device()
    )


# What one more decode attention call costs (its gathers' and kernel's fixed cost), in padded block-rows of
# the gather: a rough figure from the tiny and 99M models on CPU (a call ~30-40 us; a block-row of tiny's
# gather + attention ~1 us per layer), used to decide when splitting the decode rows pays.
GROUP_COST_BLOCK_ROWS = 32
MAX_DECODE_GROUPS = 4


def decode_groups(num_blocks: list[int]) -> list[tuple[int, int]]:
    """Row ranges [start, end) cutting decode rows (sorted by context: `num_blocks` ascending, KV blocks each
    attends) into 1..MAX_DECODE_GROUPS groups of equal count. Each group's gather and attention cover its
    rows padded to its longest context, so the cost is sum(rows x max blocks) plus a fixed cost per extra
    group; the cheapest split is kept. Equal contexts always give one group."""
    n = len(num_blocks)
    best_cost, best = n * num_blocks[-1], [(0, n)]
    for k in range(2, min(MAX_DECODE_GROUPS, n) + 1):
        bounds = [n * j // k for j in range(k + 1)]
        cost = (k - 1) * GROUP_COST_BLOCK_ROWS + sum(
            (bounds[j + 1] - bounds[j]) * num_blocks[bounds[j + 1] - 1] for j in range(k)
        )
        if cost < best_cost:
            best_cost, best = cost, [(bounds[j], bounds[j + 1]) for j in range(k)]
    return best


def num_kv_blocks_for(
    cfg: loader.ModelConfig, tp: int, block_size: int, dtype: torch.dtype, num_kv_blocks: int | None, kv_cache_mb: int
) -> int:
    """KV blocks of one rank of a TP=tp group: the configured count, or as many as fit in kv_cache_mb."""
    if num_kv_blocks:
        return num_kv_blocks
    heads = loader.kv_heads_per_rank(cfg, tp)
    block_bytes = 2 * cfg.num_layers * block_size * heads * cfg.head_dim * dtype.itemsize
    return max(1, (kv_cache_mb * 2**20) // block_bytes)
