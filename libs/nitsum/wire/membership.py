"""Membership messages: a worker's heartbeat (WorkerStats, worker → coordinator) and the coordinator's word that a
worker is gone (WorkerLost, coordinator → gateways).

Part of `nitsum.wire.messages` (import them from there; its module docstring states the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class WorkerStats:
    """Worker → coordinator heartbeat; the coordinator rebuilds its state from these after a restart."""

    KIND: ClassVar[str] = "worker_stats"
    VERSION: ClassVar[int] = 1
    worker_id: str
    node_id: str
    device_index: int
    device: str
    role: str
    state: str  # "starting" | "ready" | "draining" | "stopped"
    group_id: str
    tp: int
    model_name: str
    max_model_len: int
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    running_request_ids: tuple[str, ...] = ()
    cached_block_hashes: tuple[int, ...] = ()
    sent_unix_ms: float = 0.0
    step_ms_ewma: float = 0.0
    num_prefill_tokens_computed: int = 0
    num_cached_prompt_tokens: int = 0
    num_aborted: int = 0
    instance_id: str = ""  # new on every process start: a restarted worker is a new instance
    epoch: int = 0  # the last topology epoch this worker committed
    in_world: bool = False  # member of its node's process world (can take part in TP changes)
    leader: bool = True  # leads its group (only leaders take requests)
    block_size: int = 0  # tokens per KV block (the coordinator hashes prompts with it for KV reuse)
    num_kv_imported: int = 0  # requests adopted from a prefill worker (P/D)
    num_reused_blocks: int = 0  # prefix blocks fetched from other workers instead of computed (stage 1)
    num_transfer_failures: int = 0  # KV transfers that failed at this end (either side)
    node_size: int = 0  # workers of its node's world (NITSUM_NODE_SIZE; 0: a standalone worker)
    generation: int = 0  # generation of the node world it is (or was last) in; 0: the boot world or none
    # Per running_request_ids entry (same order; empty from an older worker): tokens streamed so far (the
    # stream index: a re-submitted request counts the tokens it came with), and ms between its first token
    # here and this message (-1: not yet). The coordinator's snapshot reads decode progress from these.
    running_output_tokens: tuple[int, ...] = ()
    running_first_token_age_ms: tuple[float, ...] = ()
    # Requests whose streams ended here (finished, failed, aborted; not handed off or moved) since the last
    # heartbeat, with the attempt each served: the coordinator stops counting them at once instead of a grace
    # period after a heartbeat stops listing them.
    finished_request_ids: tuple[str, ...] = ()
    finished_attempts: tuple[int, ...] = ()
    # A TP>1 group's leader that can gather and scatter its members' KV heads (its world's KV path is shared
    # memory): the KV mover's P/D hand-offs and prefix fetches across hosts apply to it as to a one-cache worker.
    kv_gather: bool = False


@dataclass(frozen=True)
class WorkerLost:
    """Coordinator → gateways: a worker stopped reporting; its requests must be re-submitted."""

    KIND: ClassVar[str] = "worker_lost"
    VERSION: ClassVar[int] = 1
    worker_id: str
    request_ids: tuple[str, ...]
    reason: str
