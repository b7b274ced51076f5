"""The tier-aware scheduler order (engine/tiered.py), driven without a model: exact ids, no timing."""

import pytest

from nitsum.engine.params import SamplingParams
from nitsum.engine.scheduler import Scheduler
from nitsum.engine.sequence import Sequence, Status
from nitsum.engine.slo import RequestSlo, StepCostModel
from nitsum.kv import KVCacheManager

INTERACTIVE = dict(tier="interactive", ttft_ms=200.0, tpot_ms=25.0)
BACKGROUND = dict(tier="background", ttft_ms=10_000.0, tpot_ms=100.0)


def make(num_blocks=32, block_size=4, budget=8, max_seqs=8, role="hybrid"):
    return Scheduler(
        KVCacheManager(num_blocks, block_size), max_num_seqs=max_seqs, max_num_batched_tokens=budget, role=role
    )


def seq(rid, n, tier, arrival, first=1, max_tokens=8, **slo):
    s = Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), arrival_index=arrival)
    s.slo = RequestSlo(arrival_ms=float(arrival), **{**tier, **slo})
    return s


def run_step(sched, now_ms=None, next_token=100):
    out = sched.schedule(now_ms)
    sched.update_after_step(out)
    for c in out.chunks:
        if c.sample:
            c.seq.token_ids.append(next_token)
    return [(c.seq.request_id, c.start_pos, c.num_tokens) for c in out.chunks], out


def test_interactive_arrival_overtakes_background_prompt_remaining_chunks():
    s = make(budget=8)
    s.add(seq("bg", 20, BACKGROUND, arrival=0))
    assert run_step(s)[0] == [("bg", 0, 8)]
    s.add(seq("i", 5, INTERACTIVE, arrival=1, first=50))
    # i's deadline (1 + 200) is earlier than bg's (0 + 10 000): it goes first, bg gets what is left.
    assert run_step(s)[0] == [("i", 0, 5), ("bg", 8, 3)]
    # Then i decodes before bg's next chunk.
    assert run_step(s)[0] == [("i", 5, 1), ("bg", 11, 7)]
    s.check_integrity()


def test_background_that_waited_past_an_interactive_deadline_goes_first():
    s = make(budget=8)
    s.add(seq("bg", 4, BACKGROUND, arrival=0, ttft_ms=50.0))  # deadline 50
    s.add(seq("i", 4, INTERACTIVE, arrival=10, first=50))  # deadline 210
    assert run_step(s)[0] == [("bg", 0, 4), ("i", 0, 4)]


def test_step_fits_the_tightest_tpot_of_the_running_requests():
    s = make(budget=64)
    s.step_cost.set_fit(base_ms=1.0, per_token_ms=1.0)
    s.add(seq("i", 4, INTERACTIVE, arrival=0))
    run_step(s)  # i's prompt; i now decodes under a 25 ms TPOT
    s.add(seq("bg", 40, BACKGROUND, arrival=1, first=50))
    # 0.8 * 25 ms = 20 ms -> 19 tokens: i's decode and an 18-token chunk of bg.
    assert run_step(s)[0] == [("i", 4, 1), ("bg", 0, 18)]
    assert run_step(s)[0] == [("i", 5, 1), ("bg", 18, 18)]


def test_background_decodes_beyond_the_tpot_cap_wait_a_step_interactive_never_does():
    s = make(budget=64)
    for rid, arrival in (("b1", 0), ("b2", 1), ("b3", 2)):
        s.add(seq(rid, 2, BACKGROUND, arrival=arrival, first=10 * arrival + 1))
    s.add(seq("i", 2, INTERACTIVE, arrival=3, first=90))
    run_step(s)  # four prompts
    s.step_cost.set_fit(base_ms=0.0, per_token_ms=10.0)  # 20 ms per step allows 2 tokens
    steps, out = run_step(s)
    assert steps == [("i", 2, 1), ("b1", 2, 1)]
    assert out.preempted == ()
    assert {q.request_id for q in s.running} == {"i", "b1", "b2", "b3"}


def test_background_alone_decodes_every_sequence_even_past_the_cap():
    s = make(budget=64)
    for rid, arrival in (("b1", 0), ("b2", 1), ("b3", 2)):
        s.add(seq(rid, 2, BACKGROUND, arrival=arrival, first=10 * arrival + 1))
    run_step(s)
    s.step_cost.set_fit(base_ms=0.0, per_token_ms=100.0)  # cap of 0 tokens at 80 ms
    assert [r for r, _, _ in run_step(s)[0]] == ["b1", "b2", "b3"]


def test_background_preempted_for_an_interactive_request_when_seats_are_full():
    s = make(budget=64, max_seqs=2)
    s.add(seq("b1", 4, BACKGROUND, arrival=0))
    s.add(seq("b2", 4, BACKGROUND, arrival=1, first=20))
    run_step(s)
    s.add(seq("i", 4, INTERACTIVE, arrival=2, first=50))
    steps, out = run_step(s)  # no step cost yet: waiting would miss, so preempt the newest background
    assert [v.request_id for v in out.preempted] == ["b2"]  # its decode chunk is dropped from the step
    assert steps == [("b1", 4, 1), ("i", 0, 4)]
    b2 = next(q for q in s.waiting if q.request_id == "b2")
    assert b2.status is Status.WAITING and b2.num_computed_tokens == 0 and b2.num_preemptions == 1
    s.check_integrity()


def test_interactive_that_can_wait_for_a_finishing_background_does_not_preempt():
    s = make(budget=64, max_seqs=2)
    s.add(seq("b1", 4, BACKGROUND, arrival=0, max_tokens=2))
    s.add(seq("b2", 4, BACKGROUND, arrival=0, first=20, max_tokens=2))
    run_step(s, now_ms=0.0)
    s.step_cost.set_fit(base_ms=1.0, per_token_ms=1.0)
    s.add(seq("far", 4, INTERACTIVE, arrival=0, first=50))  # deadline 200; wait 1 step of 3 ms + 5 ms prefill
    steps, out = run_step(s, now_ms=1.0)
    assert out.preempted == () and [r for r, _, _ in steps] == ["b1", "b2"]
    s.add(seq("near", 4, INTERACTIVE, arrival=0, first=70, ttft_ms=5.0))  # deadline 5: would miss
    steps, out = run_step(s, now_ms=2.0)
    assert [v.request_id for v in out.preempted] == ["b2"]
    assert ("near", 0, 4) in steps


def test_kv_shortage_preempts_background_before_a_newer_interactive_request():
    s = make(num_blocks=3, block_size=4, budget=100)
    s.add(seq("bg", 4, BACKGROUND, arrival=0))
    s.add(seq("i", 4, INTERACTIVE, arrival=1, first=20))
    assert run_step(s)[0] == [("i", 0, 4), ("bg", 0, 4)]
    # Both need a second block, one is free: the plain order would preempt i (newest); here bg goes.
    steps, out = run_step(s)
    assert steps == [("i", 4, 1)]
    assert [v.request_id for v in out.preempted] == ["bg"]
    s.check_integrity()


def test_background_never_preempts_an_interactive_request():
    s = make(num_blocks=2, block_size=4, budget=100)
    s.add(seq("i", 5, INTERACTIVE, arrival=0))
    run_step(s)  # i holds both blocks (its decode still fits in the second)
    s.add(seq("bg", 4, BACKGROUND, arrival=1, first=50, ttft_ms=1.0))  # due at once: still no preemption
    steps, out = run_step(s)
    assert out.preempted == () and steps == [("i", 5, 1)]
    assert [q.request_id for q in s.waiting] == ["bg"]
    s.check_integrity()


def test_requests_without_slo_keep_the_plain_order():
    plain, tiered = make(budget=8), make(budget=8)
    for sched in (plain, tiered):
        sched.add(Sequence("a", list(range(1, 13)), SamplingParams(max_tokens=8), arrival_index=0))
        sched.add(Sequence("b", list(range(50, 53)), SamplingParams(max_tokens=8), arrival_index=1))
    assert not plain.tier_aware
    assert [run_step(plain)[0] for _ in range(3)] == [
        [("a", 0, 8)],
        [("a", 8, 4), ("b", 0, 3)],
        [("a", 12, 1), ("b", 3, 1)],
    ]


def test_step_cost_model_fits_measured_steps():
    model = StepCostModel()
    assert model.fit() is None and model.max_tokens_within(20.0) is None
    model.observe(2, 3.0)
    model.observe(2, 3.0)
    assert model.fit() is None  # one token count: no slope
    model.observe(4, 5.0)
    base, per_token = model.fit()
    assert base == pytest.approx(1.0) and per_token == pytest.approx(1.0)
    assert model.max_tokens_within(10.0) == 9
    # A client may send any finite target (x-slo-tpot-ms: 1e308): no limit, never an overflow.
    assert model.max_tokens_within(1e308) == 1 << 30
    model.set_fit(0.0, 1e-300)
    assert model.max_tokens_within(1e308) is None


def test_request_slo_validation_and_clock_placement():
    with pytest.raises(ValueError, match="tier"):
        RequestSlo(tier="gold", ttft_ms=1.0, tpot_ms=1.0, arrival_ms=0.0)
    with pytest.raises(ValueError, match="ttft_ms"):
        RequestSlo(tier="interactive", ttft_ms=0.0, tpot_ms=1.0, arrival_ms=0.0)
    slo = RequestSlo.from_unix("interactive", 200.0, 25.0, arrival_unix_ms=9_950.0, now_unix_ms=10_000.0, now_ms=500.0)
    assert slo.arrival_ms == 450.0 and slo.deadline_ms == 650.0
    skewed = RequestSlo.from_unix(
        "background", 10.0, 25.0, arrival_unix_ms=20_000.0, now_unix_ms=10_000.0, now_ms=500.0
    )
    assert skewed.arrival_ms == 500.0
