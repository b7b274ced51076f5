"""The engine half of a node-world P/D hand-off (`Engine.handoff_source` / `reserve_handoff` / `adopt_handoff` /
`drop_handoff`), on the real tiny model: a prefill engine's pinned requests, their KV written block for block
into the blocks a decode engine reserved (what `nitsum.node.handoff` does through the arenas), decode the
hybrid path's greedy tokens; a dropped reservation gives its blocks back; a request past its first token when
its engine turns prefill is not pinned (it finishes under the rules it started with)."""

from __future__ import annotations

import pytest
import torch
from engine_test_helpers import prompts_of_lengths

from nitsum.engine import Engine, EngineConfig, SamplingParams

BLOCK_SIZE = 4


def _engines(tiny_dir):
    cfg = dict(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=48)
    return Engine(EngineConfig(**cfg)), Engine(EngineConfig(**cfg, role="prefill")), Engine(EngineConfig(**cfg))


def test_pinned_requests_written_into_reserved_blocks_decode_the_hybrid_tokens(tiny_dir):
    hybrid, prefill, decode = _engines(tiny_dir)
    prompts = prompts_of_lengths([13, 6, 22], seed=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = hybrid.generate(prompts, params)
    decode.add_request("warm", prompts[0][:7], SamplingParams(max_tokens=2, ignore_eos=True))
    decode.step()  # not a fresh pool: the reserved blocks are other ids than the source's
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params)
    while prefill.has_unfinished():
        for out in prefill.step():
            got[out.request_id] = list(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        state, num_tokens, blocks = prefill.handoff_source(f"r{i}")
        assert state["status"] == "pinned" and num_tokens == len(prompt)
        reserved = decode.reserve_handoff(f"r{i}", num_tokens)
        assert reserved is not None and len(reserved) == len(blocks)
        src, dst = prefill.runner.kv_cache, decode.runner.kv_cache
        dst[:, :, torch.tensor(reserved)] = src[:, :, torch.tensor(blocks)]
        assert prefill.release(f"r{i}")
        decode.adopt_handoff(state, num_tokens)
    while decode.has_unfinished():
        for out in decode.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_a_reservation_is_refused_twice_and_a_dropped_one_frees_its_blocks(tiny_dir):
    _, _, decode = _engines(tiny_dir)
    total = decode.stats().num_kv_blocks_free
    assert decode.reserve_handoff("r", 9) is not None
    assert decode.stats().num_kv_blocks_free == total - 3
    with pytest.raises(ValueError, match="duplicate"):
        decode.reserve_handoff("r", 9)
    assert decode.reserve_handoff("big", 10_000) is None  # no room: nothing reserved
    assert decode.drop_handoff("r") and not decode.drop_handoff("r")
    assert decode.stats().num_kv_blocks_free == total
    with pytest.raises(ValueError, match="no reservation"):
        decode.adopt_handoff({"id": "r"}, 9)


def test_a_request_past_its_first_token_when_its_engine_turns_prefill_decodes_to_the_end(tiny_dir):
    hybrid, _, _ = _engines(tiny_dir)
    [prompt] = prompts_of_lengths([11], seed=4)
    hybrid.add_request("old", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = []
    while len(tokens) < 2:
        for out in hybrid.step():
            tokens.extend(out.new_token_ids)
    hybrid.set_role("prefill")  # a role change at a step boundary (a commit)
    hybrid.add_request("new", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    finished = {}
    while hybrid.has_unfinished():
        for out in hybrid.step():
            if out.request_id == "old":
                tokens.extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert len(tokens) == 6 and finished["old"] == "length"
    state, _, _ = hybrid.handoff_source("new")  # the newcomer is pinned at its first token, for its hand-off
    assert state["status"] == "pinned" and len(state["tokens"]) == len(prompt) + 1
