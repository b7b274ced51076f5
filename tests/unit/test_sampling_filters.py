"""Sampling filters and per-request generators (exact)."""

import math

import torch

from nitsum.engine.params import SamplingParams
from nitsum.engine.sampling import filter_logits, make_generator, sample

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.0, -1.0])


def kept(params):
    return [i for i, v in enumerate(filter_logits(LOGITS, params).tolist()) if v != -math.inf]


def test_top_k_keeps_k_largest():
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [1, 2]
    assert kept(SamplingParams(temperature=1.0, top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.softmax(LOGITS, -1)  # sorted: idx1 .6364, idx2 .2341, idx0 .0861, ...
    assert probs[1] > 0.6
    assert kept(SamplingParams(temperature=1.0, top_p=0.5)) == [1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.8)) == [1, 2]
    assert kept(SamplingParams(temperature=1.0, top_p=0.95)) == [0, 1, 2]


def test_temperature_scales():
    out = filter_logits(LOGITS, SamplingParams(temperature=0.5))
    assert torch.equal(out, LOGITS * 2)


def test_greedy_rows_are_argmax_and_seeded_rows_reproducible():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    p = SamplingParams(temperature=1.0, seed=3)
    first = [sample(logits, [SamplingParams(), p], [None, make_generator(3)]) for _ in range(2)]
    assert first[0] == first[1]
    assert first[0][0] == 1
    draws = [sample(logits[1:], [p], [make_generator(3)])[0] for _ in range(3)]
    assert draws == [first[0][1]] * 3


def test_seeded_draw_sequence_is_independent_of_other_rows():
    p = SamplingParams(temperature=1.0)
    gen_a, gen_b = make_generator(11), make_generator(11)
    alone = [sample(LOGITS[None], [p], [gen_a])[0] for _ in range(20)]
    other = make_generator(5)
    batched = [sample(torch.stack([LOGITS, LOGITS]), [p, p], [other, gen_b])[1] for _ in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_top_p_that_rounds_to_zero_keeps_the_top_token():
    # 5e-324 is 0 in fp32: without the guard every token is dropped and softmax gives NaN.
    params = SamplingParams(temperature=1.0, top_p=5e-324)
    assert kept(params) == [1]
    assert sample(LOGITS[None], [params], [make_generator(1)]) == [1]


def test_temperature_that_overflows_the_logits_is_greedy():
    # 1e-45 scales every positive logit to +inf; the limit of a vanishing temperature is the argmax.
    params = SamplingParams(temperature=1e-45)
    assert kept(params) == [1]
    assert sample(LOGITS[None], [params], [make_generator(1)]) == [1]
