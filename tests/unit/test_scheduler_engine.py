"""The engine scheduler, driven without a model (pure Python, exact decisions)."""

from nitsum.engine.params import SamplingParams
from nitsum.engine.scheduler import Scheduler
from nitsum.engine.sequence import Sequence, Status
from nitsum.kv import KVCacheManager


def make(num_blocks=16, block_size=4, budget=8, max_seqs=8, role="hybrid"):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, role=role)


def seq(rid, n, arrival=0, first=1):
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=8), arrival_index=arrival)


def run_step(sched, next_token=100):
    """Schedule, pretend the forward ran, append a token for sampled chunks; returns [(id, start, n)]."""
    out = sched.schedule()
    sched.update_after_step(out)
    for c in out.chunks:
        if c.sample:
            c.seq.token_ids.append(next_token)
    return [(c.seq.request_id, c.start_pos, c.num_tokens) for c in out.chunks], out


def test_chunked_prefill_respects_token_budget_and_decodes_first():
    s = make(budget=8)
    a, b = seq("a", 12), seq("b", 3, first=50)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 0, 8)]
    # a's second chunk (4) then b's whole prompt (3) share the next step's budget.
    assert run_step(s)[0] == [("a", 8, 4), ("b", 0, 3)]
    steps, out = run_step(s)
    assert steps == [("a", 13 - 1, 1), ("b", 3, 1)]
    assert [c.num_prefill_tokens for c in out.chunks] == [0, 0]
    s.check_integrity()


def test_max_num_seqs_limits_admission():
    s = make(budget=100, max_seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}", 2, first=10 * i + 1))
    assert [r for r, _, _ in run_step(s)[0]] == ["r0", "r1"]
    assert [q.request_id for q in s.waiting] == ["r2"]


def test_preempts_newest_running_when_kv_is_full_and_recomputes_later():
    s = make(num_blocks=3, block_size=4, budget=100)
    a, b = seq("a", 4), seq("b", 4, first=20)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 0, 4), ("b", 0, 4)]
    # Each now needs a second block; only one is free: a gets it, b (newest) is preempted.
    steps, out = run_step(s)
    assert steps == [("a", 4, 1)]
    assert [v.request_id for v in out.preempted] == ["b"]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [q.request_id for q in s.waiting] == ["b"]
    s.check_integrity()
    # When a finishes, b is readmitted: its first full block is a prefix-cache hit.
    s.finish(a)
    steps, _ = run_step(s)
    assert steps == [("b", 4, 1)]
    assert s.num_preemptions == 1
    s.check_integrity()


def test_request_that_preempts_itself_goes_back_to_waiting():
    s = make(num_blocks=2, block_size=4, budget=100)
    a = seq("a", 8)
    s.add(a)
    run_step(s)
    steps, out = run_step(s)  # needs a third block: nobody else to preempt
    assert steps == [] and [v.request_id for v in out.preempted] == ["a"]
    assert a.status is Status.WAITING
    s.check_integrity()


def test_prefix_hit_at_admission_skips_cached_tokens():
    s = make(budget=100)
    a = seq("a", 9)
    s.add(a)
    run_step(s)
    s.finish(a)
    b = seq("b", 9)  # same tokens
    s.add(b)
    steps, out = run_step(s)
    assert steps == [("b", 8, 1)]
    assert b.num_cached_prompt_tokens == 8 and s.num_cached_prompt_tokens == 8
    assert out.chunks[0].num_prefill_tokens == 1


def test_prefill_role_pins_until_release():
    s = make(role="prefill", budget=100)
    a = seq("a", 5)
    s.add(a)
    run_step(s)
    s.pin(a)
    assert not s.has_unfinished() and a.status is Status.PINNED
    assert s.kv.num_free_blocks == 16 - 2
    assert s.release("a") is True and s.release("a") is False
    assert s.kv.num_free_blocks == 16
    s.check_integrity()


def test_decode_role_admits_cold_prompt_only_when_idle_and_warm_prompt_at_once():
    s = make(role="decode", budget=100, num_blocks=32)
    warm_src = seq("src", 13, first=1)
    s.add(warm_src)
    run_step(s)  # idle engine: a cold prompt is admitted
    assert warm_src.status is Status.RUNNING
    cold = seq("cold", 13, first=200)
    warm = seq("warm", 13, first=1)  # same prompt as src: 12 of 13 tokens cached
    s.add(cold)
    s.add(warm)
    steps, _ = run_step(s)
    assert steps == [("src", 13, 1), ("warm", 12, 1)]
    assert [q.request_id for q in s.waiting] == ["cold"]
    s.finish(warm_src)
    s.finish(warm)
    steps, _ = run_step(s)
    assert steps == [("cold", 0, 13)]


def test_abort_frees_blocks_in_any_state():
    s = make(budget=4)
    a, b = seq("a", 6), seq("b", 6, first=30)
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.abort("a") is a and s.abort("b") is b and s.abort("zz") is None
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()
    s.check_integrity()


def test_scheduler_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, nitsum.engine.scheduler; assert 'torch' not in sys.modules, 'scheduler imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
