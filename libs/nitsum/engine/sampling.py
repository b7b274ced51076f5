"""Token sampling: greedy, temperature, top-k, top-p, with a per-request torch.Generator.

Greedy rows are decided together (argmax); random rows one by one with their own generator, so a
request's draws depend only on its own seed and logits, never on what else is in the batch.

Logits processing, in this order (vLLM's): `logit_bias` is added; then the repetition penalty (a logit of
a token seen in the prompt or the output is divided by it when positive, multiplied when negative); then
the frequency penalty (minus penalty x count of the token in the output) and the presence penalty (minus
penalty once, if the token is in the output); then temperature, top-k and top-p (`filter_logits`).

Logprobs are those of the distribution the token was drawn from: log-softmax of the processed logits
after temperature, top-k, top-p and min-p (tokens they cut have -inf, reported as -9999.0 like vLLM).
`min_tokens` and `response_format` (engine/guided.py) act as masks: the tokens they forbid get -inf first.
A greedy request has no sampling distribution; its logprobs read temperature 0 as 1 (the processed
logits, top-k/top-p applied), so that the argmax token's logprob is the model's, not 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


NEG_INF_LOGPROB = -9999.0  # how a logprob of -inf (a token top-k/top-p cut) is reported (JSON has no -inf)


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None = None  # set when the request asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # the `params.logprobs` most likely (token, logprob), best first


def process_logits(
    logits: torch.Tensor, params: SamplingParams, token_ids: Sequence[int], num_prompt: int
) -> torch.Tensor:
    """One fp32 row [V] with logit_bias and the repetition/frequency/presence penalties applied.
    `token_ids` is the prompt followed by the output so far; the first `num_prompt` are the prompt."""
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(token_ids), dtype=torch.long)] = True
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if (params.frequency_penalty or params.presence_penalty) and len(token_ids) > num_prompt:
        counts = torch.bincount(torch.tensor(list(token_ids[num_prompt:]), dtype=torch.long), minlength=vocab)[
            :vocab
        ].to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample_detailed(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], int] | None] | None = None,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> list[Sampled]:
    """Like `sample`, with logprobs where asked. `histories[row]`: (prompt + output token ids, prompt
    length), needed by rows whose params apply penalties (`SamplingParams.processes_logits`); `masks[row]`:
    bool [V] of the tokens a guided row may take (every other logit becomes -inf before anything else)."""
    logits = logits.float().cpu()
    tokens = logits.argmax(dim=-1).tolist()
    out = [Sampled(t) for t in tokens]
    for row, p in enumerate(params):
        if p.greedy and not p.processes_logits:
            continue
        row_logits = logits[row]
        mask = masks[row] if masks is not None else None
        if mask is not None:
            row_logits = row_logits.masked_fill(~mask, float("-inf"))
        if p.processes_logits:
            history = histories[row] if histories is not None else None
            token_ids, num_prompt = history if history is not None else ((), 0)
            row_logits = process_logits(row_logits, p, token_ids, num_prompt)
        if p.greedy:
            token = int(row_logits.argmax().item())
            filtered = filter_logits(row_logits, replace(p, temperature=1.0)) if p.logprobs is not None else None
        else:
            filtered = filter_logits(row_logits, p)
            probs = torch.softmax(filtered, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generators[row]).item())
        if p.logprobs is None:
            out[row] = Sampled(token)
            continue
        logprobs = torch.log_softmax(filtered, dim=-1)
        top = []
        if p.logprobs:
            values, ids = torch.topk(logprobs, min(p.logprobs, logprobs.shape[-1]))
            top = [(int(i), _finite(float(v))) for i, v in zip(ids.tolist(), values.tolist())]
        out[row] = Sampled(token, _finite(float(logprobs[token].item())), tuple(top))
    return out


def _finite(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def sample(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], int] | None] | None = None,
) -> list[int]:
    return [s.token for s in sample_detailed(logits, params, generators, histories)]
