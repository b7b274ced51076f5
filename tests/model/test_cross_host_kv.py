"""KV migration of TP changes across hosts: 4 worker processes of one node world on this machine, split into
two "hosts" by their host ids (workers 0, 1 | 2, 3; NITSUM_HOST_ID through node_run's --host-id), so that
pairs on one host move KV through shared memory and pairs across the two over the TCP data plane.

One scripted run with greedy requests of different lengths in flight: 4xTP1 -> TP4, TP4 -> 2xTP2, a merge
2xTP2 -> TP4 whose prepare fails because worker 0's KV receiver drops every connection of that epoch
(--fail-kv-connect-epoch), then the same merge again, and TP4 -> 4xTP1. The assertions are exact: tokens
equal a run with no change, the TCP bytes are the plans' cross-host bytes and shared memory carried only
same-host pairs, every pair's TCP KV link opened in prepare in the stage-M (delta) class and its scripted
pre-copy -- no flow-scheduler, so no permit -- went in the lowest level's class, every KV block is free at the
end, and no socket, receiver thread or /dev/shm segment outlives a transition. (tests/unit/test_kv_classes.py
checks chunk by chunk, on real sockets, that a permitted level's bytes go in that level's class.)
"""

import os
import tempfile
from pathlib import Path

import pytest
from engine_test_helpers import prompts_of_lengths, run_node_script

from nitsum.engine import Engine, EngineConfig, SamplingParams
from nitsum.policy.flows import tos_for_dscp
from nitsum.transfer.kv_tcp import LOWEST_DSCP, STAGE_M_DSCP

WORLD = 4
HOSTS = ["host-a", "host-a", "host-b", "host-b"]
TP1 = [[0, 1], [1, 1], [2, 1], [3, 1]]
TP2 = [[0, 2], [2, 2]]
TP4 = [[0, 4]]
# (request id, leader it arrives at, tick, prompt length, max tokens)
REQUESTS = [
    ("a", 0, 0, 5, 60),
    ("b", 1, 0, 23, 30),
    ("c", 2, 0, 40, 45),
    ("d", 3, 0, 11, 52),
    ("e", 0, 7, 17, 40),
    ("f", 0, 11, 9, 30),
    ("g", 2, 18, 30, 20),
    ("h", 0, 24, 6, 14),
]
FAILING_EPOCH, REFUSING_WORKER = 3, 0
TOPOLOGY_EVENTS = [
    (4, "prepare", 1, TP4),
    (6, "commit", 1, None),  # 4xTP1 -> TP4
    (10, "prepare", 2, TP2),
    (13, "commit", 2, None),  # TP4 -> 2xTP2
    (16, "prepare", 3, TP4),
    (17, "abort", 3, None),  # worker 0's receiver drops epoch 3's connections
    (20, "prepare", 4, TP4),
    (22, "commit", 4, None),  # 2xTP2 -> TP4
    (26, "prepare", 5, TP1),
    (29, "commit", 5, None),  # TP4 -> 4xTP1
]
COMMITTED = (1, 2, 4, 5)
BLOCK_SIZE = 8
CHUNK_BYTES = 2 * 4096  # two blocks of one KV head: flows take several chunks (and rounds)


def make_script(prompts, requests=REQUESTS, topology_events=TOPOLOGY_EVENTS):
    events = [
        {"tick": tick, "kind": "add", "leader": leader, "request_id": rid, "prompt": prompt, "max_tokens": n}
        for (rid, leader, tick, _, n), prompt in zip(requests, prompts)
    ]
    events += [{"tick": t, "kind": k, "epoch": e, **({"groups": g} if g else {})} for t, k, e, g in topology_events]
    return {"topology": TP1, "events": events}


def tokens_of(reports, requests):
    records = sorted((r for rep in reports for r in rep["records"]), key=lambda r: (r[1], r[2]))
    for rid, *_, max_tokens in requests:
        assert [r[2] for r in records if r[1] == rid] == list(range(max_tokens)), rid
    return {rid: [r[3] for r in records if r[1] == rid] for rid, *_ in requests}


def reference_tokens(tiny_dir, prompts, requests):
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=256))
    expected = engine.generate(prompts, [SamplingParams(max_tokens=r[4], ignore_eos=True) for r in requests])
    return {rid: tokens for (rid, *_), tokens in zip(requests, expected)}


def run_node(model_dir, script, tmp_path, shm_dir, extra_args):
    return run_node_script(
        model_dir,
        script,
        tmp_path,
        WORLD,
        lambda rank: ["--host-id", HOSTS[rank], *extra_args.get(rank, [])],
        shm_dir=shm_dir,
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        precopy_chunk_bytes=CHUNK_BYTES,
    )


@pytest.fixture(scope="module")
def cross_host_run(tiny_dir, tmp_path_factory):
    prompts = prompts_of_lengths([r[3] for r in REQUESTS], seed=23)
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm_root) as shm_dir:
        reports = run_node(
            tiny_dir,
            make_script(prompts),
            tmp_path_factory.mktemp("cross"),
            Path(shm_dir),
            {REFUSING_WORKER: ["--fail-kv-connect-epoch", str(FAILING_EPOCH)]},
        )
    return prompts, reports


@pytest.mark.slow
def test_tokens_equal_a_run_without_topology_changes(tiny_dir, cross_host_run):
    prompts, reports = cross_host_run
    assert tokens_of(reports, REQUESTS) == reference_tokens(tiny_dir, prompts, REQUESTS)
    # Several requests were in flight across every commit.
    records = [r for rep in reports for r in rep["records"]]
    for tick in [t for t, kind, *_ in TOPOLOGY_EVENTS if kind == "commit"]:
        before = {r[1] for r in records if r[0] < tick}
        after = {r[1] for r in records if r[0] >= tick}
        assert len(before & after) >= 3, f"commit at tick {tick}: only {before & after} spanned it"


@pytest.mark.slow
def test_acks_and_a_refused_connection_keeps_the_old_topology(cross_host_run):
    _, reports = cross_host_run
    leader0 = [(kind, epoch, ok) for _, kind, epoch, ok, *_ in reports[0]["acks"]]
    assert leader0 == [
        ("prepare", 1, True),
        ("commit", 1, True),
        ("prepare", 2, True),
        ("commit", 2, True),
        ("prepare", 3, False),
        ("abort", 3, True),
        ("prepare", 4, True),
        ("commit", 4, True),
        ("prepare", 5, True),
        ("commit", 5, True),
    ]
    # Epoch 3: sources 2 and 3 (host b) could not reach worker 0's new cache; every member refused it.
    for rep in reports:
        [refused] = [a for a in rep["acks"] if a[1] == "prepare" and a[2] == FAILING_EPOCH]
        assert refused[3] is False and "cannot reach a new KV cache on another host" in refused[4], refused
        assert "worker 2" in refused[4] and "worker 3" in refused[4]
        assert refused[6] == 0
    # Meanwhile the old 2xTP2 groups (leaders 0 and 2) kept decoding.
    leaders = {rep["rank"] for rep in reports for r in rep["records"] if 16 <= r[0] < 22}
    assert leaders == {0, 2}
    assert [rep["final_group"] for rep in reports] == TP1 and [rep["epoch"] for rep in reports] == [5] * WORLD


@pytest.mark.slow
def test_tcp_carried_exactly_the_cross_host_bytes_and_shm_only_same_host_pairs(cross_host_run):
    _, reports = cross_host_run
    assert [rep["hosts"] for rep in reports] == [HOSTS] * WORLD
    assert [rep["kv_path"] for rep in reports] == ["shm"] * WORLD
    for rep in reports:
        pairs = rep["kv_pairs"]  # (epoch, src, dst, path, bytes) of every flow this worker was given
        assert pairs and {p[1] for p in pairs} == {rep["rank"]}
        assert all(p[3] == ("tcp" if HOSTS[p[1]] != HOSTS[p[2]] else "shm") for p in pairs), pairs
        assert {p[0] for p in pairs} <= set(COMMITTED)
        cross = sum(p[4] for p in pairs if HOSTS[p[1]] != HOSTS[p[2]])
        same = sum(p[4] for p in pairs if HOSTS[p[1]] == HOSTS[p[2]])
        moved = rep["bytes_by_path"]
        assert moved == {"tcp": cross, "shm": same, "p2p": 0}, (rep["rank"], moved)
        assert moved == rep["planned_by_path"]
        assert cross > 0 and same > 0
        # The acks report what moved: pre-copy (final prepare acks) plus the deltas.
        assert sum(a[6] for a in rep["acks"]) == cross + same
    # Every committed epoch moved bytes across the hosts (pre-copy and/or delta).
    assert {p[0] for rep in reports for p in rep["kv_pairs"] if p[3] == "tcp"} == set(COMMITTED)


@pytest.mark.slow
def test_tcp_links_carry_the_delta_class_and_the_unpermitted_precopy_the_lowest(cross_host_run):
    _, reports = cross_host_run
    stage_m, lowest = tos_for_dscp(STAGE_M_DSCP), tos_for_dscp(LOWEST_DSCP)
    for rep in reports:
        tos = rep["kv_tos"]  # the IP_TOS of every KV connection this worker opened, in order
        # Every worker pre-copied across hosts (epoch 1: all four hold requests at prepare) without a permit.
        assert set(tos) == {stage_m, lowest}, rep["rank"]
        # A pre-copy class is opened on a pair whose link prepare opened in the delta's class: never more often.
        assert tos.count(lowest) <= tos.count(stage_m) and tos[0] == stage_m, (rep["rank"], tos)


@pytest.mark.slow
def test_every_block_free_and_nothing_outlives_a_transition(cross_host_run):
    _, reports = cross_host_run
    # check_integrity() ran in every final leader (it raises on a broken invariant: exit code != 0).
    assert [rep.get("final") for rep in reports] == [{"free": 64, "total": 64}] * WORLD
    for rep in reports:
        commits = [c for c in rep["checks"] if c["label"] == "commit"]
        assert len(commits) == len(COMMITTED)
        assert [c["kv_data_plane"] for c in commits] == [[0, 0]] * len(commits)  # no link, no receiver thread
        assert [d for *_, d in rep["failed_kv_data_plane"]] == [[0, 0]] * len(rep["failed_kv_data_plane"])
        assert len(rep["failed_kv_data_plane"]) == 2  # the refused prepare and its abort
        assert rep["abort_kv_segments"] == [[FAILING_EPOCH, []]]
        assert rep["end_kv_segments"] == [] and rep["end_kv_data_plane"] == [0, 0]


# Links that break: worker 0's receiver refuses every chunk of epochs 1 and 2 (4xTP1 -> TP4) after the hellos.
# Epoch 1: workers 2 and 3 hold nothing at prepare, so no pre-copy chunk goes to worker 0 over TCP and every
# prepare ack is ok; request c arrives at worker 2 between prepare and commit, so the commit's *delta* sends its
# blocks to worker 0, which refuses them: every worker refuses the commit. Epoch 2: now 2 and 3 hold requests,
# their *pre-copy* chunks to worker 0 fail, their final prepare acks fail, and the scripted commit is refused by
# every worker. The old TP1 groups keep serving throughout; epoch 3 merges.
BROKEN_REQUESTS = [("a", 0, 0, 7, 50), ("b", 1, 0, 23, 44), ("c", 2, 4, 40, 34), ("d", 3, 8, 18, 30)]
BROKEN_EVENTS = [
    (3, "prepare", 1, TP4),
    (6, "commit", 1, None),
    (9, "prepare", 2, TP4),
    (12, "commit", 2, None),
    (14, "prepare", 3, TP4),
    (16, "commit", 3, None),
]


@pytest.fixture(scope="module")
def broken_link_run(tiny_dir, tmp_path_factory):
    prompts = prompts_of_lengths([r[3] for r in BROKEN_REQUESTS], seed=29)
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm_root) as shm_dir:
        reports = run_node(
            tiny_dir,
            make_script(prompts, BROKEN_REQUESTS, BROKEN_EVENTS),
            tmp_path_factory.mktemp("broken"),
            Path(shm_dir),
            {0: ["--fail-kv-chunk-epoch", "1", "--fail-kv-chunk-epoch", "2"]},
        )
    return prompts, reports


@pytest.mark.slow
def test_links_broken_in_the_delta_or_the_precopy_refuse_the_commit_everywhere(tiny_dir, broken_link_run):
    prompts, reports = broken_link_run
    assert tokens_of(reports, BROKEN_REQUESTS) == reference_tokens(tiny_dir, prompts, BROKEN_REQUESTS)
    for rep in reports:
        acks = {(kind, epoch): (ok, reason) for _, kind, epoch, ok, reason, *_ in rep["acks"]}
        # epoch 1: pre-copy was fine; the delta from worker 2 to worker 0 was refused
        assert acks[("prepare", 1)] == (True, "")
        ok, reason = acks[("commit", 1)]
        assert ok is False and "worker 2: KV link to worker 0 failed" in reason and "injected chunk failure" in reason
        # epoch 2: the pre-copy chunks of workers 2 and 3 to worker 0 were refused
        if rep["rank"] in (2, 3):
            ok, reason = acks[("prepare", 2)]
            assert ok is False and f"worker {rep['rank']}: KV link to worker 0 failed" in reason
        ok, reason = acks[("commit", 2)]
        assert ok is False and "injected chunk failure" in reason, (rep["rank"], reason)
        assert acks[("prepare", 3)][0] is True and acks[("commit", 3)] == (True, "")
        assert len(rep["failed_kv_data_plane"]) >= 2
        assert [d for *_, d in rep["failed_kv_data_plane"]] == [[0, 0]] * len(rep["failed_kv_data_plane"])
        assert rep["end_kv_segments"] == [] and rep["end_kv_data_plane"] == [0, 0]
        assert rep["epoch"] == 3 and rep["final_group"] == [0, 4]
    # Between the refused commits and epoch 3's, the TP1 groups kept decoding their requests.
    assert {rep["rank"] for rep in reports for r in rep["records"] if 6 <= r[0] < 16} == {0, 1, 2, 3}
    assert reports[0]["final"] == {"free": 64, "total": 64}
