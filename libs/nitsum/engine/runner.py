"""The model runner: loads weights, owns the paged KV tensors, turns a `StepPlan` into one forward.

Every rank of a TP group runs `execute` on the same plan; only the leader uses the logits.
"""

from __future__ import annotations

import torch

from nitsum.engine.plan import StepPlan
from nitsum.model import loader
from nitsum.model.model import AttentionMetadata, MultiTokenSpan, build_model, rope_tables
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
        self.weights = weights if weights is not None else loader.load_weights(model_dir, self.dtype, str(self.device))
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

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits [num_sampled_chunks, vocab] (fp32), rows in plan order of the chunks with `sample`."""
        bs = self.block_size
        chunks = plan.chunks
        # One-token chunks first: their attention runs as one batched call.
        order = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        num_single = len(order)
        order += [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        multi: list[MultiTokenSpan] = []
        for i in order:
            chunk = chunks[i]
            row0 = len(token_ids)
            n = len(chunk.token_ids)
            table = chunk.block_table
            token_ids.extend(chunk.token_ids)
            for pos in range(chunk.start_pos, chunk.start_pos + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            last_row[i] = row0 + n - 1
            if n > 1:
                mask = None
                if chunk.start_pos > 0:
                    context = chunk.start_pos + n
                    q_pos = torch.arange(chunk.start_pos, context, device=self.device)
                    mask = torch.arange(context, device=self.device)[None, :] <= q_pos[:, None]
                blocks_needed = -(-(chunk.start_pos + n) // bs)
                multi.append(MultiTokenSpan(
                    token_start=row0, num_tokens=n, start_pos=chunk.start_pos,
                    block_table=torch.tensor(table[:blocks_needed], dtype=torch.long, device=self.device),
                    mask=mask,
                ))

        single_tables = single_mask = None
        if num_single:
            singles = [chunks[i] for i in order[:num_single]]
            context_lens = [c.start_pos + 1 for c in singles]
            max_blocks = -(-max(context_lens) // bs)
            padded = [list(c.block_table[:max_blocks]) + [0] * (max_blocks - min(len(c.block_table), max_blocks))
                      for c in singles]
            single_tables = torch.tensor(padded, dtype=torch.long, device=self.device)
            lens = torch.tensor(context_lens, device=self.device)
            single_mask = (torch.arange(max_blocks * bs, device=self.device)[None, :] < lens[:, None])[:, None, None, :]

        pos_tensor = torch.tensor(positions, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_single=num_single,
            single_block_tables=single_tables,
            single_mask=single_mask,
            multi=multi,
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, self._cos[pos_tensor], self._sin[pos_tensor], meta, self.kv_cache)
        sample_rows = [last_row[i] for i, c in enumerate(chunks) if c.sample]
        if not sample_rows:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
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
