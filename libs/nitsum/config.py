"""Typed NITSUM_* settings → one frozen config per service.

Each config is a frozen dataclass whose fields declare their environment variable, help text and
validation (`nitsum.settings`). `load(cls, argv, environ)` reads the environment, then command-line flags
(`--field-name`) override it; any bad value raises ConfigError naming the setting, and a service stops at
start with that message. Secrets (`secret=True`) are never printed: `describe()` masks them.
"""

from __future__ import annotations

from dataclasses import dataclass

from nitsum.settings import CommonConfig, non_negative, one_of, port, positive, power_of_two, setting, settings_of

# Re-exported: the services and tools take these from here with their configs.
from nitsum.settings import ConfigError as ConfigError
from nitsum.settings import default_home as default_home
from nitsum.settings import describe as describe
from nitsum.settings import load as load
from nitsum.settings import nats_urls as nats_urls

# A node world re-formed as generation g meets at NITSUM_NODE_MASTER_PORT + g % NODE_PORT_SPAN.
NODE_PORT_SPAN = 16


def node_port(value: int) -> str | None:
    """A node world's base rendezvous port: its re-formed generations use the NODE_PORT_SPAN - 1 ports above."""
    top = 65535 - NODE_PORT_SPAN + 1
    return port(value) or (
        None
        if value <= top
        else f"must be at most {top}: re-formed node worlds meet at up to {NODE_PORT_SPAN - 1} ports above it"
    )


def die_at(value: str) -> str | None:
    """NITSUM_FAULT_DIE_AT: "" or "<prepare|commit>:<epoch>:<device index>"."""
    if not value:
        return None
    parts = value.split(":")
    if (
        len(parts) != 3
        or parts[0] not in ("prepare", "commit")
        or not all(p.isdigit() and int(p) > 0 for p in parts[1:2])
        or not parts[2].isdigit()
    ):
        return "must be <prepare|commit>:<epoch >= 1>:<device index>, e.g. prepare:2:3"
    return None


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def default_dtype(device: str) -> str:
    """What NITSUM_DTYPE=auto means: fp32 on CPU (exact parity, and CPUs have no fast bf16 matmul), bf16 on
    CUDA (half the bytes per weight and KV entry; the tensor cores' type). `device` is cpu, cuda[:N], or a
    cost-model device kind (h100, h200, a100)."""
    return "float32" if device == "cpu" else "bfloat16"


def parse_die_at(value: str) -> tuple[str, int, int] | None:
    """(phase, epoch, device index) of NITSUM_FAULT_DIE_AT, or None when off (the value was checked)."""
    if not value:
        return None
    phase, epoch, device = value.split(":")
    return phase, int(epoch), int(device)


def parse_objectives(value: str) -> dict[str, str]:
    """NITSUM_GATEWAY_OBJECTIVES "name=tier,..." as a map; every tier name maps to itself as well."""
    from nitsum.policy.tiers import DEFAULT_TIERS

    out = {name: name for name in DEFAULT_TIERS}
    for pair in (p.strip() for p in value.split(",")):
        if pair:
            name, _, tier = pair.partition("=")
            out[name.strip()] = tier.strip()
    return out


def objective_map_error(value: str) -> str | None:
    from nitsum.policy.tiers import DEFAULT_TIERS

    for pair in (p.strip() for p in value.split(",")):
        name, eq, tier = pair.partition("=")
        if pair and (not eq or not name.strip() or tier.strip() not in DEFAULT_TIERS):
            return f"must be name=tier pairs with tiers from {', '.join(sorted(DEFAULT_TIERS))}, got {pair!r}"
    return None


@dataclass(frozen=True)
class GatewayConfig(CommonConfig):
    host: str = setting("NITSUM_GATEWAY_HOST", "0.0.0.0", "HTTP listen address")
    port: int = setting("NITSUM_GATEWAY_PORT", 8000, "HTTP listen port", check=port)
    reuse_port: bool = setting(
        "NITSUM_GATEWAY_REUSE_PORT",
        False,
        "share the listen port with other gateway processes (SO_REUSEPORT: the kernel spreads connections); "
        "`nitsum up --gateways N` sets it",
    )
    model: str = setting("NITSUM_MODEL", "tiny", "model directory (Hugging Face format) or 'tiny'")
    served_model_name: str = setting(
        "NITSUM_SERVED_MODEL_NAME", "", "model name in the API (default: the directory name)"
    )
    max_body_bytes: int = setting("NITSUM_MAX_BODY_BYTES", 8 << 20, "largest accepted request body", check=positive)
    max_messages: int = setting("NITSUM_MAX_MESSAGES", 1024, "most chat messages in one request", check=positive)
    default_tier: str = setting("NITSUM_DEFAULT_TIER", "interactive", "tier of requests without x-request-tier")
    submit_timeout_s: float = setting(
        "NITSUM_SUBMIT_TIMEOUT_S", 15.0, "longest wait for the coordinator to place a request", check=positive
    )
    stream_timeout_s: float = setting(
        "NITSUM_STREAM_TIMEOUT_S", 30.0, "longest silence of a worker before the request is re-routed", check=positive
    )
    max_reroutes: int = setting(
        "NITSUM_MAX_REROUTES", 2, "re-submissions of a request whose worker was lost", check=non_negative
    )
    ready_timeout_s: float = setting(
        "NITSUM_READY_TIMEOUT_S", 5.0, "time budget of the /ready 1-token generation", check=positive
    )
    allow_unknown_fields: bool = setting(
        "NITSUM_GATEWAY_ALLOW_UNKNOWN_FIELDS",
        False,
        "ignore (rather than refuse with 400) request fields the gateway does not know; listed in x-nitsum-ignored-fields",
    )
    objectives: str = setting(
        "NITSUM_GATEWAY_OBJECTIVES",
        "critical=interactive,standard=interactive,sheddable=background",
        "x-gateway-inference-objective name=tier pairs (each tier name is also an objective)",
        check=lambda v: objective_map_error(v),
    )


@dataclass(frozen=True)
class CoordinatorConfig(CommonConfig):
    policy: str = setting("NITSUM_POLICY", "adaptive", "adaptive | static-tp:K | disagg | static-hybrid")
    reconfig_interval_ms: int = setting("NITSUM_RECONFIG_INTERVAL_MS", 1000, "policy epoch", check=positive)
    max_tp: int = setting("NITSUM_MAX_TP", 4, "largest TP level of a group", check=power_of_two)
    min_tp: int = setting("NITSUM_MIN_TP", 1, "smallest TP level of a group", check=power_of_two)
    heartbeat_timeout_ms: int = setting(
        "NITSUM_HEARTBEAT_TIMEOUT_MS", 3000, "a worker silent this long is lost", check=positive
    )
    run_timeout_s: float = setting(
        "NITSUM_RUN_TIMEOUT_S",
        3.0,
        "longest wait for one worker to accept a request before trying the next",
        check=positive,
    )
    queue_limit_interactive: int = setting(
        "NITSUM_QUEUE_LIMIT_INTERACTIVE", 256, "queued interactive requests before 429", check=positive
    )
    queue_limit_background: int = setting(
        "NITSUM_QUEUE_LIMIT_BACKGROUND", 1024, "queued background requests before 429", check=positive
    )
    model: str = setting(
        "NITSUM_MODEL", "tiny", "model directory (Hugging Face format) or 'tiny': the cost model's shapes"
    )
    dtype: str = setting(
        "NITSUM_DTYPE",
        "auto",
        "weights' dtype on the workers (cost model bytes per parameter); auto: float32 for device kind cpu, bfloat16 otherwise",
        check=one_of(*DTYPE_CHOICES),
    )
    device_kind: str = setting(
        "NITSUM_DEVICE_KIND",
        "cpu",
        "cost-model table: cpu | h100 | h200 | a100",
        check=one_of("cpu", "h100", "h200", "a100"),
    )
    device_table: str = setting(
        "NITSUM_DEVICE_TABLE",
        "",
        "measured step-time table (CSV, `nitsum bench profile --csv`); empty: on cpu the committed CPU profile",
    )


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    model: str = setting("NITSUM_MODEL", "tiny", "model directory (Hugging Face format) or 'tiny'")
    worker_id: str = setting("NITSUM_WORKER_ID", "", "unique worker id (default: <node>-<device index>)")
    node_id: str = setting("NITSUM_NODE_ID", "node0", "NVLink domain (host) this worker belongs to")
    device_index: int = setting("NITSUM_DEVICE_INDEX", 0, "device index inside the node", check=non_negative)
    device: str = setting("NITSUM_DEVICE", "cpu", "cpu | cuda", check=one_of("cpu", "cuda"))
    dtype: str = setting(
        "NITSUM_DTYPE",
        "auto",
        "auto | float32 | bfloat16 | float16 (auto: float32 on cpu, bfloat16 on cuda)",
        check=one_of(*DTYPE_CHOICES),
    )
    decode_attention: str = setting(
        "NITSUM_DECODE_ATTENTION",
        "auto",
        "decode attention over the paged KV: auto (flex on cuda, gather on cpu) | flex (in place, torch flex attention with a block mask) | gather (copy the blocks, then SDPA)",
        check=one_of("auto", "flex", "gather"),
    )
    kv_cache_mb: int = setting("NITSUM_KV_CACHE_MB", 64, "KV cache size per worker", check=positive)
    block_size: int = setting("NITSUM_BLOCK_SIZE", 16, "tokens per KV block", check=positive)
    max_num_seqs: int = setting("NITSUM_MAX_NUM_SEQS", 64, "most running requests per step", check=positive)
    max_num_batched_tokens: int = setting(
        "NITSUM_MAX_NUM_BATCHED_TOKENS", 512, "token budget of one step", check=positive
    )
    torch_threads: int = setting("NITSUM_TORCH_THREADS", 1, "torch intra-op threads", check=positive)
    decode_turn_ms: float = setting(
        "NITSUM_DECODE_TURN_MS",
        10.0,
        "longest run of decode-only steps back to back before their tokens are published (0: publish every step)",
        check=non_negative,
    )
    heartbeat_interval_ms: int = setting("NITSUM_HEARTBEAT_INTERVAL_MS", 500, "WorkerStats period", check=positive)
    max_tp: int = setting("NITSUM_MAX_TP", 4, "largest TP level of a group", check=power_of_two)
    enable_reload_free_weights: bool = setting(
        "NITSUM_ENABLE_RELOAD_FREE_WEIGHTS", True, "cut weights once at max_tp granularity and switch TP on views"
    )
    nvlink_p2p_migration: bool = setting(
        "NITSUM_NVLINK_P2P_MIGRATION", False, "map peer weight blocks / copy KV peer-to-peer (CUDA)"
    )
    role: str = setting("NITSUM_ROLE", "", "starting role: prefill | decode | hybrid (default: from the service name)")
    node_size: int = setting(
        "NITSUM_NODE_SIZE",
        0,
        "workers in this node's world for run-time TP changes (0: standalone TP=1)",
        check=non_negative,
    )
    node_master_addr: str = setting(
        "NITSUM_NODE_MASTER_ADDR", "127.0.0.1", "rendezvous address of the node world (device 0 hosts it)"
    )
    node_master_port: int = setting(
        "NITSUM_NODE_MASTER_PORT",
        29400,
        "rendezvous port of the node world; a re-formed world of generation g meets at this port + g mod 16",
        check=node_port,
    )
    node_standby: bool = setting(
        "NITSUM_NODE_STANDBY",
        False,
        "boot standalone (TP=1 on the node's shared weights) and join the node world when the coordinator re-forms it (`nitsum up` sets it on a restarted worker)",
    )
    min_tp: int = setting("NITSUM_MIN_TP", 1, "smallest TP level of a group", check=power_of_two)
    host_id: str = setting(
        "NITSUM_HOST_ID",
        "",
        "host identity for KV migration: workers with the same id share /dev/shm and move KV through it, others over TCP ('': hostname + boot id + /dev/shm device)",
    )
    kv_advertise_addr: str = setting(
        "NITSUM_KV_ADVERTISE_ADDR",
        "",
        "address other hosts' workers reach this worker's KV receiver at ('': 127.0.0.1 when NITSUM_NODE_MASTER_ADDR is loopback, else this host's address on the route to it; port: ephemeral)",
    )
    kv_path: str = setting(
        "NITSUM_KV_PATH",
        "auto",
        "how a TP change moves KV between workers: auto (shared memory on one host, TCP across hosts; gloo p2p on GPUs) | shm | tcp (every pair over TCP) | p2p",
        check=one_of("auto", "shm", "tcp", "p2p"),
    )
    fault_prepare_epoch: int = setting(
        "NITSUM_FAULT_PREPARE_EPOCH",
        0,
        "fault injection for tests: fail the prepare of this topology epoch (0: off)",
        check=non_negative,
    )
    fault_kv_corrupt: bool = setting(
        "NITSUM_FAULT_KV_CORRUPT", False, "fault injection for tests: corrupt outgoing KV hand-offs"
    )
    fault_prefill_delay_ms: float = setting(
        "NITSUM_FAULT_PREFILL_DELAY_MS",
        0.0,
        "fault injection for tests: a slow device, this long added to every engine step that computes prompt tokens (0: off)",
        check=non_negative,
    )
    fault_kv_connect_epoch: int = setting(
        "NITSUM_FAULT_KV_CONNECT_EPOCH",
        0,
        "fault injection for tests: this worker's KV receiver drops every connection of this topology epoch unanswered, so sources on other hosts fail to connect in its prepare (0: off)",
        check=non_negative,
    )
    fault_die_at: str = setting(
        "NITSUM_FAULT_DIE_AT",
        "",
        "fault injection for tests: <prepare|commit>:<epoch>:<device> — that device's worker SIGKILLs itself in that epoch's prepare (before the span's exchange) or when the commit reaches it ('': off)",
        check=die_at,
    )
    tp_shm_collectives: bool = setting(
        "NITSUM_TP_SHM_COLLECTIVES",
        True,
        "CPU: a TP group whose workers share a host runs its collectives through shared memory (off: gloo over loopback TCP)",
    )
    world_timeout_s: float = setting(
        "NITSUM_WORLD_TIMEOUT_S", 30.0, "timeout of one collective in the node world", check=positive
    )
    tp_migration_budget_ms: float = setting(
        "NITSUM_TP_MIGRATION_BUDGET_MS",
        2000.0,
        "cutover deadline of a TP change's KV migration flows, from prepare start (stage M, for the flow-scheduler)",
        check=positive,
    )

    def resolved_worker_id(self) -> str:
        """NITSUM_WORKER_ID, else <node>-<device>-<host> (unique across compose replicas)."""
        if self.worker_id:
            return self.worker_id
        import re
        import socket

        host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:32]
        return f"{self.node_id}-{self.device_index}-{host}"


@dataclass(frozen=True)
class FlowSchedulerConfig(CommonConfig):
    flow_policy: str = setting(
        "NITSUM_FLOW_POLICY",
        "rmlq",
        "rmlq | fs | sjf | edf | karuna",
        check=one_of("rmlq", "fs", "sjf", "edf", "karuna"),
    )
    flow_levels: int = setting("NITSUM_FLOW_LEVELS", 8, "RMLQ priority levels K", check=positive)
    flow_e: float = setting("NITSUM_FLOW_E", 4.0, "MLU threshold ratio E", check=positive)
    flow_u: float = setting("NITSUM_FLOW_U", 0.5, "MLU top threshold U", check=positive)
    flow_link_gbps: tuple[str, ...] = setting(
        "NITSUM_FLOW_LINK_GBPS",
        (),
        "NIC capacity per host, comma-separated host=Gb/s (e.g. host-a=200,host-b=100): each host's uplink and downlink for RMLQ's MLU and the pruning check",
        check=lambda v: _link_gbps_error(v),
    )
    flow_default_gbps: float = setting(
        "NITSUM_FLOW_DEFAULT_GBPS",
        100.0,
        "NIC capacity (Gb/s) of hosts not in NITSUM_FLOW_LINK_GBPS whose workers report no NIC speed (loopback, or a speed the kernel does not know)",
        check=positive,
    )

    def link_bandwidth_bps(self) -> dict[str, float]:
        """Host id → NIC capacity in bits/s, from NITSUM_FLOW_LINK_GBPS."""
        out: dict[str, float] = {}
        for entry in self.flow_link_gbps:
            host, _, gbps = entry.partition("=")
            out[host.strip()] = float(gbps) * 1e9
        return out


def _link_gbps_error(entries: tuple[str, ...]) -> str | None:
    for entry in entries:
        host, sep, gbps = entry.partition("=")
        try:
            ok = bool(sep) and bool(host.strip()) and float(gbps) > 0
        except ValueError:
            ok = False
        if not ok:
            return f"entry {entry!r} is not host=Gb/s with Gb/s > 0"
    return None


SERVICE_CONFIGS: dict[str, type] = {
    "gateway": GatewayConfig,
    "coordinator": CoordinatorConfig,
    "prefill-worker": WorkerConfig,
    "decode-worker": WorkerConfig,
    "flow-scheduler": FlowSchedulerConfig,
}


def all_settings() -> dict[str, str]:
    """Every NITSUM_* variable any service reads, with its help."""
    out: dict[str, str] = {}
    for cls in SERVICE_CONFIGS.values():
        out.update(settings_of(cls))
    return out
