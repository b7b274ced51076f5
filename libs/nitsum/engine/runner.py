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
        self._cos, self._sin = rope_tables(self.config, self.max_model_len, self.dtype, str(self.device))

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

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        for i in singles:
            chunk = chunks[i]
            pos = chunk.start_pos
            last_row[i] = len(token_ids)
            token_ids.append(chunk.token_ids[0])
            positions.append(pos)
            slots.append(chunk.block_table[pos // bs] * bs + pos % bs)

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

        single_ids = single_mask = None
        single_context = 0
        if singles:
            context_lens = [chunks[i].start_pos + 1 for i in singles]
            single_context = max(context_lens)
            max_blocks = -(-single_context // bs)
            ids: list[int] = []
            for i in singles:
                table = chunks[i].block_table[:max_blocks]
                ids.extend(table)
                ids.extend([0] * (max_blocks - len(table)))  # padding: masked out (or sliced off)
            single_ids = torch.tensor(ids, dtype=torch.long, device=dev)
            if min(context_lens) < single_context:
                lens = torch.tensor(context_lens, device=dev)
                single_mask = (torch.arange(single_context, device=dev)[None, :] < lens[:, None])[:, None, None, :]

        pos_tensor = torch.tensor(positions, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_single=len(singles),
            single_block_ids=single_ids,
            single_context_len=single_context,
            single_mask=single_mask,
            multi=multi,
            workspace=self.workspace,
        )
        ids_tensor = torch.tensor(token_ids, dtype=torch.long, device=dev)
        hidden = self.model(ids_tensor, self._cos[pos_tensor], self._sin[pos_tensor], meta, self.kv_cache)
        sample_rows = [last_row[i] for i, c in enumerate(chunks) if c.sample]
        if not sample_rows:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return self.model.compute_logits(hidden[rows]).float()


def num_kv_blocks_for(
    cfg: loader.ModelConfig, tp: int, block_size: int, dtype: torch.dtype, num_kv_blocks: int | None, kv_cache_mb: int
) -> int:
    """KV blocks of one rank of a TP=tp group: the configured count, or as many as fit in kv_cache_mb."""
    if num_kv_blocks:
        return num_kv_blocks
    heads = loader.kv_heads_per_rank(cfg, tp)
    block_bytes = 2 * cfg.num_layers * block_size * heads * cfg.head_dim * dtype.itemsize
    return max(1, (kv_cache_mb * 2**20) // block_bytes)
