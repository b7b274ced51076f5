"""The Nuska setting: a P/D prefill cluster with KV reuse and MoE expert-parallel collectives, whose
network flows are ordered by a `nitsum.policy.flows` FlowScheduler (the same objects the flow-scheduler
service and the transfer agents run).

Model (coarse on purpose, so 256 servers run on one core):
- Servers of 8 GPUs; `prefill_fraction` of them prefill, the rest decode (P2D destinations). A prefill
  instance spans `ep_servers` servers (expert parallelism across them, TP inside a server).
- Network: every server has one uplink and one downlink of `nics x nic_bps` (1:1 fat-tree = non-blocking
  core, so only server links contend). Flow rates: strict priority by the scheduler's service key, max-min
  fair among equal keys (`network.Network`); Karuna's pacing rates become rate caps.
- A batch (unit) runs its layers in `layer_blocks` blocks. Before block b: its KV-reuse fetches for
  block b must have arrived (stage 1, target layer = first layer of b). After block b's compute: the
  all-to-all of block b (stage 2) must finish before block b+1. After the last block: each request's KV
  goes to a decode server (stage 3, explicit deadline = its TTFT deadline); its first token counts when
  that transfer ends.
- Compute per block from the shared cost model: each server of the instance runs its 1/S of the tokens at TP8.
- KV reuse: Mooncake hash_ids (512-token blocks); a block lives on the instance that first computed it
  (unlimited cache); a request scheduled elsewhere fetches its cached prefix from there.
- TTFT SLO of a request = `slo_factor` x its TTFT on an idle cluster (compute + transfers at full rate).
Not modelled: decode, overload pruning (RMLQ's prune is not called), link load rho (0), packet effects.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from nitsum.metrics import Distribution, RequestRecord, summarize
from nitsum.policy.costmodel import CostModel, cost_model
from nitsum.policy.steptable import select
from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.flows import FlowSpec, Stage
from nitsum.sim.engine import Event, Simulator
from nitsum.sim.network import Network
from nitsum.workloads.request import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class FlowClusterConfig:
    num_servers: int = 256
    gpus_per_server: int = 8
    nics_per_server: int = 8
    nic_bps: float = 200e9
    prefill_fraction: float = 0.5
    ep_servers: int = 2  # DBRX-like TP8/EP16 per instance: all-to-all crosses the NICs
    model: str = "mixtral-8x22b"
    device_kind: str = "h100"
    device_table: tuple | None = None  # measured step-time rows (policy/steptable.py) for (device_kind, model)
    layer_blocks: int = 4
    batch_tokens: int = 32_768
    slo_factor: float = 3.0
    refresh_ms: float = 2.0  # how often schedulers with timers (RMLQ's MLU promotion) are consulted
    max_prompt_tokens: int = 32_768


class _Unit:
    __slots__ = ("uid", "inst", "reqs", "block", "pending", "t0", "cct_start", "busy")

    def __init__(self, uid: str, inst: "_Instance", reqs: list) -> None:
        self.uid, self.inst, self.reqs = uid, inst, reqs
        self.block = 0
        self.pending: dict[int, int] = {}  # block -> flows (fetch for it / collective of it) outstanding
        self.t0 = 0.0
        self.cct_start = 0.0
        self.busy = False  # computing a block or waiting for its collective


class _Instance:
    __slots__ = ("iid", "servers", "queue", "busy", "queued_tokens")

    def __init__(self, iid: int, servers: list[int]) -> None:
        self.iid, self.servers = iid, servers
        self.queue: deque = deque()
        self.busy = False
        self.queued_tokens = 0


class _FReq:
    __slots__ = ("rid", "t", "prompt", "cached", "holder", "deadline", "slo", "done_ms", "error")

    def __init__(self, rid: str, t: TraceRequest, prompt: int) -> None:
        self.rid, self.t, self.prompt = rid, t, prompt
        self.cached = 0
        self.holder: int | None = None
        self.deadline = 0.0
        self.slo = 1.0
        self.done_ms: float | None = None
        self.error: str | None = None


class FlowClusterSim:
    def __init__(self, scheduler: str, config: FlowClusterConfig, workload: list[TraceRequest]) -> None:
        c = self.config = config
        self.sched = make_flow_scheduler(scheduler)
        self.name = scheduler
        self.cost = cost_model(c.model, c.device_kind)
        if c.device_table is not None:
            self.cost = CostModel(self.cost.model, self.cost.device,
                                  steps=select(c.device_table, c.device_kind, self.cost.model, "device table"))
        self.model = self.cost.model
        self.sim = Simulator()
        self.net = Network(self._flow_done)
        link_bps = c.nics_per_server * c.nic_bps
        self.link_bps = link_bps
        self.link_map = {f"{d}{s}": link_bps for s in range(c.num_servers) for d in ("up", "dn")}
        for s in range(c.num_servers):
            self.net.add_link(f"up{s}", link_bps)
            self.net.add_link(f"dn{s}", link_bps)
        n_prefill = int(c.num_servers * c.prefill_fraction) // c.ep_servers * c.ep_servers
        assert n_prefill >= c.ep_servers and n_prefill < c.num_servers, "need prefill and decode servers"
        self.instances = [_Instance(i, list(range(i * c.ep_servers, (i + 1) * c.ep_servers)))
                          for i in range(n_prefill // c.ep_servers)]
        self.decode_servers = list(range(n_prefill, c.num_servers))
        self._next_decode = 0
        self.workload = sorted(workload, key=lambda r: r.arrival_ms)
        self.reqs: list[_FReq] = []
        self.block_owner: dict[int, int] = {}  # hash id -> instance id holding its KV
        self.units: dict[str, _Unit] = {}
        self.flow_meta: dict[str, tuple] = {}
        self._seq = 0
        self.cct_ms: list[float] = []
        self.earliness_ms: list[float] = []
        self.layers_per_block = max(self.model.num_layers // c.layer_blocks, 1)
        self._refresh_scheduled = False

    # -- costs ---------------------------------------------------------------------------------------------
    def compute_block_ms(self, tokens: int, context: int, batch: int) -> float:
        s = self.config.ep_servers
        per_server = max(tokens // s, 1)
        return self.cost.step_time_ms(8, batch, per_server, max(context // s, 1)) / self.config.layer_blocks

    def a2a_bytes_per_flow(self, tokens: int) -> float:
        """One block's all-to-all, server i -> j: dispatch + combine of the tokens routed across servers."""
        s, m = self.config.ep_servers, self.model
        per_layer = tokens / s * m.experts_per_token * m.hidden_size * 2.0 * 2 / s  # bf16, dispatch+combine
        return per_layer * self.layers_per_block

    def kv_bytes(self, tokens: int) -> float:
        return tokens * self.model.kv_bytes_per_token

    def isolated_ttft_ms(self, prompt: int, cached: int) -> float:
        new = max(prompt - cached, 1)
        bw = self.link_bps / 8 / 1000  # bytes/ms
        compute = self.compute_block_ms(new, prompt, 1) * self.config.layer_blocks
        a2a = self.a2a_bytes_per_flow(new) / bw * self.config.layer_blocks if self.config.ep_servers > 1 else 0.0
        fetch_first = self.kv_bytes(cached) / self.config.layer_blocks / bw
        return compute + a2a + fetch_first + self.kv_bytes(prompt) / bw

    # -- arrivals and batching -----------------------------------------------------------------------------
    def _arrive(self, sim: Simulator, t: TraceRequest) -> list[Event]:
        c = self.config
        r = _FReq(f"r{len(self.reqs)}", t, min(t.prompt_tokens, c.max_prompt_tokens))
        self.reqs.append(r)
        inst = min(self.instances, key=lambda i: (i.queued_tokens + (1 if i.busy else 0), i.iid))
        # cached prefix: leading hash ids already computed somewhere
        lead, holder = 0, None
        for h in t.prefix_hash_ids:
            owner = self.block_owner.get(h)
            if owner is None or (holder is not None and owner != holder):
                break
            holder = owner
            lead += 1
        r.cached = min(lead * MOONCAKE_BLOCK_TOKENS, r.prompt - 1)
        r.holder = holder if holder is not None and holder != inst.iid else None
        if holder == inst.iid:
            pass  # local hit: no fetch
        for h in t.prefix_hash_ids:
            self.block_owner.setdefault(h, inst.iid)
        r.slo = c.slo_factor * self.isolated_ttft_ms(r.prompt, r.cached)
        r.deadline = t.arrival_ms + r.slo
        inst.queue.append(r)
        inst.queued_tokens += r.prompt - r.cached
        return self._start_batch(inst)

    def _start_batch(self, inst: _Instance) -> list[Event]:
        if inst.busy or not inst.queue:
            return []
        c = self.config
        batch, tokens = [], 0
        while inst.queue and (not batch or tokens + inst.queue[0].prompt - inst.queue[0].cached <= c.batch_tokens):
            r = inst.queue.popleft()
            batch.append(r)
            tokens += r.prompt - r.cached
        inst.queued_tokens -= tokens
        inst.busy = True
        self._seq += 1
        u = _Unit(f"u{self._seq}", inst, batch)
        self.units[u.uid] = u
        now = self.sim.now_ms
        u.t0 = now
        deadlines = tuple(sorted(r.deadline for r in batch))
        dst = inst.servers[0]
        for r in batch:
            if r.holder is None or r.cached <= 0:
                continue
            src = self.instances[r.holder].servers[0]
            size = self.kv_bytes(r.cached) / c.layer_blocks
            for b in range(c.layer_blocks):
                self._add_flow(u, b, Stage.KV_REUSE, r, src, dst, size, target_layer=b * self.layers_per_block,
                               deadlines=deadlines)
        events = self._commit()
        return events + self._try_block(u)

    # -- flows ---------------------------------------------------------------------------------------------
    def _add_flow(self, u: _Unit | None, block: int, stage: Stage, r: _FReq, src: int, dst: int, size: float,
                  target_layer: int | None = None, deadline: float | None = None,
                  deadlines: tuple[float, ...] = ()) -> None:
        self._seq += 1
        fid = f"f{self._seq}"
        path = (f"up{src}", f"dn{dst}")
        spec = FlowSpec(flow_id=fid, request_id=r.rid, unit_id=u.uid if u else f"p2d-{r.rid}", stage=stage,
                        size_bytes=max(int(size), 1), src=str(src), dst=str(dst), path=path,
                        target_layer=target_layer, deadline_ms=deadline, request_deadlines_ms=deadlines,
                        request_deadline_ms=r.deadline)
        now = self.sim.now_ms
        self.sched.on_arrival(spec, now)
        self.net.add_flow(fid, path, max(int(size), 1), now, key=(math.inf,))
        self.flow_meta[fid] = (u, block, stage, r)
        if u is not None:
            u.pending[block] = u.pending.get(block, 0) + 1

    def _sync_keys(self) -> None:
        now = self.sim.now_ms
        keys = self.sched.service_keys(now)
        net = self.net
        for fid, f in net.flows.items():
            k = keys.get(fid)
            net.set_key(fid, k if k is not None else (math.inf,), now)  # pruned / unknown: lowest
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
        self._refresh_scheduled = False
        return self._commit()

    def _flow_done(self, sim: Simulator, flow: Any, now: float) -> list[Event]:
        fid = flow.fid
        self.sched.on_complete(fid, now)
        u, block, stage, r = self.flow_meta.pop(fid)
        if stage is Stage.P2D:
            r.done_ms = now
            self.earliness_ms.append(r.deadline - now)
            return []
        u.pending[block] -= 1
        if u.pending[block] > 0:
            return []
        if stage is Stage.COLLECTIVE:
            self.cct_ms.append(now - u.cct_start)
            u.block += 1
            u.busy = False
        return self._try_block(u)

    # -- blocks --------------------------------------------------------------------------------------------
    def _try_block(self, u: _Unit) -> list[Event]:
        c = self.config
        if u.block >= c.layer_blocks:
            return self._finish_unit(u)
        if u.busy or u.pending.get(u.block, 0) > 0:
            return []  # computing, in its collective, or waiting for this block's KV fetches
        u.busy = True
        now = self.sim.now_ms
        self.sched.on_layer_boundary(u.uid, u.block * self.layers_per_block, now)
        tokens = sum(r.prompt - r.cached for r in u.reqs)
        ctx = sum(r.prompt for r in u.reqs)
        dt = self.compute_block_ms(tokens, ctx, len(u.reqs))
        return [(now + dt, self._block_computed, u)] + self._commit()

    def _block_computed(self, sim: Simulator, u: _Unit) -> list[Event]:
        c = self.config
        servers = u.inst.servers
        if len(servers) == 1:
            u.block += 1
            u.busy = False
            return self._try_block(u)
        tokens = sum(r.prompt - r.cached for r in u.reqs)
        size = self.a2a_bytes_per_flow(tokens)
        u.cct_start = sim.now_ms
        rep = u.reqs[0]
        deadlines = tuple(sorted(r.deadline for r in u.reqs))
        # the collective's own block slot: block index offset so it is not confused with fetches of block+1
        key = u.block
        u.pending[key] = u.pending.get(key, 0)
        for i in servers:
            for j in servers:
                if i != j:
                    self._add_flow(u, key, Stage.COLLECTIVE, rep, i, j, size, target_layer=u.block * self.layers_per_block,
                                   deadlines=deadlines)
        return self._commit()

    def _finish_unit(self, u: _Unit) -> list[Event]:
        now = self.sim.now_ms
        self.sched.on_unit_done(u.uid, now)
        src = u.inst.servers[0]
        for r in u.reqs:
            dst = self.decode_servers[self._next_decode % len(self.decode_servers)]
            self._next_decode += 1
            self._add_flow(None, 0, Stage.P2D, r, src, dst, self.kv_bytes(r.prompt), deadline=r.deadline)
        u.inst.busy = False
        del self.units[u.uid]
        return self._start_batch(u.inst) + self._commit()

    # -- run -----------------------------------------------------------------------------------------------
    def run(self, drain_ms: float = 20_000.0) -> dict[str, Any]:
        for t in self.workload:
            self.sim.schedule(t.arrival_ms, self._arrive, t)
        end = (self.workload[-1].arrival_ms if self.workload else 0.0) + drain_ms
        self.sim.run(until_ms=end)
        records = [RequestRecord(request_id=r.rid, tier="interactive", ttft_slo_ms=r.slo, tpot_slo_ms=1e9, weight=1.0,
                                 send_ms=r.t.arrival_ms, first_token_ms=r.done_ms, finish_ms=r.done_ms,
                                 output_tokens=1, prompt_tokens=r.prompt) for r in self.reqs]
        span_s = max((self.workload[-1].arrival_ms if self.workload else 0.0) / 1000.0, 1e-3)
        report = summarize(records, duration_s=span_s)
        nonneg = [e for e in self.earliness_ms if e >= 0]
        return {"scheduler": self.name, "report": report, "records": records,
                "cct_ms": Distribution.of(self.cct_ms), "earliness_ms": Distribution.of(nonneg),
                "cct_samples": self.cct_ms, "earliness_samples": nonneg,
                "events": self.sim.events_run, "sim_ms": self.sim.now_ms, "wall_s": self.sim.wall_s,
                "flows": self.net.flows_done, "reallocations": self.net.reallocations}


__all__ = ["FlowClusterConfig", "FlowClusterSim"]
