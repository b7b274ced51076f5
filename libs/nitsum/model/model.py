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
    linear,
)
from nitsum.model.loader import ModelConfig, kv_heads_per_rank
from nitsum.parallel import TPGroup


@dataclass
class MultiTokenSpan:
    """Sequences with more than one query token in this step (prefill chunks): one sequence, or
    `num_seqs` fresh prompts (start_pos == 0) of equal length in consecutive rows, attended in one call."""

    token_start: int  # first row in the step's flat token tensors
    num_tokens: int  # query tokens of each sequence
    start_pos: int  # tokens of this sequence already in the KV cache before this step
    block_table: torch.Tensor  # [num_blocks] long
    mask: torch.Tensor | None  # [num_tokens, start_pos + num_tokens] bool; None when start_pos == 0
    num_seqs: int = 1  # > 1 only when start_pos == 0


class Workspace:
    """Reused scratch memory for the attention's K/V gathers (decode rows, and prefill chunks that
    extend a cached prefix).

    Why: a fresh tensor of tens of MB is a fresh mmap on every call, and the kernel zero-fills each page
    on first touch; at batch 32 x 1024 context that page-faulting cost several times the copy itself
    (the 30-66 ms decode steps). The gather writes into these buffers instead (index_select out=).
    Layers run one after another, so one K and one V buffer serve them all. It keeps its largest size
    (at most what the biggest step gathers per layer, which before was allocated afresh per layer)."""

    def __init__(self) -> None:
        self._k = torch.empty(0)
        self._v = torch.empty(0)

    def buffers(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat tensors of `numel` elements (dtype/device of `like`), valid until the next call."""
        if self._k.numel() < numel or self._k.dtype != like.dtype or self._k.device != like.device:
            self._k = like.new_empty(numel)
            self._v = like.new_empty(numel)
        return self._k[:numel], self._v[:numel]


@dataclass
class DecodeGroup:
    """Decode rows [row_start, row_start + num_rows) attended in one batched call: their block tables padded
    to the group's longest context. (Rows are cut into groups of similar context so that short contexts are
    not padded to the longest of the whole step, see the runner.)"""

    row_start: int
    num_rows: int
    block_ids: torch.Tensor  # [num_rows * max_blocks] long: padded block tables, flattened
    context_len: int  # longest context in the group (keys attended)
    # [num_rows, 1, 1, context_len]: bool, or additive float (0 / -inf); None when all contexts are equal
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset for every token
    num_single: int  # rows [0, num_single) are one-query-token sequences (decodes)
    decode_groups: list[DecodeGroup]  # those rows, cut into consecutive groups each attended in one call
    multi: list[MultiTokenSpan]
    workspace: Workspace
    # Decode rows attended in place by flex attention (`paged_attention.FlexDecode`, the step's BlockMask);
    # None: the gather path over `decode_groups`.
    flex: tuple | None = None


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


def rope_step_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Once per step, for `apply_rope_prepared`: cos as [T, 1, D], and sin with its first half negated
    (rotate-half's sign folded in), [T, 1, D]."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.unsqueeze(1), signed.unsqueeze(1)


def apply_rope_prepared(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with `rope_step_tables`' tables, in three kernels instead of six (every layer runs it
    on small decode batches, where the kernel count is the cost). Same values: roll(x) * signed_sin is
    rotate_half(x) * sin term by term."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def fused_view(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One tensor stacking `parts` along dim 0, as a view, when they lie back to back in one storage
    (same dtype, trailing shape and device, contiguous); None otherwise (or when a part is None).

    This is how projections are fused without copying: the weights stay views of whatever holds them
    (the runner's own load lays q/k/v and gate/up out back to back; a shared store's TP shards do not
    touch, so those layers keep separate matmuls)."""
    if any(p is None or p.is_meta for p in parts):
        return None
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        if (
            not p.is_contiguous()
            or p.dtype != first.dtype
            or p.device != first.device
            or p.shape[1:] != first.shape[1:]
            or p.storage_offset() != offset
            or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        ):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


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
        # Plain attributes (not parameters: the state dict keeps the checkpoint's names), set by `fuse`.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> bool:
        """Use one q|k|v matmul when the three weights (and biases) are adjacent views. True if fused."""
        self.qkv_weight = fused_view([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        if self.q_proj.bias is not None:
            self.qkv_bias = fused_view([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
            if self.qkv_bias is None:
                self.qkv_weight = None
        return self.qkv_weight is not None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        num_tokens = x.shape[0]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = linear(x, self.qkv_weight, self.qkv_bias).view(num_tokens, h + 2 * h_kv, d)
            qk = apply_rope_prepared(qkv[:, : h + h_kv], cos, sin)  # one rotation for q and k together
            return qk[:, :h], qk[:, h:], qkv[:, h + h_kv :]
        q = apply_rope_prepared(self.q_proj(x).view(num_tokens, h, d), cos, sin)
        k = apply_rope_prepared(self.k_proj(x).view(num_tokens, h_kv, d), cos, sin)
        return q, k, self.v_proj(x).view(num_tokens, h_kv, d)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D] and sign-folded sin, from `rope_step_tables`
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._qkv(x, cos, sin)
        k_cache.view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, v)

        n_single = meta.num_single
        groups = meta.decode_groups
        # A decode-only step in one call writes the attention output straight into `out` (no extra copy).
        one_call = len(groups) == 1 or (meta.flex is not None and n_single > 0)
        out = None if n_single == num_tokens and one_call else q.new_empty(num_tokens, h, d)
        if meta.flex is not None and n_single:
            paged, block_mask = meta.flex
            o = paged.attend(q[:n_single], k_cache, v_cache, block_mask, self.scale)
            if out is None:
                out = o.contiguous()
            else:
                out[:n_single] = o
        block_shape = k_cache.shape[1:]
        for group in groups:
            n, ids, context = group.num_rows, group.block_ids, group.context_len
            rows = slice(group.row_start, group.row_start + n)
            k_buf, v_buf = meta.workspace.buffers(ids.numel() * k_cache[0].numel(), k_cache)
            ks = torch.index_select(k_cache, 0, ids, out=k_buf.view(-1, *block_shape))
            vs = torch.index_select(v_cache, 0, ids, out=v_buf.view(-1, *block_shape))
            ks = ks.view(n, -1, h_kv, d)[:, :context].transpose(1, 2)  # [B, H_kv, S, D]
            vs = vs.view(n, -1, h_kv, d)[:, :context].transpose(1, 2)
            # GQA as a grouped query: the h / h_kv query heads of one KV head are its "query rows", so the
            # kernel reads each K/V tile once per KV head instead of once per query head.
            qs = q[rows].reshape(n, h_kv, h // h_kv, d)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=group.mask, scale=self.scale)
            if out is None:
                out = o.view(n, h, d)
            else:
                out[rows] = o.view(n, h, d)
        for span in meta.multi:
            n, g = span.num_tokens, span.num_seqs
            rows = slice(span.token_start, span.token_start + g * n)
            qm = q[rows].view(g, n, h, d).transpose(1, 2)  # [g, H, n, D]
            if span.start_pos == 0:
                km = k[rows].view(g, n, h_kv, d).transpose(1, 2)  # [g, H_kv, n, D]
                vm = v[rows].view(g, n, h_kv, d).transpose(1, 2)
                o = F.scaled_dot_product_attention(qm, km, vm, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                context = span.start_pos + n
                # Into the workspace as well (the decode rows above are done with it).
                k_buf, v_buf = meta.workspace.buffers(span.block_table.numel() * k_cache[0].numel(), k_cache)
                km = torch.index_select(k_cache, 0, span.block_table, out=k_buf.view(-1, *k_cache.shape[1:]))
                vm = torch.index_select(v_cache, 0, span.block_table, out=v_buf.view(-1, *v_cache.shape[1:]))
                km = km.view(-1, h_kv, d)[:context].transpose(0, 1).unsqueeze(0)
                vm = vm.view(-1, h_kv, d)[:context].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qm, km, vm, attn_mask=span.mask, scale=self.scale, enable_gqa=True)
            out[rows] = o.transpose(1, 2).reshape(g * n, h, d)
        return self.o_proj.forward(out.view(num_tokens, h * d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        inter_local = cfg.intermediate_size // group.size
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, inter_local)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, inter_local)
        self.down_proj = RowParallelLinear(inter_local, cfg.hidden_size, group)
        self.gate_up_weight: torch.Tensor | None = None  # set by `fuse`

    def fuse(self) -> bool:
        """Use one gate|up matmul when the two weights are adjacent views. True if fused."""
        self.gate_up_weight = fused_view([self.gate_proj.weight, self.up_proj.weight])
        return self.gate_up_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj.forward(F.silu(gate).mul_(up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, group)

    def forward(self, x, cos, sin, meta, k_cache, v_cache) -> torch.Tensor:
        # Submodules' forward is called directly: no hooks are used, and skipping nn.Module.__call__
        # saves a few microseconds per call, which small decode steps notice.
        attn = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, meta, k_cache, v_cache)
        x = x + attn
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


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
        cos: torch.Tensor,  # [T, D] (rope rows for each token's position); [T, 1, D] when prepared
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, H_kv, D]
        rope_prepared: bool = False,  # cos/sin already as `rope_step_tables` makes them (the runner's)
    ) -> torch.Tensor:
        x = self.model.embed_tokens.forward(input_ids)
        if not rope_prepared:
            cos, sin = rope_step_tables(cos, sin)  # layers get [T, 1, D] tables, sin sign-folded
        for index, layer in enumerate(self.model.layers):
            x = layer.forward(x, cos, sin, meta, kv_cache[index, 0], kv_cache[index, 1])
        return self.model.norm.forward(x)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden)  # [N, vocab]


def build_model(cfg: ModelConfig, group: TPGroup, shards: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """Build on the meta device (no memory), then assign this rank's weight views."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, group)
    model.load_state_dict(shards, strict=True, assign=True)
    for name, tensor in model.state_dict().items():
        assert not tensor.is_meta, f"weight {name} was not assigned"
    for layer in model.model.layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()
    return model.eval()


# Per-layer tensors that one matmul can serve when they lie back to back, in this order.
FUSABLE_GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
)


def pack_for_fusion(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The same weights, each layer's q/k/v (and biases) and gate/up re-laid back to back in one buffer
    each, so that a TP=1 model built on them runs fused projections (`fused_view`). Same values, same
    names, same total memory (the separate tensors are released)."""
    packed = dict(weights)
    for layer in range(cfg.num_layers):
        for group in FUSABLE_GROUPS:
            names = [f"model.layers.{layer}.{suffix}" for suffix in group]
            if not all(n in packed for n in names):
                continue
            buffer = torch.cat([packed[n] for n in names])
            row = 0
            for n in names:
                rows = packed[n].shape[0]
                packed[n] = buffer[row : row + rows]
                row += rows
    return packed
