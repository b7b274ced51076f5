"""Tier-aware scheduling in the real engine (tiny model): order of first tokens, tokens unchanged, the SLO
carried through an export/import (P/D hand-off)."""

from engine_test_helpers import prompts_of_lengths

from nitsum.engine.engine import Engine
from nitsum.engine.params import EngineConfig, SamplingParams
from nitsum.engine.slo import RequestSlo


def engine_of(tiny_dir, **kw):
    return Engine(EngineConfig(model_dir=str(tiny_dir), max_num_batched_tokens=32, num_kv_blocks=64, **kw))


def first_token_steps(engine, ids):
    """Step until all finish; the step index of each request's first token, and every request's tokens."""
    first, tokens, step = {}, {rid: [] for rid in ids}, 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            tokens[out.request_id] += list(out.new_token_ids)
            first.setdefault(out.request_id, step)
    return first, tokens


def test_interactive_prompt_overtakes_a_long_background_prompt(tiny_dir):
    long_bg, short_i = prompts_of_lengths([96, 8])
    params = SamplingParams(max_tokens=4)
    plain, tiered = engine_of(tiny_dir), engine_of(tiny_dir)
    now = tiered.now_ms()
    plain.add_request("bg", long_bg, params)
    plain.add_request("i", short_i, params)
    tiered.add_request("bg", long_bg, params, RequestSlo("background", 10_000.0, 100.0, arrival_ms=now))
    tiered.add_request("i", short_i, params, RequestSlo("interactive", 200.0, 25.0, arrival_ms=now))
    plain_first, plain_tokens = first_token_steps(plain, ["bg", "i"])
    tiered_first, tiered_tokens = first_token_steps(tiered, ["bg", "i"])
    # Plain order: i waits for bg's three 32-token chunks; tier-aware: i's prompt runs in the first step.
    assert plain_first["i"] >= 3 and tiered_first["i"] == 1
    assert tiered_first["i"] < tiered_first["bg"]
    assert tiered_tokens == plain_tokens
    tiered.check_integrity()


def test_slo_travels_with_an_exported_request(tiny_dir):
    (prompt,) = prompts_of_lengths([12])
    src, dst = engine_of(tiny_dir, role="prefill"), engine_of(tiny_dir)
    slo = RequestSlo("interactive", 200.0, 25.0, arrival_ms=src.now_ms() - 50.0)
    src.add_request("r", prompt, SamplingParams(max_tokens=3), slo)
    while src.has_unfinished():
        src.step()
    assert dst.import_request(src.export_kv("r"))
    moved = dst.export_states()[0]["slo"]
    assert moved["tier"] == "interactive" and moved["ttft_ms"] == 200.0 and moved["tpot_ms"] == 25.0
    assert moved["age_ms"] >= 50.0  # arrival kept relative to now, whatever the two clocks
    assert dst.scheduler.tier_aware
