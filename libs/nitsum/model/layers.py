"""Explicit tensor-parallel layers (Megatron style): each layer holds its own shard and runs its
collective inside `forward`. With a TP=1 group every collective is the identity.

Built on the meta device; the loader assigns real (view) tensors with `load_state_dict(assign=True)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nitsum.parallel import TPGroup


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local.T: output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features_local: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features_local, in_features)
        self.bias = _param(out_features_local) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local.T) (+ bias once): input features split across ranks."""

    def __init__(self, in_features_local: int, out_features: int, group: TPGroup, bias: bool = False) -> None:
        super().__init__()
        self.group = group
        self.weight = _param(out_features, in_features_local)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
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
        return self.group.all_gather(F.linear(hidden, self.weight), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as the reference does), scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
