"""Engine behaviour on the tiny model: batching invariance, preemption, prefix cache, sampling, roles."""

import pytest
from engine_test_helpers import prompts_of_lengths

from nitsum.engine import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(EngineConfig(model_dir=str(tiny_dir), max_num_batched_tokens=64))


def test_batching_invariance_alone_vs_batch_of_8(engine):
    prompts = prompts_of_lengths([3, 50, 17, 1, 33, 64, 9, 120])
    alone = [engine.generate([p], GREEDY)[0] for p in prompts]
    together = engine.generate(prompts, GREEDY)
    assert together == alone
    assert all(len(t) == 24 for t in together)
    engine.check_integrity()


def test_preemption_under_kv_pressure_keeps_outputs(tiny_dir, engine):
    prompts = prompts_of_lengths([40, 35, 30, 45], seed=2)
    expected = engine.generate(prompts, GREEDY)
    # 12 blocks of 16 tokens cannot hold four ~64-token sequences at once.
    small = Engine(EngineConfig(model_dir=str(tiny_dir), num_kv_blocks=12, enable_prefix_caching=False))
    assert small.generate(prompts, GREEDY) == expected
    assert small.stats().num_preemptions > 0
    small.check_integrity()
    assert small.stats().num_kv_blocks_free == 12


def test_prefix_cache_hit_same_output_fewer_prefill_tokens(tiny_dir):
    engine = Engine(EngineConfig(model_dir=str(tiny_dir)))
    [prompt] = prompts_of_lengths([70], seed=3)
    first = engine.generate([prompt], GREEDY)
    computed_cold = engine.stats().num_prefill_tokens_computed
    assert computed_cold == 70
    engine.add_request("again", prompt, GREEDY)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == first[0]
    stats = engine.stats()
    assert stats.num_prefill_tokens_computed - computed_cold == 70 - 64
    assert stats.num_cached_prompt_tokens == 64
    assert outputs[0].num_cached_prompt_tokens == 64 and outputs[0].num_prompt_tokens == 70
    assert len(stats.cached_block_hashes) > 0
    engine.check_integrity()


def test_no_prefix_caching_recomputes(tiny_dir):
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), enable_prefix_caching=False))
    [prompt] = prompts_of_lengths([40], seed=3)
    engine.generate([prompt, prompt], SamplingParams(max_tokens=2))
    assert engine.stats().num_prefill_tokens_computed == 80
    assert engine.stats().num_cached_prompt_tokens == 0


def test_seeded_sampling_reproducible_and_batch_independent(engine):
    prompts = prompts_of_lengths([5, 20, 11], seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([prompts[1]], params)[0]
    mixed = engine.generate(prompts, [GREEDY, params, SamplingParams(max_tokens=5, temperature=1.0, seed=7)])
    assert mixed[1] == alone
    other_seed = engine.generate([prompts[1]], SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True))
    assert other_seed[0] != alone


def test_step_outputs_stream_text_and_finish_length(engine):
    prompt = engine.tokenizer.encode("hello")
    engine.add_request("s1", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].finish_reason == "length"
    ids = [t for o in outs for t in o.new_token_ids]
    assert "".join(o.text_delta for o in outs) == engine.tokenizer.decode(ids)


def test_stop_token_ids_and_stop_strings(engine):
    prompt = prompts_of_lengths([12], seed=5)[0]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_at = free_run[6]
    first_index = free_run.index(stop_at)
    got = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop_at,)))[0]
    assert got == free_run[: first_index + 1]

    text_free = engine.tokenizer.decode(free_run)
    stop = text_free[3:5] if len(text_free) >= 5 else text_free[:1]
    engine.add_request("st", prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    text = "".join(o.text_delta for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert text == text_free[: text_free.index(stop)]
    assert stop not in text


def test_add_request_validation(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match="exceeds the model's maximum context of 2048"):
        engine.add_request("long", [1] * 2040, SamplingParams(max_tokens=16))
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="duplicate request id 'dup'"):
        engine.add_request("dup", [1, 2], GREEDY)
    assert engine.abort("dup") is True and engine.abort("dup") is False
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="role"):
        EngineConfig(model_dir="x", role="both")


def test_abort_mid_generation_frees_kv(engine):
    engine.add_request("ab", prompts_of_lengths([30])[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_running == 1
    assert engine.abort("ab") is True
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_prefill_role_emits_first_token_and_pins_kv(tiny_dir, engine):
    [prompt] = prompts_of_lengths([40], seed=6)
    hybrid_first = engine.generate([prompt], GREEDY)[0][0]
    pre = Engine(EngineConfig(model_dir=str(tiny_dir), role="prefill"))
    pre.add_request("p", prompt, GREEDY)
    outs = pre.step()
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outs] == [((hybrid_first,), True, "length")]
    stats = pre.stats()
    assert stats.num_pinned == 1 and stats.num_kv_blocks_free == stats.num_kv_blocks_total - 3
    assert not pre.has_unfinished()
    assert pre.release("p") is True
    pre.check_integrity()
