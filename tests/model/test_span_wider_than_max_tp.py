"""A node whose max_tp is below its size (4 workers, NITSUM_MAX_TP=2): the boot exchange spans the whole
world and a change of both TP2 groups spans all four workers, wider than any TP level. Both need a
communicator the world pre-builds at boot (before: KeyError (0, 4) at NodeRuntime construction).

Scripted run (node_run, greedy, requests in flight): 4xTP1 -> 2xTP2 (span: all four) -> 4xTP1 -> 2xTP2,
tokens equal a run without changes."""

import pytest
from engine_test_helpers import prompts_of_lengths, run_node_script

from nitsum.engine import Engine, EngineConfig, SamplingParams

WORLD, MAX_TP, BLOCK_SIZE = 4, 2, 8
TP1 = [[0, 1], [1, 1], [2, 1], [3, 1]]
TP2 = [[0, 2], [2, 2]]
# (request id, leader it arrives at, tick, prompt length, max tokens)
REQUESTS = [("a", 0, 0, 5, 40), ("b", 1, 0, 19, 30), ("c", 2, 0, 33, 36), ("d", 3, 0, 9, 28), ("e", 0, 9, 12, 20)]
EVENTS = [
    (3, "prepare", 1, TP2),
    (5, "commit", 1, None),
    (11, "prepare", 2, TP1),
    (13, "commit", 2, None),
    (17, "prepare", 3, TP2),
    (19, "commit", 3, None),
]


@pytest.mark.slow
def test_changes_spanning_more_than_max_tp(tiny_dir, tmp_path):
    prompts = prompts_of_lengths([r[3] for r in REQUESTS], seed=31)
    events = [
        {"tick": tick, "kind": "add", "leader": leader, "request_id": rid, "prompt": prompt, "max_tokens": n}
        for (rid, leader, tick, _, n), prompt in zip(REQUESTS, prompts)
    ]
    events += [{"tick": t, "kind": k, "epoch": e, **({"groups": g} if g else {})} for t, k, e, g in EVENTS]
    reports = run_node_script(
        tiny_dir,
        {"topology": TP1, "events": events},
        tmp_path,
        WORLD,
        max_tp=MAX_TP,
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
    )
    assert all(rep["num_groups"] == 4 + 2 for rep in reports)  # TP levels 1 and 2 (the span group not counted)
    assert [(kind, epoch, ok) for _, kind, epoch, ok, *_ in reports[0]["acks"]] == [
        (kind, epoch, True) for _, kind, epoch, _ in EVENTS
    ]
    assert [rep["final_group"] for rep in reports] == [[0, 2], [0, 2], [2, 2], [2, 2]]
    records = sorted((r for rep in reports for r in rep["records"]), key=lambda r: (r[1], r[2]))
    got = {rid: [r[3] for r in records if r[1] == rid] for rid, *_ in REQUESTS}
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=256))
    expected = engine.generate(prompts, [SamplingParams(max_tokens=r[4], ignore_eos=True) for r in REQUESTS])
    assert got == {rid: tokens for (rid, *_), tokens in zip(REQUESTS, expected)}
    for tick in [t for t, kind, *_ in EVENTS if kind == "commit"]:  # requests were decoding across each
        assert {r[1] for r in records if r[0] < tick} & {r[1] for r in records if r[0] >= tick}, tick
