"""The Nuska setting: a P/D prefill cluster with KV reuse and MoE expert-parallel collectives, whose
network flows are ordered by a `nitsum.policy.flows` FlowScheduler (the same objects the flow-scheduler
service and the transfer agents run).

Model (coarse on purpose, so 256 servers run on one core):
- Servers of 8 GPUs; `prefill_fraction` of them prefill, the rest decode (P2D destinations). A prefill
  instance has TP x EP GPUs (`flowsetup`: 32 GPUs = 4 servers for the paper's setups): EP groups of TP GPUs,
  attention data-parallel over the groups, experts sharded over them.
- Network: every server has one uplink and one downlink of `nics x nic_bps` (1:1 fat-tree = non-blocking
  core, so only server links contend). Flow rates: strict priority by the scheduler's service key, max-min
  fair among equal keys (`network.Network`); Karuna's pacing rates become rate caps. RMLQ's MLU uses the
  same link capacities (set on the scheduler); every `refresh_ms` the scheduler learns each flow's remaining
  bytes (what the transfer agents report live).
- Routing (KV-aware, as Dynamo's router): a request goes to the instance with the least queued and running
  new tokens plus the tokens it would compute there (its prompt minus the prefix that instance already holds). Inside
  the instance it has a home server (its attention group's server, round robin): its KV lives there.
- A batch (unit) runs its layers in `layer_blocks` blocks. Before block b: its KV-reuse fetches for
  block b must have arrived (stage 1, holder server -> home server, target layer = first layer of b). After
  block b's compute: the all-to-all of block b between the instance's servers (stage 2) must finish before
  block b+1 (compute stalls meanwhile: the non-overlapped CCT). Stage 3, layer-wise as in the paper (§4.3):
  right after block b's compute, each request's KV of block b goes from its home server to its decode server
  (explicit deadline = its TTFT deadline; the flow belongs to the batch, so RMLQ promotes it at the batch's
  layer boundaries while it computes and on the timer after); its first token counts when its last block's
  transfer ends. `p2d_layerwise=False`: one transfer per request after the last block instead.
- Compute per block from the shared cost model (`flowsetup.shard_spec`: one EP group's 1/EP of the tokens
  at TP; A100 table by default).
- KV reuse: Mooncake hash_ids (512-token blocks); a block lives on the server that first computed it
  (unlimited cache); a request's leading cached blocks are fetched from there unless its instance has them.
  `warm`: earlier trace requests whose KV is already placed (see `_warm_cache`), so a window of a trace keeps
  the trace's reuse ratio.
- TTFT SLO of a request = `slo_factor` x its TTFT on an idle cluster (compute + transfers at full rate).
- Overload pruning (`prune=True`): on every batch start and departure the scheduler's `prune` runs once per
  source server of the instance, over the requests with flows leaving it (delay = their remaining bytes at
  the link rate; a unit still computing adds its remaining compute once, shared by its requests). A pruned
  request's flows are withdrawn, it leaves its batch and ends with error "pruned" (a miss; the live service
  answers it with a retryable code). Only RMLQ prunes; the baselines' `prune` returns nothing unless
  `prune_baselines` gives them the same check in their own unit order (the breakdown).
Layout: flowsim_parts.py (configuration and records), flowsim_traffic.py (flows, keys, pruning: a mixin).
Not modelled: decode, link load rho (0), packet effects, expert-load imbalance, same-server expert dedup.
"""

from __future__ import annotations

import math
from typing import Any

from nitsum.metrics import Distribution, RequestRecord, summarize
from nitsum.policy.costmodel import CostModel, ModelSpec, cost_model
from nitsum.policy.flow_baselines import make_flow_scheduler
from nitsum.policy.flows import Stage
from nitsum.policy.steptable import select
from nitsum.sim.engine import Event, Simulator
from nitsum.sim.flowsetup import moe_spec, shard_spec
from nitsum.sim.flowsim_parts import MOONCAKE_BLOCK_TOKENS, FlowClusterConfig, _FReq, _Instance, _Unit
from nitsum.sim.flowsim_traffic import FlowTraffic
from nitsum.sim.network import Network
from nitsum.workloads.request import TraceRequest


class FlowClusterSim(FlowTraffic):
    def __init__(
        self,
        scheduler: str,
        config: FlowClusterConfig,
        workload: list[TraceRequest],
        warm: list[TraceRequest] | tuple = (),
    ) -> None:
        c = self.config = config
        self.name = scheduler
        self.model: ModelSpec = moe_spec(c.model)
        self.cost: CostModel = cost_model(shard_spec(self.model, c.ep), c.device_kind)
        if c.device_table is not None:
            self.cost = CostModel(
                self.cost.model,
                self.cost.device,
                steps=select(c.device_table, c.device_kind, self.cost.model, "device table"),
            )
        self.sim = Simulator()
        self.net = Network(self._flow_done)
        link_bps = c.nics_per_server * c.nic_bps
        self.link_bps = link_bps
        self.link_map = {f"{d}{s}": link_bps for s in range(c.num_servers) for d in ("up", "dn")}
        for s in range(c.num_servers):
            self.net.add_link(f"up{s}", link_bps)
            self.net.add_link(f"dn{s}", link_bps)
        self.sched = make_flow_scheduler(scheduler, overload_check=True if c.prune_baselines else None)
        if hasattr(self.sched, "set_link_bandwidth"):
            for link, bps in self.link_map.items():
                self.sched.set_link_bandwidth(link, bps)
        s_inst = c.instance_servers
        n_prefill = int(c.num_servers * c.prefill_fraction) // s_inst * s_inst
        assert n_prefill >= s_inst and n_prefill < c.num_servers, "need prefill and decode servers"
        self.instances = [_Instance(i, list(range(i * s_inst, (i + 1) * s_inst))) for i in range(n_prefill // s_inst)]
        self.instance_of_server = {s: inst.iid for inst in self.instances for s in inst.servers}
        self.decode_servers = list(range(n_prefill, c.num_servers))
        self._next_decode = 0
        self.workload = sorted(workload, key=lambda r: r.arrival_ms)
        self.reqs: list[_FReq] = []
        self.block_owner: dict[int, int] = {}  # hash id -> server holding its KV
        self.units: dict[str, _Unit] = {}
        self.flow_meta: dict[str, tuple] = {}
        self._seq = 0
        self.cct_ms: list[float] = []
        self.earliness_ms: list[float] = []
        self.layers_per_block = max(self.model.num_layers // c.layer_blocks, 1)
        self._refresh_scheduled = False
        # where the time and the bytes go (the bottleneck measurement)
        self.compute_ms = 0.0
        self.stall_fetch_ms = 0.0
        self.stall_a2a_ms = 0.0
        self.bytes_by_stage: dict[str, float] = {s.value: 0.0 for s in Stage}
        self.link_bytes: dict[str, float] = {}
        self.pruned: list[str] = []
        self.last_ms = 0.0  # the last flow completion or batch end
        self._warm_cache(warm)

    def _warm_cache(self, warm: list[TraceRequest] | tuple) -> None:
        """Place the KV of earlier trace requests as a KV-aware router would have: a request whose leading
        block is cached continues on that block's server, any other starts on the next prefill server."""
        servers = [s for inst in self.instances for s in inst.servers]
        nxt = 0
        for t in warm:
            hashes = t.prefix_hash_ids[
                : math.ceil(min(t.prompt_tokens, self.config.max_prompt_tokens) / MOONCAKE_BLOCK_TOKENS)
            ]
            if not hashes:
                continue
            owner = self.block_owner.get(hashes[0])
            if owner is None:
                owner = servers[nxt % len(servers)]
                nxt += 1
            for h in hashes:
                self.block_owner.setdefault(h, owner)

    def reuse(self) -> dict[str, float]:
        """Cached prefix tokens / prompt tokens of the workload, and the part of them fetched from elsewhere."""
        prompt = sum(r.prompt for r in self.reqs) or 1
        return {
            "reuse_ratio": sum(r.cached for r in self.reqs) / prompt,
            "fetched_ratio": sum(r.cached for r in self.reqs if r.holder is not None) / prompt,
        }

    # -- costs ---------------------------------------------------------------------------------------------
    def compute_block_ms(self, tokens: int, context: int, batch: int) -> float:
        e = self.config.ep
        step = self.cost.step_time_ms(self.config.tp, max(batch // e, 1), max(tokens // e, 1), max(context // e, 1))
        return step / self.config.layer_blocks

    def a2a_bytes_per_flow(self, tokens: int) -> float:
        """One block's all-to-all, server i -> j: dispatch + combine of the tokens routed across servers
        (tokens spread evenly over the S servers, experts uniformly loaded)."""
        s, m = self.config.instance_servers, self.model
        per_layer = tokens / s * m.experts_per_token * m.hidden_size * 2.0 * 2 / s  # bf16, dispatch+combine
        return per_layer * self.layers_per_block

    def kv_bytes(self, tokens: int) -> float:
        return tokens * self.model.kv_bytes_per_token

    def isolated_ttft_ms(self, prompt: int, cached: int, fetch: bool) -> float:
        new = max(prompt - cached, 1)
        bw = self.link_bps / 8 / 1000  # bytes/ms
        s, blocks = self.config.instance_servers, self.config.layer_blocks
        compute = self.compute_block_ms(new, prompt, 1) * blocks
        a2a = self.a2a_bytes_per_flow(new) * (s - 1) / bw * blocks if s > 1 else 0.0
        fetch_first = self.kv_bytes(cached) / blocks / bw if fetch else 0.0
        if not self.config.p2d_layerwise:
            return compute + a2a + fetch_first + self.kv_bytes(prompt) / bw
        # layer-wise: block b's transfer starts when its compute (and all-to-all) ends, one after another
        per_block, x = (compute + a2a) / blocks, self.kv_bytes(prompt) / blocks / bw
        sent = 0.0
        for b in range(1, blocks + 1):
            sent = max(sent, fetch_first + b * per_block) + x
        return sent

    # -- arrivals and batching -----------------------------------------------------------------------------
    def _arrive(self, sim: Simulator, t: TraceRequest) -> list[Event]:
        c = self.config
        r = _FReq(f"r{len(self.reqs)}", t, min(t.prompt_tokens, c.max_prompt_tokens))
        self.reqs.append(r)
        hashes = t.prefix_hash_ids[: math.ceil(r.prompt / MOONCAKE_BLOCK_TOKENS)]
        lead, holder = 0, None  # leading blocks cached on one server
        for h in hashes:
            owner = self.block_owner.get(h)
            if owner is None or (holder is not None and owner != holder):
                break
            holder = owner
            lead += 1
        cached = min(lead * MOONCAKE_BLOCK_TOKENS, r.prompt - 1)
        holder_inst = self.instance_of_server.get(holder) if holder is not None else None

        def cost(inst: _Instance) -> tuple:
            new = r.prompt - (cached if inst.iid == holder_inst else 0)
            return (inst.queued_tokens + inst.running_tokens + new, inst.iid)

        inst = min(self.instances, key=cost)
        r.cached = cached
        if holder is not None and inst.iid == holder_inst:
            r.home = holder  # local hit: its attention group already holds the prefix
        else:
            r.home = inst.servers[inst.rr % len(inst.servers)]
            inst.rr += 1
            r.holder = holder if cached > 0 else None
        for h in hashes:
            self.block_owner.setdefault(h, r.home)
        r.slo = c.slo_factor * self.isolated_ttft_ms(r.prompt, r.cached, r.holder is not None)
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
        inst.running_tokens = tokens
        inst.busy = True
        self._seq += 1
        u = _Unit(f"u{self._seq}", inst, batch)
        self.units[u.uid] = u
        deadlines = tuple(sorted(r.deadline for r in batch))
        for r in batch:
            r.unit = u
            if r.holder is None or r.cached <= 0:
                continue
            size = self.kv_bytes(r.cached) / c.layer_blocks
            for b in range(c.layer_blocks):
                self._add_flow(
                    u,
                    b,
                    Stage.KV_REUSE,
                    r,
                    r.holder,
                    r.home,
                    size,
                    target_layer=b * self.layers_per_block,
                    deadlines=deadlines,
                )
        events = self._prune(inst) + self._commit()
        return events + self._try_block(u)

    # -- blocks --------------------------------------------------------------------------------------------
    def _try_block(self, u: _Unit) -> list[Event]:
        c = self.config
        if u.block >= c.layer_blocks:
            return self._finish_unit(u)
        now = self.sim.now_ms
        if u.busy:
            return []
        if all(r.error is not None for r in u.reqs):
            # every request of the batch was pruned: nothing left to compute (an event, not a call: a run of
            # pruned batches would otherwise recurse once per batch)
            return [(now, self._pruned_unit_ends, u)]
        if u.pending.get(u.block, 0) > 0:
            if u.wait_from is None:
                u.wait_from = now  # stalled on this block's KV fetches
                # the batch is at this block's first layer, computing nothing until they arrive: its current
                # layer, so their RLI is 0 (stage 1 rises as the unit's current layer advances)
                self.sched.on_layer_boundary(u.uid, u.block * self.layers_per_block, now)
                return self._commit()
            return []
        if u.wait_from is not None:
            self.stall_fetch_ms += now - u.wait_from
            u.wait_from = None
        u.busy = True
        self.sched.on_layer_boundary(u.uid, u.block * self.layers_per_block, now)
        dt = self.compute_block_ms(u.tokens(), sum(r.prompt for r in u.reqs), len(u.reqs))
        self.compute_ms += dt
        u.block_end = now + dt
        return [(now + dt, self._block_computed, u)] + self._commit()

    def _block_computed(self, sim: Simulator, u: _Unit) -> list[Event]:
        if self.config.p2d_layerwise:
            for r in u.reqs:
                self._send_p2d(u, r, self.kv_bytes(r.prompt) / self.config.layer_blocks)
        servers = u.inst.servers
        if len(servers) == 1:
            u.block += 1
            u.busy = False
            return self._try_block(u)
        size = self.a2a_bytes_per_flow(u.tokens())
        u.cct_start = sim.now_ms
        deadlines = tuple(sorted(r.deadline for r in u.reqs))
        key = u.block
        for i in servers:
            for j in servers:
                if i != j:
                    self._add_flow(
                        u,
                        key,
                        Stage.COLLECTIVE,
                        None,
                        i,
                        j,
                        size,
                        target_layer=u.block * self.layers_per_block,
                        deadlines=deadlines,
                    )
        return self._commit()

    def _pruned_unit_ends(self, sim: Simulator, u: _Unit) -> list[Event]:
        return self._finish_unit(u) if u.uid in self.units else []

    def _finish_unit(self, u: _Unit) -> list[Event]:
        now = self.sim.now_ms
        self.last_ms = max(self.last_ms, now)
        self.sched.on_unit_done(u.uid, now)
        if not self.config.p2d_layerwise:
            for r in u.reqs:
                self._send_p2d(None, r, self.kv_bytes(r.prompt))
        u.inst.busy = False
        u.inst.running_tokens = 0
        del self.units[u.uid]
        return self._prune(u.inst) + self._start_batch(u.inst) + self._commit()

    def _send_p2d(self, u: _Unit | None, r: _FReq, size: float) -> None:
        """One stage-3 flow of `r` to its decode server (chosen round robin with its first one)."""
        if r.error is not None:
            return
        if r.dst is None:
            r.dst = self.decode_servers[self._next_decode % len(self.decode_servers)]
            self._next_decode += 1
        r.p2d_emitted += 1
        r.p2d_left += 1
        self._add_flow(u, 0, Stage.P2D, r, r.home, r.dst, size, deadline=r.deadline, blocking=False)

    # -- run -----------------------------------------------------------------------------------------------
    def run(self, drain_ms: float = 20_000.0) -> dict[str, Any]:
        for t in self.workload:
            self.sim.schedule(t.arrival_ms, self._arrive, t)
        end = (self.workload[-1].arrival_ms if self.workload else 0.0) + drain_ms
        self.sim.run(until_ms=end)
        records = [
            RequestRecord(
                request_id=r.rid,
                tier="interactive",
                ttft_slo_ms=r.slo,
                tpot_slo_ms=1e9,
                weight=1.0,
                send_ms=r.t.arrival_ms,
                first_token_ms=r.done_ms,
                finish_ms=r.done_ms,
                output_tokens=1,
                prompt_tokens=r.prompt,
                error=r.error,
            )
            for r in self.reqs
        ]
        span_s = max((self.workload[-1].arrival_ms if self.workload else 0.0) / 1000.0, 1e-3)
        report = summarize(records, duration_s=span_s)
        busy_ms = max(span_s * 1000.0, self.last_ms)
        nonneg = [e for e in self.earliness_ms if e >= 0]
        return {
            "scheduler": self.name,
            "report": report,
            "records": records,
            "cct_ms": Distribution.of(self.cct_ms),
            "earliness_ms": Distribution.of(nonneg),
            "cct_samples": self.cct_ms,
            "earliness_samples": nonneg,
            "events": self.sim.events_run,
            "sim_ms": self.sim.now_ms,
            "wall_s": self.sim.wall_s,
            "flows": self.net.flows_done,
            "reallocations": self.net.reallocations,
            "pruned": len(self.pruned),
            "bottleneck": self.bottleneck(busy_ms),
            **self.reuse(),
        }

    def bottleneck(self, span_ms: float) -> dict[str, float]:
        """Where the time and the bytes went, from 0 to the last batch end or transfer: instance time computing / stalled on
        stage-1 fetches / stalled in stage-2 all-to-alls, and link utilisation (mean over the prefill
        servers' uplinks by stage, and the busiest link)."""
        c = self.config
        inst_ms = max(span_ms, 1e-9) * len(self.instances)
        link_cap = self.link_bps / 8 / 1000 * max(span_ms, 1e-9)
        n_prefill = len(self.instances) * c.instance_servers
        out = {
            "compute_busy": self.compute_ms / inst_ms,
            "stall_fetch": self.stall_fetch_ms / inst_ms,
            "stall_a2a": self.stall_a2a_ms / inst_ms,
        }
        for s in Stage:
            if s is not Stage.MIGRATION:
                out[f"uplink_util_stage{s.value}"] = self.bytes_by_stage[s.value] / (link_cap * n_prefill)
        out["link_util_max"] = max(self.link_bytes.values(), default=0.0) / link_cap
        return out


__all__ = ["MOONCAKE_BLOCK_TOKENS", "FlowClusterConfig", "FlowClusterSim"]
