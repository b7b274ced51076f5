"""Adaptive TP at the engine level: 4 worker processes (gloo on 127.0.0.1), greedy requests of different
lengths in flight across merges (4xTP1 -> TP4, 2xTP2 -> TP4) and splits (TP4 -> 2xTP2 -> 4xTP1).

One scripted run covers the whole chain plus a prepare that fails on one worker (then aborts), a prepare
aborted during its pre-copy and a stale epoch; the assertions are exact: tokens equal a run with no
change, every token index exactly once, weights in use are views of the boot store, no checkpoint byte
read after boot, every KV block free, KV moved through shared memory while the old groups kept decoding
and no KV segment left in /dev/shm. A shorter run checks the gloo point-to-point fallback path.
"""

import os
import tempfile
from pathlib import Path

import pytest
from engine_test_helpers import prompts_of_lengths, run_node_script

from nitsum.engine import Engine, EngineConfig, SamplingParams

WORLD = 4
TP1 = [[0, 1], [1, 1], [2, 1], [3, 1]]
TP2 = [[0, 2], [2, 2]]
TP4 = [[0, 4]]
MIXED = [[0, 2], [2, 1], [3, 1]]
# (request id, leader it arrives at, tick, prompt length, max tokens)
REQUESTS = [
    ("a", 0, 0, 5, 70),
    ("b", 1, 0, 23, 30),
    ("c", 2, 0, 40, 45),
    ("d", 3, 0, 11, 60),
    ("e", 0, 7, 17, 50),
    ("f", 0, 12, 9, 24),
    ("g", 0, 25, 30, 20),
    ("h", 3, 36, 6, 10),
]
TOPOLOGY_EVENTS = [
    (4, "prepare", 1, TP4),
    (6, "commit", 1, None),  # merge 4xTP1 -> TP4 (f arrives between the two)
    (10, "prepare", 2, TP2),
    (13, "commit", 2, None),  # split TP4 -> 2xTP2
    (16, "prepare", 3, TP4),
    (17, "abort", 3, None),  # worker 3 fails during prepare
    (18, "prepare", 2, TP4),  # stale epoch: refused
    (20, "prepare", 4, TP4),
    (22, "commit", 4, None),  # merge 2xTP2 -> TP4
    (24, "prepare", 5, TP1),
    (26, "abort", 5, None),  # aborted while its pre-copy still runs
    (27, "prepare", 6, TP2),
    (29, "commit", 6, None),  # split TP4 -> 2xTP2
    (32, "prepare", 7, TP1),
    (34, "commit", 7, None),  # split 2xTP2 -> 4xTP1
    (38, "prepare", 8, MIXED),
    (40, "commit", 8, None),  # merge 0+1 only: workers 2, 3 stand by
]
FAILING_WORKER, FAILING_EPOCH = 3, 3
BLOCK_SIZE = 8
# Three blocks of one KV head of the tiny model (4 layers x K/V x 8 tokens x 16 dims x fp32 = 4 KiB each): the
# first merge's largest flow (5 full blocks) needs two rounds, so its old groups decode one step in between.
CHUNK_BYTES = 3 * 4096


def make_script(prompts):
    events = [
        {"tick": tick, "kind": "add", "leader": leader, "request_id": rid, "prompt": prompt, "max_tokens": n}
        for (rid, leader, tick, _, n), prompt in zip(REQUESTS, prompts)
    ]
    for tick, kind, epoch, groups in TOPOLOGY_EVENTS:
        event = {"tick": tick, "kind": kind, "epoch": epoch}
        if groups is not None:
            event["groups"] = groups
        events.append(event)
    return {"topology": TP1, "events": events}


def run_node(model_dir, script, tmp_path, shm_dir, kv_path="shm"):
    return run_node_script(
        model_dir,
        script,
        tmp_path,
        WORLD,
        {FAILING_WORKER: ["--fail-prepare-epoch", str(FAILING_EPOCH)]},
        shm_dir=shm_dir,
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        kv_path=kv_path,
        precopy_chunk_bytes=CHUNK_BYTES,
    )


@pytest.fixture(scope="module")
def node_run(tiny_dir, tmp_path_factory):
    prompts = prompts_of_lengths([r[3] for r in REQUESTS], seed=11)
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm_root) as shm_dir:
        reports = run_node(tiny_dir, make_script(prompts), tmp_path_factory.mktemp("node"), Path(shm_dir))
    return prompts, reports


def test_tokens_equal_a_run_without_topology_changes(tiny_dir, node_run):
    prompts, reports = node_run
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=256))
    expected = engine.generate(prompts, [SamplingParams(max_tokens=r[4], ignore_eos=True) for r in REQUESTS])
    records = sorted((r for rep in reports for r in rep["records"]), key=lambda r: (r[1], r[2]))
    got = {rid: [r[3] for r in records if r[1] == rid] for rid, *_ in REQUESTS}
    assert got == {rid: tokens for (rid, *_), tokens in zip(REQUESTS, expected)}
    # The stream view: every index of every request exactly once (no duplicate, no gap), one final record.
    for rid, *_, max_tokens in REQUESTS:
        assert [r[2] for r in records if r[1] == rid] == list(range(max_tokens)), rid
        assert [r[4] for r in records if r[1] == rid].count(True) == 1, rid


def test_requests_were_in_flight_across_every_transition(node_run):
    _, reports = node_run
    records = [r for rep in reports for r in rep["records"]]
    commit_ticks = [t for t, kind, *_ in TOPOLOGY_EVENTS if kind == "commit"]
    for tick in commit_ticks:
        before = {r[1] for r in records if r[0] < tick}
        after = {r[1] for r in records if r[0] >= tick}
        assert len(before & after) >= 3, f"commit at tick {tick}: only {before & after} spanned it"
    # The requests really moved: b began on worker 1 (TP1), went to the TP4 leader 0, then the split
    # placed it on the second TP2 group (led by 2), the lighter one at that moment.
    b_ranks = {rep["rank"] for rep in reports for r in rep["records"] if r[1] == "b"}
    assert b_ranks == {0, 1, 2}


def test_acks_prepare_failure_aborts_and_stale_epoch_is_refused(node_run):
    _, reports = node_run
    leader0 = [(kind, epoch, ok) for _, kind, epoch, ok, *_ in reports[0]["acks"]]
    assert leader0 == [
        ("prepare", 1, True),
        ("commit", 1, True),
        ("prepare", 2, True),
        ("commit", 2, True),
        ("prepare", 3, False),
        ("abort", 3, True),
        ("prepare", 2, False),
        ("prepare", 4, True),
        ("commit", 4, True),
        ("prepare", 5, False),
        ("abort", 5, True),
        ("prepare", 6, True),
        ("commit", 6, True),
        ("prepare", 7, True),
        ("commit", 7, True),
        ("prepare", 8, True),
        ("commit", 8, True),
    ]
    failed = next(a for a in reports[0]["acks"] if a[1] == "prepare" and a[2] == 3)
    assert "worker 3" in failed[4] and "injected failure" in failed[4]
    stale = next(a for a in reports[0]["acks"] if a[1] == "prepare" and a[2] == 2 and not a[3])
    assert "stale epoch 2" in stale[4]
    assert [a[4] for a in reports[0]["acks"] if a[1] == "prepare" and a[2] == 5] == ["aborted during pre-copy"]
    # Every merge and split moved KV between workers both at prepare (full blocks, while the old groups
    # kept decoding) and at commit (the delta); the failed epoch moved nothing, the aborted one only
    # part of its pre-copy (into caches that the abort dropped).
    moved = {
        (phase, e): sum(a[6] for rep in reports for a in rep["acks"] if a[1] == phase and a[2] == e)
        for phase in ("prepare", "commit")
        for e in range(1, 9)
    }
    assert sorted(k for k, n in moved.items() if n > 0) == [("commit", e) for e in (1, 2, 4, 6, 7, 8)] + [
        ("prepare", e) for e in (1, 2, 4, 5, 6, 7, 8)
    ]
    # Bystanders of epoch 8 (outside the span) took no part in its collectives, yet follow its epoch.
    assert [a[4] for rep in reports[2:] for a in rep["acks"] if a[2] == 8] == ["not affected", ""] * 2
    assert [rep["epoch"] for rep in reports] == [8] * WORLD
    assert [rep["final_group"] for rep in reports] == [[0, 2], [0, 2], [2, 1], [3, 1]]


def test_weights_are_views_of_the_boot_store_and_nothing_is_reread(tiny_dir, node_run):
    _, reports = node_run
    checkpoint_bytes = sum(p.stat().st_size for p in Path(tiny_dir).glob("*.safetensors"))
    # One worker of the host read the checkpoint (into the shared store); the others mapped it.
    assert sorted(rep["store_created"] for rep in reports) == [False, False, False, True]
    creator = next(rep for rep in reports if rep["store_created"])
    assert 0.99 * checkpoint_bytes < creator["boot_bytes_read"] <= checkpoint_bytes
    assert [rep["boot_bytes_read"] for rep in reports if not rep["store_created"]] == [0, 0, 0]
    for rep in reports:
        assert [c["label"] for c in rep["checks"]] == ["boot"] + ["commit"] * 6
        assert all(c["views_of_store"] for c in rep["checks"]), rep["checks"]
        assert {c["bytes_read"] for c in rep["checks"]} == {rep["boot_bytes_read"]}
        assert rep["end_bytes_read"] == rep["boot_bytes_read"]
        assert rep["num_groups"] == 4 + 2 + 1  # every aligned group at TP 1, 2, 4, built at boot
    groups = [[c["group"] for c in rep["checks"]] for rep in reports]
    assert groups[2] == [[2, 1], [0, 4], [2, 2], [0, 4], [2, 2], [2, 1], [2, 1]]
    assert groups[1] == [[1, 1], [0, 4], [0, 2], [0, 4], [0, 2], [1, 1], [0, 2]]


def test_a_runner_per_level_is_built_once_and_every_change_reuses_it(node_run):
    """Each worker constructs one runner per allowed level (its own at boot, the others ahead of any change);
    six commits, two failed prepares and an abort construct none: a change swaps runners it already has."""
    _, reports = node_run
    for rep in reports:
        assert {c["runner_builds"] for c in rep["checks"]} == {3}, rep["checks"]
        # ... nor any Engine inside a commit: a new group's leader made its Engine while pre-copy ran.
        assert {c["engines_at_commit"] for c in rep["checks"]} == {0}, rep["checks"]
        by_group: dict[tuple[int, int], set[int]] = {}
        for c in rep["checks"]:
            by_group.setdefault(tuple(c["group"]), set()).add(c["runner_id"])
        assert all(len(ids) == 1 for ids in by_group.values()), by_group  # the same object each time at a level
        assert len({next(iter(ids)) for ids in by_group.values()}) == len(by_group)  # and one per level


def test_every_kv_block_is_free_afterwards(node_run):
    _, reports = node_run
    # check_integrity() ran in every final leader (it raises on a broken invariant: exit code != 0).
    finals = {rep["rank"]: rep.get("final") for rep in reports}
    assert finals == {0: {"free": 64, "total": 64}, 1: None, 2: {"free": 64, "total": 64}, 3: {"free": 64, "total": 64}}


def test_prefill_export_then_decode_import_equals_the_hybrid_path(tiny_dir):
    """The P/D use of the same KV-move primitive: a prefill engine's pinned request, exported (through
    its wire form: header and per-layer bytes) and imported into a decode engine, decodes the hybrid path's greedy tokens."""
    from nitsum.engine.migration import KVExport

    prompts = prompts_of_lengths([21, 8, 37], seed=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cfg = dict(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=32)
    expected = Engine(EngineConfig(**cfg)).generate(prompts, params)
    prefill = Engine(EngineConfig(**cfg, role="prefill"))
    decode = Engine(EngineConfig(**cfg, role="decode"))
    decode.add_request("warm", prompts[0][:5], SamplingParams(max_tokens=3, ignore_eos=True))
    decode.step()  # the pool is not fresh: imported blocks land elsewhere than on the prefill side
    first = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params)
    while prefill.has_unfinished():
        for out in prefill.step():
            first[out.request_id] = list(out.new_token_ids)
    for i in range(len(prompts)):
        sent = prefill.export_kv(f"r{i}")
        export = KVExport.from_layers(sent.header(), {n: sent.layer_bytes(n) for n in range(sent.num_layers)})
        assert export.num_tokens == len(prompts[i])
        assert prefill.release(f"r{i}")
        assert decode.import_request(export)
    got = {rid: list(tokens) for rid, tokens in first.items()}
    while decode.has_unfinished():
        for out in decode.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    prefill.check_integrity()
    decode.check_integrity()
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total
    assert prefill.stats().num_kv_blocks_free == prefill.stats().num_kv_blocks_total


def test_precopy_runs_between_decode_steps_of_the_old_groups(node_run):
    """Epoch 1 (4xTP1 -> TP4, prepare at tick 4, commit at tick 6): worker 2's largest flow has 5 full
    blocks, 3 per chunk, so its pre-copy takes two rounds (ticks 4 and 5) and its group decodes a step
    between them -- before the final prepare ack, not after it."""
    _, reports = node_run
    leader2 = reports[2]
    assert [r[:2] for r in leader2["precopy_rounds"] if r[1] == 1] == [[4, 1], [5, 1]]
    [prepare_ack] = [a for a in leader2["acks"] if a[1] == "prepare" and a[2] == 1]
    assert prepare_ack[0] == 5 and prepare_ack[3] is True
    decoded_during = {r[1] for r in leader2["records"] if 4 <= r[0] < prepare_ack[0]}
    assert decoded_during == {"c"}  # its request produced a token while its KV was being pre-copied
    # Every epoch that got past its prepare exchange pre-copied in rounds on some leader (not all at once
    # in the prepare step); epoch 3 failed at the exchange.
    rounds = {r[1] for rep in reports for r in rep["precopy_rounds"]}
    assert rounds == {1, 2, 4, 5, 6, 7, 8}


def test_kv_moved_through_shared_memory_and_no_segment_is_left(node_run):
    _, reports = node_run
    assert [rep["kv_path"] for rep in reports] == ["shm"] * WORLD
    assert all(rep["bytes_by_path"]["shm"] > 0 and rep["bytes_by_path"]["p2p"] == 0 for rep in reports)
    # The bytes the acks report are exactly what went through shared memory.
    assert [rep["bytes_by_path"]["shm"] for rep in reports] == [sum(a[6] for a in rep["acks"]) for rep in reports]

    # Segment names go once every source mapped them (in prepare): none of an epoch is left once a worker
    # has committed or aborted it. (Workers are not in lockstep: another may already be preparing the next.)
    def up_to(epoch, names):
        return [n for n in names if int(n.rsplit("-e", 1)[1].split("-")[0]) <= epoch]

    for rep in reports:
        # (epoch 8 changes workers 0-1 only: bystanders 2 and 3 commit it without waiting for them)
        in_span = [c for c in rep["checks"][1:] if not (c["epoch"] == 8 and rep["rank"] >= 2)]
        assert [up_to(c["epoch"], c["kv_segments"]) for c in in_span] == [[]] * len(in_span)
        assert len(in_span) >= 5
        assert [[e, up_to(e, names)] for e, names in rep["abort_kv_segments"]] == [[3, []], [5, []]]
        # No descriptor of a segment stays open but the worker's two KV arenas (the cache in use and the spare
        # the next change fills): a reservation made closes its own, and one given up (epoch 3 failed at its
        # exchange, before its reservation started) is closed without being made.
        assert [n for _, n in rep["abort_kv_segment_fds"]] == [0, 0]
        assert {c["kv_segment_fds"] for c in rep["checks"]} == {2}
        assert {c["arenas_held"] for c in rep["checks"]} == {2}
        assert rep["end_kv_segments"] == []  # after the final barrier: nothing at all


P2P_REQUESTS = [("a", 0, 0, 5, 40), ("b", 1, 0, 23, 30), ("c", 2, 0, 40, 35), ("d", 3, 0, 11, 40)]
P2P_EVENTS = [(4, "prepare", 1, TP4), (6, "commit", 1, None), (10, "prepare", 2, TP2), (13, "commit", 2, None)]


def test_gloo_point_to_point_fallback_moves_the_same_tokens(tiny_dir, tmp_path):
    """The fallback path (no shared memory): full blocks move inside the prepare step over gloo."""
    prompts = prompts_of_lengths([r[3] for r in P2P_REQUESTS], seed=11)
    events = [
        {"tick": t, "kind": "add", "leader": leader, "request_id": rid, "prompt": p, "max_tokens": n}
        for (rid, leader, t, _, n), p in zip(P2P_REQUESTS, prompts)
    ]
    events += [{"tick": t, "kind": k, "epoch": e, **({"groups": g} if g else {})} for t, k, e, g in P2P_EVENTS]
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm_root) as shm_dir:
        reports = run_node(tiny_dir, {"topology": TP1, "events": events}, tmp_path, Path(shm_dir), kv_path="p2p")
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=256))
    expected = engine.generate(prompts, [SamplingParams(max_tokens=r[4], ignore_eos=True) for r in P2P_REQUESTS])
    records = sorted((r for rep in reports for r in rep["records"]), key=lambda r: (r[1], r[2]))
    assert {rid: [r[3] for r in records if r[1] == rid] for rid, *_ in P2P_REQUESTS} == dict(
        zip([r[0] for r in P2P_REQUESTS], expected)
    )
    assert [(k, e, ok) for _, k, e, ok, *_ in reports[0]["acks"]] == [
        ("prepare", 1, True),
        ("commit", 1, True),
        ("prepare", 2, True),
        ("commit", 2, True),
    ]
    assert all(rep["kv_path"] == "p2p" and rep["precopy_rounds"] == [] for rep in reports)
    assert all(rep["bytes_by_path"]["p2p"] > 0 and rep["bytes_by_path"]["shm"] == 0 for rep in reports)
    assert sum(a[6] for rep in reports for a in rep["acks"] if a[1] == "prepare") > 0


# A lost abort: epoch 11 (merge 0+1) is prepared on workers 0 and 1, its abort reaches only leaders 2 and 3.
# The next prepare (epoch 12, TP4) finds 0 and 1 still holding epoch 11: they must refuse it *inside* the span's
# exchange, where 2 and 3 already wait, so that all four refuse (a refusal that skipped the exchange left 2 and 3
# there until the world timeout). Epoch 12's abort ends 11 as well, and epoch 13 merges normally.
LOST_ABORT_REQUESTS = [("a", 0, 0, 5, 40), ("b", 1, 0, 23, 30), ("c", 2, 0, 40, 30), ("d", 3, 0, 11, 35)]
LOST_ABORT_EVENTS = [
    {"tick": 3, "kind": "prepare", "epoch": 11, "groups": MIXED},
    {"tick": 5, "kind": "abort", "epoch": 11, "leaders": [2, 3]},
    {"tick": 7, "kind": "prepare", "epoch": 12, "groups": TP4},
    {"tick": 9, "kind": "abort", "epoch": 12},
    {"tick": 11, "kind": "prepare", "epoch": 13, "groups": TP4},
    {"tick": 13, "kind": "commit", "epoch": 13},
]


def test_a_prepare_refused_for_an_epoch_in_progress_still_joins_the_exchange(tiny_dir, tmp_path):
    prompts = prompts_of_lengths([r[3] for r in LOST_ABORT_REQUESTS], seed=13)
    events = [
        {"tick": tick, "kind": "add", "leader": leader, "request_id": rid, "prompt": prompt, "max_tokens": n}
        for (rid, leader, tick, _, n), prompt in zip(LOST_ABORT_REQUESTS, prompts)
    ]
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm_root) as shm_dir:
        reports = run_node(tiny_dir, {"topology": TP1, "events": events + LOST_ABORT_EVENTS}, tmp_path, Path(shm_dir))
    refusals = {rep["rank"]: a[4] for rep in reports for a in rep["acks"] if a[1] == "prepare" and a[2] == 12}
    # Every leader refused epoch 12 and names the workers still holding epoch 11 (it heard them in the exchange).
    assert sorted(refusals) == [0, 1, 2, 3], refusals
    for reason in refusals.values():
        assert "worker 0: epoch 11 is in progress" in reason and "worker 1: epoch 11 is in progress" in reason
    assert [rep["epoch"] for rep in reports] == [13] * WORLD
    assert [rep["final_group"] for rep in reports] == [[0, 4]] * WORLD
    assert reports[0]["final"] == {"free": 64, "total": 64}
    assert all(rep["end_kv_segments"] == [] for rep in reports)
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=256))
    expected = engine.generate(prompts, [SamplingParams(max_tokens=r[4], ignore_eos=True) for r in LOST_ABORT_REQUESTS])
    records = sorted((r for rep in reports for r in rep["records"]), key=lambda r: (r[1], r[2]))
    got = {rid: [r[3] for r in records if r[1] == rid] for rid, *_ in LOST_ABORT_REQUESTS}
    assert got == {rid: tokens for (rid, *_), tokens in zip(LOST_ABORT_REQUESTS, expected)}
