"""The model runner: loads weights, owns the paged KV tensors, turns a `StepPlan` into one forward.

Every rank of a TP group runs `execute` on the same plan; only the leader uses the logits.
"""

from __future__ import annotations

import torch

from nitsum.engine.plan import StepPlan
from nitsum.model import loader
from nitsum.model.model import (
    AttentionMetadata,
    MultiTokenSpan,
    Workspace,
    build_model,
    pack_for_fusion,
    rope_step_tables,
    rope_tables,
)
from nitsum.parallel import TPGroup


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
        weights: dict[str, torch.Tensor] | None = None,
        config: loader.ModelConfig | None = None,
    ) -> None:
        """`weights` (full-size tensors, e.g. a shared store's) are used as they are: this rank's parameters
        become views of them and nothing is read from disk. Without them the checkpoint is loaded."""
        self.group = group
        self.device = torch.device(group.device if group.size > 1 else device)
        self.dtype = loader.dtype_of(dtype)
        self.block_size = block_size
        self.config = config or loader.load_config(model_dir)
        self.config.check_tp(group.size)
        # Full-size weights stay referenced: this rank's parameters are views into them.
        if weights is None:
            weights = loader.load_weights(model_dir, self.dtype, str(self.device))
            if group.size == 1:
                # Our own copy at TP=1: lay q/k/v and gate/up back to back so those matmuls run fused.
                # (At TP>1, and on a shared store's views, the projections stay separate matmuls.)
                weights = pack_for_fusion(weights, self.config)
        self.weights = weights
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
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, self.num_kv_blocks, block_size, self.num_kv_heads, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )
        self.workspace = Workspace()  # reused gather buffers of the decode attention

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits [num_sampled_chunks, vocab] (fp32), rows in plan order of the chunks with `sample`."""
        bs = self.block_size
        dev = self.device
        chunks = plan.chunks
        # One-token chunks first: their attention runs as one batched call. Then fresh prompts grouped by
        # length (each group is one batched causal call), then chunks that extend a cached prefix.
        singles = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        multis = sorted((i for i, c in enumerate(chunks) if len(c.token_ids) > 1),
                        key=lambda i: (chunks[i].start_pos > 0, 0 if chunks[i].start_pos else len(chunks[i].token_ids)))

        # Token ids, positions and KV slots go to the device as one tensor (one copy, then views).
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        single_ids = single_mask = None
        single_context = 0
        if singles:
            single_chunks = [chunks[i] for i in singles]
            positions = [c.start_pos for c in single_chunks]
            token_ids = [c.token_ids[0] for c in single_chunks]
            slots = [c.block_table[pos // bs] * bs + pos % bs for c, pos in zip(single_chunks, positions)]
            last_row = {i: row for row, i in enumerate(singles)}
            single_context = max(positions) + 1
            max_blocks = -(-single_context // bs)
            ids: list[int] = []
            for chunk in single_chunks:
                table = chunk.block_table[:max_blocks]
                ids.extend(table)
                if len(table) < max_blocks:
                    ids.extend([0] * (max_blocks - len(table)))  # padding: masked out (or sliced off)
            single_ids = torch.tensor(ids, dtype=torch.long, device=dev)
            if min(positions) + 1 < single_context:
                lens = torch.tensor(positions, device=dev) + 1
                keep = torch.arange(single_context, device=dev)[None, :] < lens[:, None]
                # Additive float mask, made once per step: SDPA would otherwise convert a bool mask in
                # every layer (same values: 0 where attended, -inf elsewhere).
                single_mask = torch.zeros(keep.shape, dtype=self.dtype, device=dev).masked_fill_(
                    ~keep, float("-inf"))[:, None, None, :]

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
            multi.append(MultiTokenSpan(
                token_start=row0, num_tokens=n, start_pos=start,
                block_table=torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=dev),
                mask=mask,
            ))

        num_tokens = len(token_ids)
        sample_rows = [last_row[i] for i, c in enumerate(chunks) if c.sample]
        packed = torch.tensor(token_ids + positions + slots + sample_rows, dtype=torch.long, device=dev)
        ids_tensor, pos_tensor, slot_tensor, rows = packed.split((num_tokens, num_tokens, num_tokens, len(sample_rows)))
        meta = AttentionMetadata(
            slot_mapping=slot_tensor,
            num_single=len(singles),
            single_block_ids=single_ids,
            single_context_len=single_context,
            single_mask=single_mask,
            multi=multi,
            workspace=self.workspace,
        )
        cos = self._cos.index_select(0, pos_tensor).unsqueeze(1)
        sin = self._signed_sin.index_select(0, pos_tensor).unsqueeze(1)
        hidden = self.model.forward(ids_tensor, cos, sin, meta, self.kv_cache, rope_prepared=True)
        if not sample_rows:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        if len(sample_rows) < num_tokens or sample_rows != list(range(num_tokens)):
            hidden = hidden.index_select(0, rows)  # (a decode-only step samples every row, in order)
        return self.model.compute_logits(hidden).float()


def num_kv_blocks_for(
    cfg: loader.ModelConfig, tp: int, block_size: int, dtype: torch.dtype, num_kv_blocks: int | None, kv_cache_mb: int
) -> int:
    """KV blocks of one rank of a TP=tp group: the configured count, or as many as fit in kv_cache_mb."""
    if num_kv_blocks:
        return num_kv_blocks
    heads = loader.kv_heads_per_rank(cfg, tp)
    block_bytes = 2 * cfg.num_layers * block_size * heads * cfg.head_dim * dtype.itemsize
    return max(1, (kv_cache_mb * 2**20) // block_bytes)
