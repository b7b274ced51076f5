"""Token sampling: greedy, temperature, top-k, top-p, with a per-request torch.Generator.

Greedy rows are decided together (argmax); random rows one by one with their own generator, so a
request's draws depend only on its own seed and logits, never on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nitsum.engine.params import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row [V] of fp32 logits -> temperature-scaled logits with top-k/top-p outside set to -inf."""
    scaled = logits / params.temperature
    if torch.isposinf(scaled.max()):
        # A temperature so small that the scaling overflows (several logits become +inf, and softmax
        # would see inf - inf = NaN): its limit is greedy, so keep only the largest unscaled logits.
        return torch.where(logits == logits.max(), 0.0, float("-inf"))
    logits = scaled
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        # A top_p that rounds to 0 in fp32 (e.g. 5e-324) would drop the top token too and leave nothing
        # to sample: the top-1 token is kept whatever top_p is.
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    logits = logits.float().cpu()
    tokens = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        filtered = filter_logits(logits[row], p)
        probs = torch.softmax(filtered, dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generators[row]).item())
    return tokens
