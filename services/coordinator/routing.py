"""Where the coordinator sends a request, besides the policy's group: P/D pairs (a prefill worker and its decode
worker, or a node world's prefill and decode groups), the worker to fetch cached prefix blocks from (stage 1),
and what the policy sees of the request (`request_view`) and of the arrivals (`note_arrival`)."""

from __future__ import annotations

from nitsum.kv import block_hashes
from nitsum.policy.snapshot import RequestView
from nitsum.wire.messages import SubmitRequest
from nitsum_services.coordinator.membership import WorkerRecord
from nitsum_services.coordinator.snapshot import ArrivalWindow

# A prefix fetch costs a round trip per layer; below this many blocks computing them is as cheap.
MIN_REUSE_BLOCKS = 2


def _standalone_ready(record: WorkerRecord) -> bool:
    return not record.stats.in_world and record.stats.state == "ready"


def _one_cache(record: WorkerRecord) -> bool:
    """A standalone worker, a TP1 group's leader (every head of its requests' KV is in this worker's own cache) or
    a TP>1 group's leader that gathers and scatters its members' heads (`kv_gather`: its world's KV path is shared
    memory), so the KV mover's exports and imports (P/D hand-offs, stage-1 prefix blocks) apply to it."""
    s = record.stats
    return not s.in_world or (s.leader and (s.tp == 1 or s.kv_gather))


def pd_plan(
    req: SubmitRequest, candidates: list[WorkerRecord], preferred_group: str | None
) -> list[tuple[WorkerRecord, str]]:
    """(worker, decode worker or "") in the order to try them. P/D pairs first (prefill worker, least loaded
    hybrid worker of its node, else of any node: a hand-off across hosts goes over TCP; a node world's prefill
    group without a decoding group of its own world pairs with a one-cache worker of another node, TP>1 groups
    included where they gather their heads)
    for fresh requests with more than one token to generate; then hybrid workers. Prefill workers never run a
    request alone."""
    key = lambda w: (w.stats.group_id != preferred_group, w.load(), w.worker_id)  # noqa: E731
    prefill = sorted((w for w in candidates if w.stats.role == "prefill"), key=key)
    hybrid = sorted((w for w in candidates if w.stats.role != "prefill"), key=key)
    plan: list[tuple[WorkerRecord, str]] = []
    fresh = req.attempt == 0 and not req.output_token_ids and req.sampling.max_tokens > 1
    if fresh:
        for p in prefill:
            if p.stats.in_world:
                decode = _world_decode_leaders(p, hybrid) or _other_host_decoders(p, hybrid)
            elif _standalone_ready(p):
                ready = [d for d in hybrid if _standalone_ready(d)]
                decode = [d for d in ready if d.stats.node_id == p.stats.node_id] or ready
            else:
                continue
            if decode:
                plan.append((p, min(decode, key=lambda w: (w.load(), w.worker_id)).worker_id))
    return plan + [(h, "") for h in hybrid]


def _other_host_decoders(prefill: WorkerRecord, others: list[WorkerRecord]) -> list[WorkerRecord]:
    """Where a node-world prefill group without a decoding group of its own world hands off to: ready standalone
    workers and group leaders of other nodes' worlds, over the KV mover (TCP between hosts). Only one-cache ends
    (`_one_cache`): a TP1 group's leader holds every head of a request in its own cache, a TP>1 group's leader
    only where it can gather or scatter its members' heads (shm arenas)."""
    if not _one_cache(prefill):
        return []
    return [
        d for d in others if d.stats.node_id != prefill.stats.node_id and _one_cache(d) and d.stats.state == "ready"
    ]


def _world_decode_leaders(prefill: WorkerRecord, others: list[WorkerRecord]) -> list[WorkerRecord]:
    """The leaders a node-world prefill group hands off to: its world's decode groups (hybrid ones when it has
    none), ready ones of the same world generation."""
    s = prefill.stats
    same = [
        d
        for d in others
        if d.stats.in_world
        and d.stats.leader
        and d.stats.state == "ready"
        and d.stats.node_id == s.node_id
        and d.stats.generation == s.generation
    ]
    return [d for d in same if d.stats.role == "decode"] or [d for d in same if d.stats.role == "hybrid"]


def reuse_hint(req: SubmitRequest, chosen: WorkerRecord, candidates: list[WorkerRecord]) -> tuple[str, tuple[int, ...]]:
    """(holder, block hashes to fetch from it) when another one-cache worker (`_one_cache`) caches a longer prefix
    of the prompt than `chosen` (one too) by at least MIN_REUSE_BLOCKS blocks; ("", ()) otherwise. Any node: between
    hosts the blocks go over the TCP data plane (`services/worker/kv_net.py`), within one through shared memory; of
    holders with equally long prefixes one of `chosen`'s node is taken (no NIC), then the smallest id."""
    bs = chosen.stats.block_size
    if bs <= 0 or not _one_cache(chosen):
        return "", ()
    tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
    # The engine computes at least the last token itself, so a whole-prompt prefix is never fetched.
    hashes = block_hashes(tokens[: len(tokens) - 1], bs)
    if len(hashes) < MIN_REUSE_BLOCKS:
        return "", ()

    def leading(record: WorkerRecord) -> int:
        cached = set(record.stats.cached_block_hashes)
        n = 0
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return n

    mine = leading(chosen)
    here = chosen.stats.node_id
    ranked = sorted(
        (-leading(o), o.stats.node_id != here, o.worker_id)
        for o in candidates
        if o.worker_id != chosen.worker_id and _one_cache(o) and o.stats.state == "ready" and o.stats.block_size == bs
    )
    if not ranked or -ranked[0][0] - mine < MIN_REUSE_BLOCKS:
        return "", ()
    best, _, holder = ranked[0]
    return holder, tuple(hashes[mine:-best])


def request_view(req: SubmitRequest, now_ms: float) -> RequestView:
    """What the policy sees of a submitted request (its progress comes later, from the workers' heartbeats).
    A re-submitted request's tokens so far count as prompt: its new worker computes them as one."""
    return RequestView(
        request_id=req.request_id,
        tier=req.tier,
        ttft_ms=req.ttft_ms,
        tpot_ms=req.tpot_ms,
        weight=req.weight,
        arrival_ms=now_ms,
        prompt_tokens=len(req.prompt_token_ids) + len(req.output_token_ids),
        max_tokens=req.sampling.max_tokens,
    )


def note_arrival(window: ArrivalWindow, view: RequestView) -> None:
    """A fresh request offered to the mesh (admitted or not), as the simulator notes its arrivals."""
    window.add(view.arrival_ms, view.tier, view.ttft_ms, view.tpot_ms, view.weight, view.prompt_tokens, view.max_tokens)
