"""Comparing greedy token streams that were produced under different batch compositions.

fp32 logits are not bit-identical across batch sizes, row groupings, fused/unfused projections or TP
degrees (different reduction orders); on the ~27M "mid" checkpoint they differ by up to ~2e-4 (logits
of scale ~9) over 600 tokens. Where the reference's top-2 logits are closer than that, two correct runs
can pick different tokens and their continuations diverge. Measured: `prompts(6, seed=21)`, stream 3,
output token 165: transformers' top-2 margin 7.6e-6 (239 over 108, |logit| max 8.8); the engine picked
239 with all six prompts batched (margin 2.8e-5) and 108 when the stream shared its steps with one other
(margin 1.1e-5 to 1.4e-5 the other way).

So a stream may differ from its reference only at such a near-tie; from there on nothing is compared (the
continuation of another token is another text). Anything else is a bug. See README "Determinism".
"""

from __future__ import annotations

from functools import lru_cache

# A position is a near-tie when the reference's top-2 logit margin is below this fraction of its largest
# |logit| (measured rounding noise across compositions: about 2e-5 of it; the flip seen: 9e-7 of it).
NEAR_TIE = 1e-4
# The same in bf16 (the CUDA default): one bf16 forward's logits are off the fp32 ones by 4-7% of their scale
# (transformers' and nitsum's alike), so two bf16 runs part where the fp32 top-2 margin is a few percent.
# Measured on the tiny checkpoint (CPU, bf16, 24 prompts x 64 tokens, nitsum vs transformers): 21 streams
# parted, at fp32 margins of 0.2% to 2.9% of the scale; 34% of all positions have a margin under 5%.
NEAR_TIE_BF16 = 5e-2


def first_difference(got: list[int], ref: list[int]) -> int | None:
    """Index of the first position where the streams differ (a length difference counts), else None."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            return i
    return None if len(got) == len(ref) else min(len(got), len(ref))


def relative_margins(logits) -> list[float]:
    """(top-1 - top-2) / max |logit| of each row of `logits` [N, vocab]."""
    top = logits.float().topk(2, dim=-1).values
    return ((top[:, 0] - top[:, 1]) / logits.float().abs().amax(dim=-1)).tolist()


@lru_cache(maxsize=2)
def _hf_model(model_dir: str):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_margins(model_dir, prompt: list[int], tokens: list[int]) -> list[float]:
    """Relative top-2 margins of transformers' fp32 logits (one forward over prompt + tokens) at every
    generated position: entry i is the margin of the choice of tokens[i] given prompt + tokens[:i]."""
    import torch

    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([list(prompt) + list(tokens)])).logits[0]
    return relative_margins(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])


def check_greedy(
    model_dir, prompt: list[int], got: list[int], ref: list[int], what: str = "", near_tie: float = NEAR_TIE
) -> int | None:
    """Assert that greedy stream `got` equals `ref` (same prompt, same model), except that it may take
    another token at a near-tie of the reference, after which the rest is not compared. Lengths are the
    caller's to check. Returns the near-tie position where they parted, or None when equal. Free when
    they are equal (transformers is only run on a difference)."""
    n = min(len(got), len(ref))
    first = first_difference(got[:n], ref[:n])
    if first is None:
        return None
    margin = reference_margins(model_dir, prompt, ref[: first + 1])[first]
    assert margin < near_tie, (
        f"{what}: first difference at output token {first} ({got[first]} instead of {ref[first]}), where the "
        f"reference's top-2 logit margin is {margin:.1e} of its scale: not a near-tie (< {near_tie}), a bug"
    )
    return first
