"""Adaptive tensor parallelism: the SLO profitability engine (ALGORITHMS.md §1.5).

How a decision is made, per node, every epoch (`NITSUM_RECONFIG_INTERVAL_MS`) and on queue events:

    guards  ─ no usable group, or a group unhealthy/draining     → keep (the transition agent is busy)
            ─ nothing queued or running                          → keep   ("idle")
            ─ last change less than `min_dwell_ms` ago            → keep   ("dwell")
    load    ─ summarize the node's requests once (estimate.summarize): per tier, EDF buckets of TTFT
              budgets, mean prompt/output lengths, running decode batch.
    fast path (a decision tree; restricts the direction, so few candidates are scored)
            ─ latency-sensitive backlog ≥ threshold and projected latency misses under the current
              topology → prefer the direction in which its prompts prefill sooner
              (faster_prefill_direction: consolidations on a roofline)          path "fast"
            ─ no latency-sensitive work at all and throughput work queued
              → consider only splits (mean TP down): maximise batch throughput   path "fast"
            ─ otherwise → every candidate                                         path "scored"
    candidates ─ aligned partitions reachable from the current one in ≤ `max_steps` merges (two aligned
              sibling groups of TP k → one of 2k) or splits (TP k → two of k/2), plus the uniform layout at
              each allowed TP level and the two-lane layouts (half the node at a high TP, half at a low TP);
              each with the role variants of phases.py (all hybrid; P/D split when prefill is pending or
              arriving), and every static layout of the node (baselines.static_layouts: all-hybrid
              partitions, P/D splits with prefill and decode groups of one size each).
    score   ─ estimate.evaluate(): estimated weighted goodput over `horizon_ms` (the backlog, plus the
              arrival stream when the snapshot carries measured `arrivals`), minus
              λ · reconfiguration cost (fixed switch cost + KV bytes of the running requests on groups that
              change / link bandwidth, all pairs in parallel — costmodel.reconfig_cost_ms); over the phase
              expected to remain, the stream's part recurs every horizon, the backlog's is earned once.
    hysteresis ─ switch only if best − current > max(`hysteresis_margin` (weighted requests),
              `hysteresis_fraction` · |current score|); together with the dwell time this stops flapping
              under an oscillating load or noisy measured arrival rates. Leaving the boot layout (chosen for
              no load) takes the fixed `hysteresis_margin` only.
    shifts  ─ with measured shifts of the stream (`load_shift_ms`): no change until the window settles, then
              at most one change until the load shifts again; except at boot (the node never changed), where
              the estimate's layout for the first snapshot with arrivals is taken at once and not counted.

Everything is pure: the decision depends only on the snapshot (which carries `now_ms` and the node's
`last_reconfig_ms`) and the frozen config. Cost-model results are memoized inside the policy object; that
changes speed, never answers.
"""

from __future__ import annotations

from nitsum.policy.base import BasePolicy, PolicyConfig
from nitsum.policy.candidates import candidate_shapes, faster_prefill_direction, mean_tp, static_candidates
from nitsum.policy.costmodel import CostModel
from nitsum.policy.decisions import TopologyDecision, node_topology
from nitsum.policy.estimate import NodeLoad, classes_of, evaluate, summarize
from nitsum.policy.phases import Shape, role_variants
from nitsum.policy.snapshot import ClusterSnapshot, NodeView
from nitsum.topology import Group, Topology

THROUGHPUT_DWELL_FACTOR = 2.0  # a split for throughput waits this many dwell times after the last change
MAX_REMAINING_HORIZONS = 4.0  # the phase expected to remain is counted up to this many horizons
MIN_BATCH_SEQS = 8


def typical_context_tokens(load: NodeLoad) -> int:
    """Largest per-tier mean context (prompt + output) among the tiers present, queued or arriving."""
    sizes = [t.prompt_tokens + t.queued_out_tokens for t in load.tiers if t.queued]
    sizes += [t.running_ctx_tokens + t.running_left_tokens for t in load.tiers if t.running]
    sizes += [sum(s.prompt_tokens) / len(s.prompt_tokens) + s.output_tokens for s in load.streams]
    return int(max(sizes, default=1))


__all__ = [
    "AdaptivePolicy",
    "MIN_BATCH_SEQS",
    "typical_context_tokens",
    "candidate_shapes",
    "faster_prefill_direction",
    "mean_tp",
    "static_candidates",
]


class AdaptivePolicy(BasePolicy):
    name = "adaptive"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)

    def initial_topology(self, node: NodeView) -> Topology:
        # Boot consolidated: the first traffic is often interactive, and splitting later is cheap (no KV yet).
        k = max(x for x in node.allowed_tp_levels() if node.num_devices % x == 0)
        return Topology.uniform(node.num_devices, k, "hybrid")

    def decide_topology(self, snap: ClusterSnapshot) -> list[TopologyDecision]:
        return [self.decide_node(snap, node) for node in snap.nodes]

    # ------------------------------------------------------------------------------------------------------
    def decide_node(self, snap: ClusterSnapshot, node: NodeView) -> TopologyDecision:
        cfg = self.config
        nid = node.node_id

        def keep(reason: str, path: str = "fast") -> TopologyDecision:
            return TopologyDecision(nid, None, reason, 0.0, path)

        if not any(g.usable for g in node.groups):
            return keep("no usable group")
        if any(not g.usable for g in node.groups):
            return keep("a group is unhealthy or draining: no change until it settles")
        if node.last_reconfig_ms is not None and snap.now_ms - node.last_reconfig_ms < cfg.min_dwell_ms:
            return keep(
                f"dwell: last change {snap.now_ms - node.last_reconfig_ms:.0f} ms ago < {cfg.min_dwell_ms:.0f} ms"
            )
        load = self.node_load(snap, node)
        if load.idle:
            return keep("idle")
        cost = self.cost_for(node)
        current = node_topology(node)
        cur_shape = current.shape()
        cur_est = self.evaluate_groups(cost, current.groups, load, node)
        cur_backlog = cur_est.score - cur_est.stream
        # A level whose KV room holds fewer than MIN_BATCH_SEQS typical requests cannot batch: Llama-3-70B at
        # TP2 on H100 keeps ~8.8 k KV tokens after weights, and routing background work there starved it.
        need = MIN_BATCH_SEQS * typical_context_tokens(load)
        levels = (
            tuple(k for k in node.allowed_tp_levels() if cost.kv_capacity_tokens(k) >= need)
            or tuple(k for k in node.allowed_tp_levels() if cost.fits(k))
            or node.allowed_tp_levels()
        )

        shapes = candidate_shapes(cur_shape, node.num_devices, levels, cfg.max_steps)
        shapes = [sh for sh in shapes if all(k in levels for _, k in sh)]
        cur_mean = mean_tp(cur_shape)
        # Fast path: a direction to prefer, never a layout the scorer finds clearly worse (the two rules
        # fought before: the surge rule consolidated on one projected miss, the scorer split again next epoch).
        latency_stream = any(st.latency_sensitive and st.rate_per_ms > 0 for st in load.streams)
        direction = 0
        if load.latency_queued() >= cfg.interactive_backlog_threshold and cur_est.latency_misses > 0:
            direction, path, why = (
                faster_prefill_direction(cost, levels, load),
                "fast",
                f"interactive surge: {cur_est.latency_misses} projected latency-tier misses",
            )
        elif load.latency_work() == 0 and not latency_stream and load.throughput_work() > 0:
            # Batch work only, queued or decoding: split for batch throughput. Decoding counts since the live
            # snapshot is true (first tokens reported): background that has started is batch work all the same.
            direction, path, why = (
                -1,
                "fast",
                f"throughput backlog ({load.throughput_queued()} queued, {load.throughput_work()} in all), "
                "no interactive work",
            )
        else:
            path, why = "scored", "mixed load"
        prefill_pending = any(t.queued for t in load.tiers) or bool(load.streams)

        # (score, change cost, shape, topology, the score's backlog part)
        scored: list[tuple[float, float, Shape, Topology, float]] = []
        seen: set[Topology] = set()
        for sh in shapes:  # first pass: all-hybrid roles, the common case
            groups = role_variants(sh, False)[0]
            seen.add(Topology(groups))
            scored.append(self._scored(cost, groups, load, node, sh, Topology(groups)))
        # ... and every static layout of the node at these levels (all-hybrid partitions, P/D splits with prefill
        # and decode groups of one size each: `1p+1p+1d×6` is the best layout on the measured CPU table, and no
        # merge or split path from the current layout reaches it).
        for top in static_candidates(node.num_devices, levels):
            if top != current and top not in seen:
                seen.add(top)
                scored.append(self._scored(cost, top.groups, load, node, top.shape(), top))
        # Second pass: other role variants for the three best partitions, the best in the fast path's
        # direction, and the current one.
        scored.sort(key=lambda x: -(x[0] - x[1]))
        refine = [x[2] for x in scored[:3]] + [cur_shape]
        if direction:
            refine += [x[2] for x in scored if (mean_tp(x[2]) - cur_mean) * direction > 0][:1]
        for sh in dict.fromkeys(refine):
            for groups in role_variants(sh, prefill_pending)[1:]:
                top = Topology(groups)
                if top != current and top not in seen:
                    seen.add(top)
                    scored.append(self._scored(cost, groups, load, node, sh, top))
        if not scored:
            return keep(f"{why}: no candidate", path)
        # The change is worth what it gains over the phase expected to remain, less its one-time cost: the
        # stream's part of the score recurs every horizon of that phase, the backlog's (the requests here now)
        # is earned once (rule 19; before, a backlog gain was multiplied by the phase as well).
        remaining = self.expected_remaining_ms(snap)
        scale = remaining / cfg.horizon_ms

        def worth(x) -> float:
            return change_worth(x[0], x[4], x[1], cur_est.score, cur_backlog, scale)

        best = max(scored, key=worth)
        # At boot: the node never changed (why it matters: the shift rules below).
        boot = node.last_reconfig_ms is None and (bool(snap.arrivals) or snap.load_shift_ms is None)
        # The hysteresis margin guards against the estimate's noise, which the phase scale multiplies too: in
        # the same units as `worth`, so the remaining phase discounts only the one-time cost of the change.
        # Rule 29: its relative part guards a layout chosen for the load against noise in proportion to that
        # load's score; the boot layout was chosen for no load, so leaving it takes the fixed part only.
        fraction = 0.0 if boot else cfg.hysteresis_fraction
        margin = max(cfg.hysteresis_margin, fraction * abs(cur_est.score)) * scale
        chosen = best
        if direction:
            along = [x for x in scored if (mean_tp(x[2]) - cur_mean) * direction > 0]
            if along:
                top_along = max(along, key=worth)
                if worth(top_along) >= worth(best) - margin:
                    chosen = top_along
        gain = worth(chosen)
        # A shift of the arrival stream is still inside the measurement window: the rates mix the old load and
        # the new one, so wait until the window holds the new load only.
        # At boot (the node never changed) there is no old load to wait out: the layout the estimate picks for
        # the first snapshot with work replaces the boot layout at once (no KV to move yet), and it does not count
        # as the change this load allows.
        # (Where arrivals are measured, a first snapshot before any has been counted is no basis to choose from.)
        # Rule 25: the node's last change came before the load shifted (chosen for the old load, or from a window
        # that mixed the two): once the shift is `shift_revise_ms` old, the node may change, inside the settle
        # time, once. (ArrivalWindow dates a shift at the start of the window that showed it, so with a 5 s window
        # that is the detection itself, on a window that still mixes some old load in; SIMULATOR.md, rounds ten
        # and eleven.) Not the boot choice: it came after measuring began (rule 20: a fuller window does not
        # make the estimate choose better there).
        # Not where the stream has stopped (the end of arrivals is detected as a shift): with no stream left to
        # match, a change could only gain on the backlog, which the estimate overrates (round ten: the drain
        # change at 20.5 req/s).
        revise = (
            snap.load_shift_ms is not None
            and not snap.load_shift_stopped
            and node.last_reconfig_ms is not None
            and node.last_reconfig_ms < snap.load_shift_ms
            and snap.load_shift_ms + cfg.shift_revise_ms <= snap.now_ms
        )
        if snap.load_shift_ms is not None and not boot and not revise:
            shift = snap.load_shift_ms
            if snap.now_ms - shift < cfg.shift_settle_ms:
                return TopologyDecision(
                    nid,
                    None,
                    f"{why}: the load shifted {snap.now_ms - shift:.0f} ms ago "
                    f"(< {cfg.shift_settle_ms:.0f} ms); keep until the measurement settles",
                    gain,
                    path,
                )
        # One change per shift of the arrival stream: the estimate swings by more than any margin from epoch to
        # epoch near saturation (measured: TP8 <-> TP4 x2 every 4-10 s under a steady surge, each move "gaining"
        # 20-480 weighted requests), so once the node has moved for this load it stays until the load moves.
        if (
            snap.load_shift_ms is not None
            and node.last_reconfig_ms is not None
            # Only changes from a window past the shift on count: the boot change (and any before it) is provisional.
            and node.last_reconfig_ms >= snap.load_shift_ms + min(cfg.shift_revise_ms, cfg.shift_settle_ms)
        ):
            return TopologyDecision(
                nid,
                None,
                f"{why}: changed already since the load last shifted (best {chosen[3]} would gain {gain:.2f}); keep",
                gain,
                path,
            )
        settled = (
            node.last_reconfig_ms is None
            or snap.now_ms - node.last_reconfig_ms >= THROUGHPUT_DWELL_FACTOR * cfg.min_dwell_ms
        )
        if direction < 0 and mean_tp(chosen[2]) < cur_mean and gain > -margin and settled:
            # ALGORITHMS.md §1.5: with no interactive work (queued, running or arriving), split to maximise
            # batch throughput. Goodput alone cannot show the gain when the background SLOs are loose (both
            # layouts meet them), so here the margin guards against a loss instead of demanding a win.
            return TopologyDecision(
                nid,
                chosen[3],
                f"{why}: {current} -> {chosen[3]} for throughput (goodput change {gain:.2f})",
                gain,
                path,
            )
        if gain <= margin:
            return TopologyDecision(
                nid, None, f"{why}: best {chosen[3]} gains {gain:.2f} <= margin {margin:.2f}; keep", gain, path
            )
        return TopologyDecision(
            nid,
            chosen[3],
            f"{why}: {current} -> {chosen[3]} gains {gain:.2f} (over {remaining / 1000:.0f} s expected to remain)",
            gain,
            path,
        )

    def node_load(self, snap: ClusterSnapshot, node: NodeView) -> NodeLoad:
        """The node's load as the estimator scores it (summarized once per decision)."""
        return summarize(snap, node, self.config.latency_sensitive_ttft_ms)

    def expected_remaining_ms(self, snap: ClusterSnapshot) -> float:
        """How long the current load is expected to last: as long as it has lasted since the stream last
        shifted (a regime seen for t is, on the median, seen for t more), between one dwell time and
        MAX_REMAINING_HORIZONS horizons. Without shift measurements (load_shift_ms None): one horizon."""
        cfg = self.config
        if snap.load_shift_ms is None:
            return cfg.horizon_ms
        age = snap.now_ms - snap.load_shift_ms
        return min(max(age, cfg.min_dwell_ms), MAX_REMAINING_HORIZONS * cfg.horizon_ms)

    def evaluate_groups(self, cost: CostModel, groups, load: NodeLoad, node: NodeView, detail: list | None = None):
        """The estimate (`estimate.evaluate`) of `groups` on this node's load, as the policy ranks candidates;
        `detail` collects each tier's stream terms (`nitsum sim estimates` reads them)."""
        cfg = self.config
        # Admission tries every level of the node for a request's best-case TTFT (admission.best_case_ttft_ms).
        levels = tuple(k for k in node.allowed_tp_levels() if cost.fits(k))
        return evaluate(
            cost, classes_of(groups), load, cfg.horizon_ms, cfg.chunk_tokens, cfg.prefill_batch_tokens, levels, detail
        )

    def _scored(self, cost: CostModel, groups: tuple[Group, ...], load: NodeLoad, node: NodeView, shape, top):
        """A candidate's row: (score, λ · reconfiguration cost, shape, topology, the score's backlog part)."""
        cfg = self.config
        est = self.evaluate_groups(cost, groups, load, node)
        change = cfg.reconfig_lambda_per_ms * reconfig_ms(cost, groups, node, load)
        return est.score, change, shape, top, est.score - est.stream

    def _net_score(self, cost: CostModel, groups: tuple[Group, ...], load: NodeLoad, node: NodeView) -> float:
        cfg = self.config
        est = self.evaluate_groups(cost, groups, load, node)
        return est.score - cfg.reconfig_lambda_per_ms * reconfig_ms(cost, groups, node, load)


def change_worth(score: float, backlog: float, change: float, cur_score: float, cur_backlog: float, scale: float):
    """What a candidate (its score, the score's backlog part, λ · its change cost) is worth against the current
    layout over the phase expected to remain (`scale` horizons): the stream's part recurs, the backlog's is earned
    once (rule 19)."""
    return (score - cur_score) * scale - change - (backlog - cur_backlog) * (scale - 1.0)


def reconfig_ms(cost: CostModel, groups: tuple[Group, ...], node: NodeView, load: NodeLoad) -> float:
    """Fixed switch cost + moving the KV of running requests on every group whose devices change."""
    kept = {(g.start, g.tp) for g in groups}
    kv_tokens = dict(load.kv_tokens_by_group)
    kv_bytes = 0.0
    moving = 0
    for g in node.groups:
        if (g.devices[0], g.tp) in kept:
            continue
        moving += g.tp
        kv_bytes += kv_tokens.get(g.group_id, 0) * cost.model.kv_bytes_per_token
    if moving == 0:
        return cost.reconfig_fixed_ms / 2  # roles only: views stay, queues move
    return cost.reconfig_cost_ms(kv_bytes, moving)
