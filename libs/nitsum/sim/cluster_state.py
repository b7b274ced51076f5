"""The state one cluster run mutates: its requests (`SimRequest`: progress, KV held, what its client saw), its
TP groups (`SimGroup`: EDF prefill queue, running decodes, KV, and the work of its next engine step) and nodes.

Decode accounting is O(1) per step: a running request's generated count is `step - join_step + base`, and
finishes come off a heap keyed by the step index at which it emits its last token.
"""

from __future__ import annotations

import heapq

from nitsum.metrics import RequestRecord
from nitsum.policy.costmodel import CostModel
from nitsum.policy.snapshot import GroupView, RequestView, group_id_of
from nitsum.policy.tiers import Tier
from nitsum.sim.cluster_config import ClusterConfig
from nitsum.workloads.request import TraceRequest


class SimRequest:
    __slots__ = (
        "rid",
        "tier",
        "ttft_slo",
        "tpot_slo",
        "weight",
        "arrival",
        "prompt",
        "output",
        "prefill_done",
        "first_token",
        "finish",
        "group",
        "join_step",
        "base_gen",
        "error",
        "in_prefill",
        "kv_tokens",
        "deadline",
        "path_ms",
        "stalled",
        "ratio",
    )

    def __init__(self, rid: str, t: TraceRequest, tier: Tier) -> None:
        self.rid = rid
        self.tier = tier.name
        self.ttft_slo = tier.ttft_ms
        self.tpot_slo = tier.tpot_ms
        self.weight = tier.weight
        self.arrival = t.arrival_ms
        self.prompt = t.prompt_tokens
        self.output = t.output_tokens
        self.prefill_done = 0
        self.first_token: float | None = None
        self.finish: float | None = None
        self.group: SimGroup | None = None
        self.join_step = 0
        self.base_gen = 0
        self.error: str | None = None
        self.in_prefill = False
        self.kv_tokens = 0  # KV reserved on its group (prompt + output, reserved up front: no preemption)
        self.deadline = t.arrival_ms + tier.ttft_ms  # TTFT deadline: prefill order is EDF
        self.path_ms = 0.0  # service model: the client sees its tokens this much later
        self.stalled = False  # service model: ... and all at once
        self.ratio = 1.0  # service model: its decode steps' slowdown

    def generated(self) -> int:
        if self.first_token is None:
            return 0
        if self.group is None or self.group.running.get(self) is None:
            return self.base_gen
        return self.base_gen + self.group.step - self.join_step

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.rid,
            tier=self.tier,
            ttft_ms=self.ttft_slo,
            tpot_ms=self.tpot_slo,
            weight=self.weight,
            arrival_ms=self.arrival,
            prompt_tokens=self.prompt,
            max_tokens=self.output,
            output_tokens=self.generated(),
            first_token_ms=self.first_token,
            group_id=None if self.group is None else self.group.gid,
        )

    def detach(self) -> None:
        """Leave its group (a reconfiguration takes the group away): its progress so far is kept in `base_gen`,
        its KV given back; it is placed again with that progress."""
        self.base_gen = self.generated()
        if self.group is not None and self in self.group.running:
            g_old = self.group
            g_old.ctx_base -= self.prompt + (self.base_gen - (g_old.step - self.join_step)) - self.join_step
            del g_old.running[self]
            g_old.drop_running_tpot(self.tpot_slo)
        if self.group is not None:
            self.group.kv_used -= self.kv_tokens
        self.kv_tokens = 0
        self.in_prefill = False
        self.group = None

    def record(self) -> RequestRecord:
        """What its client saw; with a service model every token `path_ms` later (all at once when stalled)."""
        done = self.finish is not None and self.error is None
        first, finish = self.first_token, self.finish
        if self.path_ms or self.stalled:
            first = None if self.first_token is None else self.first_token + self.path_ms
            finish = first if self.stalled else None if self.finish is None else self.finish + self.path_ms
        return RequestRecord(
            request_id=self.rid,
            tier=self.tier,
            ttft_slo_ms=self.ttft_slo,
            tpot_slo_ms=self.tpot_slo,
            weight=self.weight,
            send_ms=self.arrival,
            first_token_ms=first,
            finish_ms=finish if done else None,
            output_tokens=self.output if done else self.generated(),
            prompt_tokens=self.prompt,
            error=self.error,
        )


def by_deadline(r: SimRequest) -> float:
    return r.deadline


class SimGroup:
    __slots__ = (
        "gid",
        "node",
        "start",
        "tp",
        "role",
        "cost",
        "waiting",
        "prefilling",
        "running",
        "finish_heap",
        "step",
        "ctx_base",
        "busy",
        "paused_until",
        "kv_total",
        "kv_used",
        "version",
        "retired",
        "seq",
        "tpot_counts",
    )

    def __init__(
        self, node: SimNode, start: int, tp: int, role: str, cost: CostModel, now: float, paused_until: float
    ) -> None:
        self.gid = group_id_of(node.node_id, start, tp)
        self.node = node
        self.start, self.tp, self.role = start, tp, role
        self.cost = cost
        self.waiting: list[tuple[float, int, SimRequest]] = []  # (TTFT deadline, seq, req): EDF
        self.prefilling: list[SimRequest] = []
        self.running: dict[SimRequest, int] = {}  # req -> step index of its last token
        self.finish_heap: list[tuple[int, int, SimRequest]] = []
        self.step = 0
        self.ctx_base = 0  # sum over running of (prompt + base_gen - join_step)
        self.busy = False
        self.paused_until = paused_until
        self.kv_total = cost.kv_capacity_tokens(tp)
        self.kv_used = 0
        self.version = 0
        self.retired = False
        self.seq = 0
        self.tpot_counts: dict[float, int] = {}  # TPOT target -> running requests with it (tightest = min)

    def add_running_tpot(self, tpot_ms: float) -> None:
        self.tpot_counts[tpot_ms] = self.tpot_counts.get(tpot_ms, 0) + 1

    def drop_running_tpot(self, tpot_ms: float) -> None:
        left = self.tpot_counts[tpot_ms] - 1
        if left:
            self.tpot_counts[tpot_ms] = left
        else:
            del self.tpot_counts[tpot_ms]

    def plan_step(self, config: ClusterConfig) -> tuple[list[tuple[SimRequest, int]], int, int, int]:
        """The next engine step's work: (prefill chunks as (request, tokens), prefill tokens, decodes, decode
        context tokens). Waiting requests it starts prefilling are admitted here (their KV reserved)."""
        n_dec = len(self.running) if self.role != "prefill" else 0
        dec_ctx = (self.ctx_base + n_dec * self.step) if n_dec else 0
        pre = sorted(self.prefilling, key=by_deadline)  # a copy: admissions below append to self.prefilling
        if self.role == "prefill":
            budget = config.prefill_batch_tokens
        elif self.role == "hybrid":
            # The chunk attends to the prompt tokens already prefilled: the head of the EDF line's.
            head = pre[0] if pre else None
            if self.waiting and (head is None or self.waiting[0][2].deadline < head.deadline):
                head = self.waiting[0][2]
            budget = self.hybrid_budget(config, n_dec, dec_ctx + (head.prefill_done if head is not None else 0))
            if config.decode_tokens_in_budget:
                budget = max(budget - n_dec, 0)
        else:
            budget = 0
        # Prefill work in earliest-TTFT-deadline order over both the requests already part-way through their
        # prefill and the waiting ones: an interactive arrival is not stuck behind a long background prompt's
        # remaining chunks (those keep their KV and resume later).
        planned: list[tuple[SimRequest, int]] = []
        tokens = 0
        i = 0
        take_waiting = True
        while tokens < budget:
            p = pre[i] if i < len(pre) else None
            w = self.waiting[0][2] if take_waiting and self.waiting else None
            if w is not None and (p is None or w.deadline < p.deadline):
                need = w.prompt + w.output
                if self.kv_used + need > self.kv_total or len(self.running) + len(self.prefilling) >= config.max_batch:
                    take_waiting = False
                    continue
                heapq.heappop(self.waiting)
                self.kv_used += need
                w.kv_tokens = need
                w.in_prefill = True
                self.prefilling.append(w)
                r = w
            elif p is not None:
                i += 1
                r = p
            else:
                break
            n = min(r.prompt - r.prefill_done, budget - tokens)
            planned.append((r, n))
            tokens += n
        return planned, tokens, n_dec, dec_ctx

    def hybrid_budget(self, config: ClusterConfig, n_dec: int, dec_ctx: int) -> int:
        """Prefill tokens this hybrid step may carry (see ClusterConfig.tpot_aware_chunks)."""
        c = config.chunk_tokens
        if not config.tpot_aware_chunks or n_dec == 0:
            return c
        tpot = min(self.tpot_counts)
        floor = min(config.min_chunk_tokens, c)
        while c > floor and self.cost.step_time_ms(self.tp, n_dec + 1, n_dec + c, dec_ctx + c) > tpot:
            c = max(c // 2, floor)
        return c

    @property
    def healthy(self) -> bool:
        return self.kv_total > 0

    def view(self, block: int) -> GroupView:
        return GroupView(
            group_id=self.gid,
            devices=tuple(range(self.start, self.start + self.tp)),
            tp=self.tp,
            role=self.role,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.prefilling),
            kv_blocks_free=max(self.kv_total - self.kv_used, 0) // block,
            kv_blocks_total=self.kv_total // block,
            healthy=self.healthy,
            draining=False,
        )


class SimNode:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.groups: list[SimGroup] = []
        self.last_reconfig_ms: float | None = None
