"""The coordinator's view of the workers and of the requests in flight, rebuilt from WorkerStats.

Pure and synchronous (the service calls it with `now_s`), so it is tested without NATS. After a
coordinator restart the first heartbeats rebuild everything: each worker lists the requests it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nitsum.policy.snapshot import RequestView
from nitsum.wire.messages import WorkerStats


@dataclass
class WorkerRecord:
    stats: WorkerStats
    last_seen_s: float  # its last heartbeat, as heard (re-formation's freshness check reads this)
    # Where its silence is counted from: its last heartbeat, moved later by `Membership.credit` for time the
    # coordinator could not hear anyone (last_seen_s stays the true time: a credit is not a heartbeat).
    silence_from_s: float = -1.0

    def __post_init__(self) -> None:
        if self.silence_from_s < 0:
            self.silence_from_s = self.last_seen_s

    # request id -> time it was routed here; kept until a later heartbeat no longer lists it
    assigned: dict[str, float] = field(default_factory=dict)
    draining_by_admin: bool = False

    @property
    def worker_id(self) -> str:
        return self.stats.worker_id

    @property
    def routable(self) -> bool:
        return self.stats.state == "ready" and not self.draining_by_admin and self.stats.leader

    def load(self) -> int:
        return len(self.inflight())

    def inflight(self) -> set[str]:
        return set(self.stats.running_request_ids) | set(self.assigned)


SHED_AFTER_ADMISSION = ("background",)  # tiers whose admitted requests may be shed (Membership.sheddable)


@dataclass
class InflightRequest:
    request_id: str
    tier: str
    worker_id: str
    routed_s: float
    view: RequestView | None = None  # what the policy sees (None after a restart: rebuilt from stats only)
    resumed: int = 0  # output tokens it came with (a re-submission): the workers' stream index counts them
    attempt: int = 0  # SubmitRequest.attempt; a re-submission (> 0) is never shed: a fault made it late, not the load


def with_progress(
    view: RequestView, streamed: int, first_token_age_ms: float, now_ms: float, resumed: int
) -> RequestView:
    """`view` with a worker's report of it: tokens generated in this attempt, and when its first token came
    (the earliest time heard: a worker that adopted it later reports a later one)."""
    output = max(streamed - resumed, 0)
    first = view.first_token_ms
    if first_token_age_ms >= 0:
        heard = now_ms - first_token_age_ms
        first = heard if first is None else min(first, heard)
    if output == view.output_tokens and first == view.first_token_ms:
        return view
    return replace(view, output_tokens=max(output, view.output_tokens), first_token_ms=first)


class Membership:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[str, WorkerRecord] = {}
        self.requests: dict[str, InflightRequest] = {}

    def on_stats(self, stats: WorkerStats, now_s: float) -> list[tuple[str, tuple[str, ...]]]:
        """Apply one heartbeat. Returns the (worker, request ids) lost when a worker restarted under the same id."""
        lost: list[tuple[str, tuple[str, ...]]] = []
        record = self.workers.get(stats.worker_id)
        if record is not None and record.stats.instance_id != stats.instance_id:
            # The process behind this id restarted: whatever the old one ran is gone.
            rids = tuple(sorted(r for r, q in self.requests.items() if q.worker_id == stats.worker_id))
            for rid in rids:
                del self.requests[rid]
            del self.workers[stats.worker_id]
            lost.append((stats.worker_id, rids))
            record = None
        if record is None:
            record = WorkerRecord(stats=stats, last_seen_s=now_s)
            self.workers[stats.worker_id] = record
        elif stats.in_world and stats.epoch < record.stats.epoch:
            # Built before this worker applied a commit the coordinator has already recorded (the group
            # leader's ack came first): its group fields are stale. Taken as they are, the next transition
            # would miss a promoted leader, whose span peers then wait for it in the prepare's exchange.
            s = record.stats
            stats = replace(stats, tp=s.tp, group_id=s.group_id, leader=s.leader, epoch=s.epoch)
        record.stats = stats
        record.last_seen_s = record.silence_from_s = now_s
        if stats.state == "stopped":
            self.workers.pop(stats.worker_id, None)
            return lost
        running = set(stats.running_request_ids)
        self._progress(stats, now_s)
        for rid in running:
            # Rebuild after a restart: a request we did not route is still ours to track.
            if rid not in self.requests:
                self.requests[rid] = InflightRequest(rid, "unknown", stats.worker_id, now_s)
            elif self.requests[rid].worker_id != stats.worker_id:
                # A TP change moved it to this worker (its new group leader).
                moved = self.requests[rid]
                old = self.workers.get(moved.worker_id)
                if old is not None:
                    old.assigned.pop(rid, None)
                moved.worker_id = stats.worker_id
        # Streams the worker says ended (and that attempt or an older one is what we track): gone at once.
        for rid, attempt in zip(stats.finished_request_ids, stats.finished_attempts):
            req = self.requests.get(rid)
            if rid in running or req is None or req.worker_id != stats.worker_id or req.attempt > attempt:
                continue  # running again here, moved, or re-submitted since: a newer attempt is tracked
            record.assigned.pop(rid, None)
            del self.requests[rid]
        # A request routed before this heartbeat was built and not listed in it has finished.
        grace_s = 1.0
        for rid, routed_s in list(record.assigned.items()):
            if rid in running:
                del record.assigned[rid]
            elif now_s - routed_s > grace_s:
                del record.assigned[rid]
                self._forget(rid, stats.worker_id)
        for rid, req in list(self.requests.items()):
            if (
                req.worker_id == stats.worker_id
                and rid not in running
                and rid not in record.assigned
                and now_s - req.routed_s > grace_s
            ):
                del self.requests[rid]
        return lost

    def _progress(self, stats: WorkerStats, now_s: float) -> None:
        """Decode progress and first-token times of the requests this heartbeat lists (older workers: none)."""
        ids, streamed, ages = stats.running_request_ids, stats.running_output_tokens, stats.running_first_token_age_ms
        if len(streamed) != len(ids) or len(ages) != len(ids):
            return
        for rid, n, age in zip(ids, streamed, ages):
            req = self.requests.get(rid)
            if req is not None and req.view is not None:
                req.view = with_progress(req.view, n, age, now_s * 1000.0, req.resumed)

    def _forget(self, request_id: str, worker_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.worker_id == worker_id:
            del self.requests[request_id]

    def assign(
        self,
        request_id: str,
        tier: str,
        worker_id: str,
        now_s: float,
        view: RequestView | None = None,
        resumed: int = 0,
        attempt: int = 0,
    ) -> None:
        self.workers[worker_id].assigned[request_id] = now_s
        self.requests[request_id] = InflightRequest(request_id, tier, worker_id, now_s, view, resumed, attempt)

    def sheddable(self, request_ids: list[str], asked: set[str]) -> list[str]:
        """Of the policy's shed list, in its order, what the coordinator asks the workers to drop: background
        requests (the tier that trades latency for throughput), not yet asked, on their first submission.
        An interactive request is refused at admission when it is hopeless, never dropped once admitted: on a
        burst its TTFT target may slip, but its tokens still come at nearly the promised latency, which a client
        of any other engine would expect. A re-submission (after a lost worker, a failed or pruned hand-off) was
        admitted once: the mesh owes it its tokens, a fault made it late, not the load."""
        return [
            r
            for r in request_ids
            if r not in asked
            and (req := self.requests.get(r)) is not None
            and req.attempt == 0
            and req.tier in SHED_AFTER_ADMISSION
        ]

    def unassign(self, request_id: str, worker_id: str) -> None:
        record = self.workers.get(worker_id)
        if record is not None:
            record.assigned.pop(request_id, None)
        self._forget(request_id, worker_id)

    def silent(self, now_s: float) -> list[str]:
        """Workers silent for longer than the heartbeat timeout at `now_s` (what `expire` would remove)."""
        return [w for w, record in self.workers.items() if now_s - record.silence_from_s > self.heartbeat_timeout_s]

    def credit(self, seconds: float, now_s: float) -> None:
        """Time during which the coordinator could not have heard anyone (its own process or machine stalled,
        NATS did not answer) does not count as silence: where every worker's silence is counted from moves
        `seconds` later, never past `now_s`. `credit(math.inf, now_s)` counts every worker's silence from
        `now_s`. Its last heartbeat (`last_seen_s`) does not move: a worker that died during the stall must not
        look freshly heard (re-formation admits only workers heard within a moment)."""
        for record in self.workers.values():
            if record.silence_from_s < now_s:
                record.silence_from_s = min(record.silence_from_s + seconds, now_s)

    def expire(self, now_s: float) -> list[tuple[str, tuple[str, ...]]]:
        """Workers silent for longer than the timeout: removed, with the requests they held."""
        lost = []
        for worker_id in self.silent(now_s):
            rids = tuple(sorted(r for r, q in self.requests.items() if q.worker_id == worker_id))
            for rid in rids:
                del self.requests[rid]
            del self.workers[worker_id]
            lost.append((worker_id, rids))
        return lost

    def routable(self, exclude: tuple[str, ...] = ()) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.routable and w.worker_id not in exclude]

    def outstanding_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for req in self.requests.values():
            out[req.tier] = out.get(req.tier, 0) + 1
        return out
