"""The Nuska P/D prefill cluster's configuration and its mutable records (flowsim.py): `FlowClusterConfig`,
the batch units, the prefill instances and the requests as the simulator tracks them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nitsum.workloads.request import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class FlowClusterConfig:
    num_servers: int = 256
    gpus_per_server: int = 8
    nics_per_server: int = 8
    nic_bps: float = 200e9
    prefill_fraction: float = 0.5
    model: str = "mixtral-8x22b"  # a flowsetup.MOE_PRESETS name
    tp: int = 4
    ep: int = 8  # TP x EP GPUs per prefill instance (Mixtral-8x22B TP4/EP8: 32 GPUs = 4 servers)
    device_kind: str = "a100"
    device_table: tuple | None = None  # measured step-time rows (policy/steptable.py) for (device_kind, shard model)
    layer_blocks: int = 4
    batch_tokens: int = 32_768
    slo_factor: float = 3.0
    refresh_ms: float = 2.0  # how often schedulers with timers (RMLQ's MLU promotion) are consulted
    max_prompt_tokens: int = 32_768
    prune: bool = True
    # the breakdown: the baselines run RMLQ's worst-case check and pruning too, each in its own unit order
    prune_baselines: bool = False
    # Stage 3 layer by layer, as the paper's P2D stage (§4.3: "At each layer l, the P2D stage emits a set of
    # flows"; §2: layer-wise KV transfers contend with the collectives of other layers): each block's KV of
    # each request leaves right after that block's compute. False: one transfer per request after the last block.
    p2d_layerwise: bool = True

    @property
    def instance_servers(self) -> int:
        gpus = self.tp * self.ep
        if gpus % self.gpus_per_server:
            raise ValueError(f"TP{self.tp} x EP{self.ep} = {gpus} GPUs is not whole servers of {self.gpus_per_server}")
        return gpus // self.gpus_per_server


class _Unit:
    __slots__ = ("uid", "inst", "reqs", "block", "pending", "cct_start", "busy", "block_end", "wait_from")

    def __init__(self, uid: str, inst: _Instance, reqs: list) -> None:
        self.uid, self.inst, self.reqs = uid, inst, reqs
        self.block = 0
        self.pending: dict[int, int] = {}  # block -> flows (fetch for it / collective of it) outstanding
        self.cct_start = 0.0
        self.busy = False  # computing a block or waiting for its collective
        self.block_end = 0.0  # when the block computing now ends
        self.wait_from: float | None = None  # waiting on stage-1 fetches since

    def tokens(self) -> int:
        return sum(r.prompt - r.cached for r in self.reqs)


class _Instance:
    __slots__ = ("iid", "servers", "queue", "busy", "queued_tokens", "running_tokens", "rr")

    def __init__(self, iid: int, servers: list[int]) -> None:
        self.iid, self.servers = iid, servers
        self.queue: deque = deque()
        self.busy = False
        self.queued_tokens = 0
        self.running_tokens = 0  # new tokens of the batch computing now
        self.rr = 0


class _FReq:
    __slots__ = (
        "rid",
        "t",
        "prompt",
        "cached",
        "holder",
        "home",
        "deadline",
        "slo",
        "done_ms",
        "error",
        "unit",
        "flows",
        "dst",
        "p2d_emitted",
        "p2d_left",
    )

    def __init__(self, rid: str, t: TraceRequest, prompt: int) -> None:
        self.rid, self.t, self.prompt = rid, t, prompt
        self.cached = 0
        self.holder: int | None = None  # server to fetch the cached prefix from (None: local or none)
        self.home = 0
        self.deadline = 0.0
        self.slo = 1.0
        self.done_ms: float | None = None
        self.error: str | None = None
        self.unit: _Unit | None = None
        self.flows: set[str] = set()
        self.dst: int | None = None  # its decode server, chosen with its first P2D flow
        self.p2d_emitted = 0  # P2D flows sent so far (layer-wise: one per block)
        self.p2d_left = 0  # of those, not yet delivered
