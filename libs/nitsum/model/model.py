"""Llama-family decoder (Llama 2/3, Mistral, Qwen2): RMSNorm, RoPE (incl. Llama-3 scaling), GQA, SwiGLU,
built from the tensor-parallel layers in `layers.py` and run over a paged KV cache.

Tensors are flat over the tokens of one step: `T` tokens from several sequences. `AttentionMetadata`
(built by the runner) says where each token's K/V goes and what each sequence attends to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nitsum.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from nitsum.model.loader import ModelConfig, kv_heads_per_rank
from nitsum.parallel import TPGroup


@dataclass
class MultiTokenSpan:
    """One sequence with more than one query token in this step (a prefill chunk)."""

    token_start: int  # first row in the step's flat token tensors
    num_tokens: int
    start_pos: int  # tokens of this sequence already in the KV cache before this step
    block_table: torch.Tensor  # [num_blocks] long
    mask: torch.Tensor | None  # [num_tokens, start_pos + num_tokens] bool; None when start_pos == 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset for every token
    num_single: int  # rows [0, num_single) are one-query-token sequences (decodes), batched together
    single_block_tables: torch.Tensor | None  # [num_single, max_blocks] long (padded)
    single_mask: torch.Tensor | None  # [num_single, 1, 1, max_blocks * block_size] bool
    multi: list[MultiTokenSpan]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    assert rope_type == "llama3", f"unsupported rope type {rope_type}"
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim], halves repeated (rotate-half convention)."""
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads // group.size
        self.num_kv_heads = kv_heads_per_rank(cfg, group.size)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, self.num_heads * cfg.head_dim, bias)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias)
        self.o_proj = RowParallelLinear(self.num_heads * cfg.head_dim, cfg.hidden_size, group)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = apply_rope(self.q_proj(x).view(num_tokens, h, d), cos, sin)
        k = apply_rope(self.k_proj(x).view(num_tokens, h_kv, d), cos, sin)
        v = self.v_proj(x).view(num_tokens, h_kv, d)
        k_cache.view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, v)

        out = q.new_empty(num_tokens, h, d)
        n_single = meta.num_single
        if n_single:
            tables = meta.single_block_tables
            ks = k_cache[tables].view(n_single, -1, h_kv, d).transpose(1, 2)  # [B, H_kv, S, D]
            vs = v_cache[tables].view(n_single, -1, h_kv, d).transpose(1, 2)
            qs = q[:n_single].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.single_mask, scale=self.scale, enable_gqa=True)
            out[:n_single] = o.squeeze(2)
        for span in meta.multi:
            rows = slice(span.token_start, span.token_start + span.num_tokens)
            qm = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if span.start_pos == 0:
                km = k[rows].transpose(0, 1).unsqueeze(0)  # [1, H_kv, n, D]
                vm = v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qm, km, vm, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                context = span.start_pos + span.num_tokens
                km = k_cache[span.block_table].view(-1, h_kv, d)[:context].transpose(0, 1).unsqueeze(0)
                vm = v_cache[span.block_table].view(-1, h_kv, d)[:context].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qm, km, vm, attn_mask=span.mask, scale=self.scale, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return self.o_proj(out.view(num_tokens, h * d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        inter_local = cfg.intermediate_size // group.size
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, inter_local)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, inter_local)
        self.down_proj = RowParallelLinear(inter_local, cfg.hidden_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, group)

    def forward(self, x, cos, sin, meta, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, group) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match the Hugging Face checkpoint, so shards load with `load_state_dict`."""

    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group
        self.model = LlamaBody(cfg, group)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, group)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        cos: torch.Tensor,  # [T, D] (rope rows for each token's position)
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, H_kv, D]
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, meta, kv_cache[index, 0], kv_cache[index, 1])
        return self.model.norm(x)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab]


def build_model(cfg: ModelConfig, group: TPGroup, shards: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """Build on the meta device (no memory), then assign this rank's weight views."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, group)
    model.load_state_dict(shards, strict=True, assign=True)
    for name, tensor in model.state_dict().items():
        assert not tensor.is_meta, f"weight {name} was not assigned"
    return model.eval()
