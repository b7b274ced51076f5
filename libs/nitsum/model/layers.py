"""Explicit tensor-parallel layers (Megatron style): each layer holds its own shard and runs its
collective inside `forward`. With a TP=1 group every collective is the identity.

Built on the meta device; the loader assigns real (view) tensors with `load_state_dict(assign=True)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nitsum.parallel import TPGroup


def _onednn_linear_op():
    try:
        op = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None
    return op if torch.backends.mkldnn.is_available() else None


_ONEDNN_LINEAR = _onednn_linear_op()
# Below this many multiply-adds oneDNN's fixed per-call cost (~10 us) outweighs its faster kernel.
ONEDNN_MIN_MACS = 1 << 21
_linear_backend = "auto"


def set_linear_backend(name: str) -> None:
    """Backend of `linear`: "auto" = oneDNN's linear for large enough fp32 CPU matmuls, else `F.linear`;
    "torch" = always `F.linear` (what transformers runs; the benchmark uses it to tell kernel gains from
    engine gains)."""
    global _linear_backend
    if name not in ("auto", "torch"):
        raise ValueError(f"linear backend must be 'auto' or 'torch', got {name!r}")
    _linear_backend = name


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. Why not always `F.linear`: on CPU it runs torch's default BLAS (MKL), which
    on the AMD EPYC machines we measured is about half as fast as oneDNN's kernel for the 8-1024-row
    matmuls of decode and prefill (the kernel torch.compile's CPU backend picks). oneDNN reads the weight
    as it is (no packed copy), so weights stay views of the shared store; results agree to fp32 rounding."""
    if (
        _ONEDNN_LINEAR is not None
        and _linear_backend == "auto"
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and x.dim() == 2
        and x.shape[0] * weight.shape[0] * weight.shape[1] >= ONEDNN_MIN_MACS
    ):
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local.T: output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features_local: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features_local, in_features)
        self.bias = _param(out_features_local) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local.T) (+ bias once): input features split across ranks."""

    def __init__(self, in_features_local: int, out_features: int, group: TPGroup, bias: bool = False) -> None:
        super().__init__()
        self.group = group
        self.weight = _param(out_features, in_features_local)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds vocab rows [rank*V/tp, (rank+1)*V/tp); other ids contribute zeros, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab_per_rank = vocab_size // group.size
        self.vocab_start = group.rank * self.vocab_per_rank
        self.weight = _param(self.vocab_per_rank, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    """logits = all_gather(h @ W_local.T) over the vocab dimension (rank order = vocab order)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = _param(vocab_size // group.size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(linear(hidden, self.weight), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel, the same arithmetic as below when nothing needs casting (and 2x faster on
            # small batches, where the step is op-dispatch bound).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 (as the reference does), scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
