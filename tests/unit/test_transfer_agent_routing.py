"""The coordinator's P/D pairing and stage-1 reuse hints (pure functions over membership records)."""

from __future__ import annotations

import dataclasses

from nitsum.kv import block_hashes
from nitsum.wire.messages import SamplingSpec, SubmitRequest, WorkerStats
from nitsum_services.coordinator.core import pd_plan, reuse_hint
from nitsum_services.coordinator.membership import WorkerRecord


def _worker(
    worker_id: str,
    role: str = "hybrid",
    node: str = "n0",
    running: int = 0,
    cached: tuple[int, ...] = (),
    in_world: bool = False,
) -> WorkerRecord:
    stats = WorkerStats(
        worker_id=worker_id,
        node_id=node,
        device_index=0,
        device="cpu",
        role=role,
        state="ready",
        group_id=f"{worker_id}-g",
        tp=1,
        model_name="m",
        max_model_len=512,
        num_running=0,
        num_waiting=0,
        kv_blocks_free=10,
        kv_blocks_total=10,
        running_request_ids=tuple(f"x{i}" for i in range(running)),
        cached_block_hashes=cached,
        block_size=4,
        in_world=in_world,
    )
    return WorkerRecord(stats=stats, last_seen_s=0.0)


def _req(prompt=tuple(range(10, 30)), max_tokens: int = 8, attempt: int = 0, output=()) -> SubmitRequest:
    return SubmitRequest(
        "r",
        tuple(prompt),
        SamplingSpec(max_tokens=max_tokens),
        "interactive",
        1000.0,
        100.0,
        1.0,
        0.0,
        "s",
        output_token_ids=tuple(output),
        attempt=attempt,
    )


def _ids(plan):
    return [(w.worker_id, d) for w, d in plan]


def test_fresh_requests_pair_a_prefill_worker_with_the_least_loaded_decode_worker_of_its_node():
    workers = [_worker("p0", "prefill"), _worker("d0", running=2), _worker("d1", running=1), _worker("d2", node="n1")]
    # d2 is idle but on another node (shared memory is per host); hybrid fallbacks follow by load
    assert _ids(pd_plan(_req(), workers, None)) == [("p0", "d1"), ("d2", ""), ("d1", ""), ("d0", "")]


def test_resubmits_single_tokens_and_meshes_without_prefill_workers_run_hybrid():
    workers = [_worker("p0", "prefill"), _worker("d0")]
    assert _ids(pd_plan(_req(attempt=1, output=(5,)), workers, None)) == [("d0", "")]
    assert _ids(pd_plan(_req(max_tokens=1), workers, None)) == [("d0", "")]
    assert _ids(pd_plan(_req(), [_worker("a"), _worker("b")], "b-g")) == [("b", ""), ("a", "")]
    # a prefill worker with no standalone decode worker anywhere is not used at all
    assert _ids(pd_plan(_req(), [_worker("p0", "prefill"), _worker("d0", in_world=True)], None)) == [("d0", "")]


def test_a_prefill_worker_without_a_decode_worker_on_its_node_pairs_with_one_of_another_node():
    workers = [_worker("p0", "prefill"), _worker("d0", node="n1", running=2), _worker("d1", node="n2")]
    assert _ids(pd_plan(_req(), workers, None)) == [("p0", "d1"), ("d1", ""), ("d0", "")]
    # a node-world worker of its node does not count: the standalone one elsewhere is taken
    workers = [_worker("p0", "prefill"), _worker("w0", in_world=True), _worker("d1", node="n2")]
    assert _ids(pd_plan(_req(), workers, None))[0] == ("p0", "d1")


def test_reuse_hint_names_the_holder_of_the_longest_prefix_and_only_the_missing_blocks():
    prompt = tuple(range(10, 30))  # 20 tokens, block size 4: the first 19 give 4 full blocks
    hashes = block_hashes(list(prompt)[:19], 4)
    assert len(hashes) == 4
    me = _worker("me", cached=(hashes[0],))
    holder = _worker("h", cached=tuple(hashes))
    other = _worker("o", cached=tuple(hashes[:2]))
    far = _worker("far", node="n1", cached=tuple(hashes))
    # as long a prefix on this node and on another: this node's (shared memory, no NIC)
    assert reuse_hint(_req(prompt), me, [me, other, far, holder]) == ("h", tuple(hashes[1:]))
    # too little to gain (fewer than 2 blocks more than mine): compute it
    assert reuse_hint(_req(prompt), _worker("me", cached=tuple(hashes[:3])), [holder]) == ("", ())
    # only another node holds it: fetched from there (over TCP between hosts), a longer prefix before a nearer one
    assert reuse_hint(_req(prompt), _worker("me"), [far]) == ("far", tuple(hashes))
    assert reuse_hint(_req(prompt), _worker("me"), [other, far]) == ("far", tuple(hashes))
    # a worker of a node world's TP>1 group is no holder (its cache holds only its share of the group's heads);
    # a TP1 group's leader is one, and asks like a standalone worker
    wide = _worker("w", cached=tuple(hashes), in_world=True)
    wide.stats = dataclasses.replace(wide.stats, tp=2)
    assert reuse_hint(_req(prompt), _worker("me"), [wide]) == ("", ())
    narrow = _worker("w1", cached=tuple(hashes), in_world=True)
    assert reuse_hint(_req(prompt), _worker("me"), [narrow]) == ("w1", tuple(hashes))
    asker = _worker("me", in_world=True)
    assert reuse_hint(_req(prompt), asker, [holder]) == ("h", tuple(hashes))
    asker.stats = dataclasses.replace(asker.stats, tp=2)
    assert reuse_hint(_req(prompt), asker, [holder]) == ("", ())
