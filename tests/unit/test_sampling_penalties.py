"""Logits processing and logprobs of the sampler, on hand-made logits (OpenAI's / vLLM's definitions)."""

from __future__ import annotations

import pytest
import torch

from nitsum.engine.params import SamplingParams
from nitsum.engine.sampling import NEG_INF_LOGPROB, make_generator, process_logits, sample, sample_detailed

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def test_bias_and_penalties_follow_their_definitions():
    p = SamplingParams(
        logit_bias={0: 1.5, 5: -100.0}, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    history = [1, 3, 2, 2, 3]  # prompt [1, 3]; output [2, 2, 3]
    got = process_logits(LOGITS, p, history, num_prompt=2)
    want = LOGITS.clone()
    want[0] += 1.5
    want[5] -= 100.0
    for t in {1, 3, 2}:  # repetition: prompt and output tokens
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    want[2] -= 0.5 * 2 + 0.25  # frequency x count + presence, output tokens only
    want[3] -= 0.5 * 1 + 0.25
    assert torch.allclose(got, want)


def test_greedy_with_bias_takes_the_biased_argmax_and_reports_its_logprob():
    p = SamplingParams(temperature=0.0, logit_bias={4: 10.0}, logprobs=2)
    [s] = sample_detailed(LOGITS[None], [p], [None], [([0], 1)])
    processed = LOGITS.clone()
    processed[4] += 10.0
    assert s.token == 4
    assert s.logprob == pytest.approx(float(torch.log_softmax(processed, -1)[4]))
    assert [t for t, _ in s.top] == [4, 3]


def test_logprobs_are_of_the_filtered_tempered_distribution_and_draws_do_not_change():
    p = SamplingParams(temperature=0.5, top_k=3, seed=1, logprobs=5)
    plain = SamplingParams(temperature=0.5, top_k=3, seed=1)
    for seed in range(20):
        [s] = sample_detailed(LOGITS[None], [p], [make_generator(seed)])
        [t] = sample(LOGITS[None], [plain], [make_generator(seed)])
        assert s.token == t  # asking for logprobs does not change the draw
        kept = torch.full_like(LOGITS, float("-inf"))
        top3 = torch.topk(LOGITS, 3).indices
        kept[top3] = LOGITS[top3] / 0.5
        ref = torch.log_softmax(kept, -1)
        assert s.logprob == pytest.approx(float(ref[s.token]))
        assert [v for _, v in s.top][3:] == [NEG_INF_LOGPROB, NEG_INF_LOGPROB]  # cut by top-k


def test_bad_params_are_refused():
    for kwargs in (
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {1: 200.0}},
        {"logprobs": 21},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias=[[3, 1]]).logit_bias == ((3, 1.0),)  # a migrated request's lists


def test_min_p_cuts_tokens_below_a_fraction_of_the_top_probability():
    from nitsum.engine.sampling import filter_logits

    p = SamplingParams(temperature=1.0, min_p=0.3)
    probs = torch.softmax(LOGITS, -1)
    kept = torch.isfinite(filter_logits(LOGITS, p))
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()
    assert kept.sum() < len(LOGITS) and kept[3]
