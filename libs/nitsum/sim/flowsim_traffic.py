"""The network side of the Nuska prefill-cluster simulator (flowsim.py): its flows, the scheduler's keys and
rates pushed to the network, the periodic progress refresh, completions, and overload pruning. A mixin of
`FlowClusterSim`, which owns the state it works on (sim, net, sched, flow_meta, units, reqs, ...) and the
batch/block steps (`_try_block`) a finished flow or a pruned request resumes."""

from __future__ import annotations

import math
from typing import Any

from nitsum.policy.flows import FlowSpec, Stage
from nitsum.sim.engine import Event, Simulator
from nitsum.sim.flowsim_parts import _FReq, _Instance, _Unit


class FlowTraffic:
    # -- flows ---------------------------------------------------------------------------------------------
    def _add_flow(
        self,
        u: _Unit | None,
        block: int,
        stage: Stage,
        r: _FReq | None,
        src: int,
        dst: int,
        size: float,
        target_layer: int | None = None,
        deadline: float | None = None,
        deadlines: tuple[float, ...] = (),
        blocking: bool = True,
    ) -> None:
        """A flow on the network and the scheduler. `blocking`: block `block` of `u` waits for it (stage 1
        before the block, stage 2 after it); a stage-3 flow of a computing batch belongs to it but blocks nothing."""
        self._seq += 1
        fid = f"f{self._seq}"
        path = (f"up{src}", f"dn{dst}")
        rid = r.rid if r is not None else f"{u.uid}-a2a"  # a collective belongs to its batch, never pruned
        spec = FlowSpec(
            flow_id=fid,
            request_id=rid,
            unit_id=u.uid if u else f"p2d-{rid}",
            stage=stage,
            size_bytes=max(int(size), 1),
            src=str(src),
            dst=str(dst),
            path=path,
            target_layer=target_layer,
            deadline_ms=deadline,
            request_deadlines_ms=deadlines,
            request_deadline_ms=r.deadline if r is not None else None,
        )
        now = self.sim.now_ms
        self.sched.on_arrival(spec, now)
        self.net.add_flow(fid, path, max(int(size), 1), now, key=(math.inf,))
        self.flow_meta[fid] = (u, block, stage, r)
        if r is not None:
            r.flows.add(fid)
        if u is not None and blocking:
            u.pending[block] = u.pending.get(block, 0) + 1

    def _sync_keys(self) -> None:
        now = self.sim.now_ms
        keys = self.sched.service_keys(now)
        net = self.net
        for fid in net.flows:
            k = keys.get(fid)
            net.set_key(fid, k if k is not None else (math.inf,), now)
        rates = self.sched.rates(now, self.link_map)
        if rates:
            for fid, bps in rates.items():
                if fid in net.flows:
                    net.set_cap(fid, max(min(bps, self.link_bps), 1.0), now)

    def _commit(self) -> list[Event]:
        self._sync_keys()
        events = self.net.commit(self.sim.now_ms)
        if not self._refresh_scheduled and self.net.flows:
            self._refresh_scheduled = True
            events.append((self.sim.now_ms + self.config.refresh_ms, self._refresh, None))
        return events

    def _refresh(self, sim: Simulator, _: Any) -> list[Event]:
        """Every `refresh_ms`: the scheduler learns each flow's remaining bytes (the transfer agents' progress
        reports: MLU, SJF sizes and Karuna's rates are computed on what is left, not on the submitted size),
        then its timers run and the network takes the new keys."""
        self._refresh_scheduled = False
        now = sim.now_ms
        net, sched = self.net, self.sched
        for fid in net.flows:
            sched.on_progress(fid, math.ceil(net.remaining_bytes(fid, now)), now)
        return self._commit()

    def _account(self, flow: Any, stage: Stage) -> None:
        self.bytes_by_stage[stage.value] += flow.size
        for link in flow.path:
            self.link_bytes[link] = self.link_bytes.get(link, 0.0) + flow.size

    def _flow_done(self, sim: Simulator, flow: Any, now: float) -> list[Event]:
        fid = flow.fid
        meta = self.flow_meta.pop(fid, None)
        if meta is None:
            return []  # withdrawn (its request was pruned) by a completion handled in the same wake-up
        self.last_ms = max(self.last_ms, now)
        self.sched.on_complete(fid, now)
        u, block, stage, r = meta
        self._account(flow, stage)
        if r is not None:
            r.flows.discard(fid)
        if stage is Stage.P2D:
            r.p2d_left -= 1
            if r.p2d_left == 0 and r.p2d_emitted >= self._p2d_flows_per_request():
                r.done_ms = now  # its first token: the last of its KV is at the decode server
                self.earliness_ms.append(r.deadline - now)
            return []
        return self._unit_flow_done(u, block, stage, now)

    def _p2d_flows_per_request(self) -> int:
        return self.config.layer_blocks if self.config.p2d_layerwise else 1

    def _unit_flow_done(self, u: _Unit, block: int, stage: Stage, now: float) -> list[Event]:
        u.pending[block] -= 1
        if u.pending[block] > 0:
            return []
        if stage is Stage.COLLECTIVE:
            self.cct_ms.append(now - u.cct_start)
            self.stall_a2a_ms += now - u.cct_start
            u.block += 1
            u.busy = False
        return self._try_block(u)

    # -- pruning -------------------------------------------------------------------------------------------
    def _prune(self, inst: _Instance) -> list[Event]:
        """The worst-case feasibility check on σ, once per source server of the instance. It covers the requests
        with flows leaving that server and those of the instance's batch in flight whose home it is (the batch
        that arrived takes part before it sends anything, paper §4.4.2). A request's delay: its flows' remaining
        bytes and the KV it has still to send, at the link rate, and its batch's remaining compute (once,
        shared by the batch's requests in this check)."""
        if not self.config.prune:
            return []
        now = self.sim.now_ms
        bw = self.link_bps / 8 / 1000
        n_p2d = self._p2d_flows_per_request()
        victims: list[str] = []
        for s in inst.servers:
            est: dict[str, float] = {}
            link = f"up{s}"
            for fid, f in self.net.flows.items():
                if f.path[0] != link:
                    continue
                r = self.flow_meta[fid][3]
                if r is None:
                    continue
                est[r.rid] = est.get(r.rid, 0.0) + self.net.remaining_bytes(fid, now) / bw
            pending: dict[str, tuple[str, float]] = {}
            for u in self.units.values():
                if u.inst is not inst:
                    continue
                for r in u.reqs:
                    if r.home == s and r.error is None:
                        est.setdefault(r.rid, 0.0)
                        pending[r.rid] = (u.uid, r.deadline)
            by_unit: dict[str, list[str]] = {}
            for rid in est:
                r = self.reqs[int(rid[1:])]
                if r.unit is not None and r.unit.uid in self.units:
                    by_unit.setdefault(r.unit.uid, []).append(rid)
            for uid, rids in by_unit.items():
                share = self._unit_remaining_ms(self.units[uid], now) / len(rids)
                for rid in rids:
                    r = self.reqs[int(rid[1:])]
                    est[rid] += share + (n_p2d - r.p2d_emitted) * self.kv_bytes(r.prompt) / n_p2d / bw
            if est:
                victims.extend(v for v in self.sched.prune(now, est, pending) if v not in victims)
        events: list[Event] = []
        for rid in victims:
            events.extend(self._drop(self.reqs[int(rid[1:])], now))
        return events

    def _unit_remaining_ms(self, u: _Unit, now: float) -> float:
        c = self.config
        left = c.layer_blocks - u.block
        per_block = self.compute_block_ms(u.tokens(), sum(r.prompt for r in u.reqs), len(u.reqs))
        s = c.instance_servers
        a2a = self.a2a_bytes_per_flow(u.tokens()) * (s - 1) / (self.link_bps / 8 / 1000) if s > 1 else 0.0
        done_part = per_block - max(u.block_end - now, 0.0) if u.busy and u.block_end > 0 else 0.0
        return max(left * (per_block + a2a) - max(done_part, 0.0), 0.0)

    def _drop(self, r: _FReq, now: float) -> list[Event]:
        """A pruned request: withdraw its flows, take it out of its batch, end it with an error."""
        self.pruned.append(r.rid)
        r.error = "pruned"
        events: list[Event] = []
        for fid in list(r.flows):
            u, block, stage, _ = self.flow_meta.pop(fid)
            self.net.remove_flow(fid, now)
            self.sched.on_complete(fid, now)
            if u is not None and stage is Stage.KV_REUSE:
                u.pending[block] -= 1
                if u.pending[block] == 0 and block == u.block and not u.busy:
                    events.extend(self._try_block(u))
        r.flows.clear()
        u = r.unit
        if u is not None and u.uid in self.units and r in u.reqs and len(u.reqs) > 1:
            u.reqs.remove(r)  # later blocks compute without it (its P2D is never sent)
        return events
