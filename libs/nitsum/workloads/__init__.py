"""Workloads: trace readers, arrival processes, tier assignment and time scaling.

Pure standard library, shared by the load generator (`nitsum_load`) and the simulator (`nitsum.sim`), so both
replay exactly the same request lists. Every function is deterministic for a given seed.

    read_azure(path)                     Azure LLM inference CSV: 2023 (code / conv; CRLF) and 2024 (UTC offsets)
    read_burstgpt(path)                  BurstGPT CSV (seconds; failed requests left out; optional model filter)
    read_csv_trace(path)                 either CSV format, told apart by its header
    read_mooncake(path)                  Mooncake FAST'25 JSONL; hash_ids = 512-token prefix blocks
    servegen_arrivals(archive, ...)      ServeGen per-client window statistics sampled into requests
    poisson(...), gamma(...)             synthetic arrivals (lengths fixed or drawn from a trace)
    phased(phases, ...)                  a shifting load: phases of their own rate and tier mix
    assign_tiers(reqs, fractions, seed)  exact-count tier labels
    scale_time(reqs, factor), scale_to_rate(reqs, rate_per_s), window(reqs, ...)
    default_trace_path(name)             the real trace under shared/traces, else the committed excerpt
"""

from nitsum.workloads.arrivals import gamma, poisson
from nitsum.workloads.paths import TRACE_NAMES, default_trace_path, is_excerpt, traces_dir
from nitsum.workloads.phased import Phase, phase_bounds, phased
from nitsum.workloads.readers import (
    MOONCAKE_BLOCK_TOKENS,
    read_azure,
    read_burstgpt,
    read_csv_trace,
    read_mooncake,
)
from nitsum.workloads.request import TraceRequest
from nitsum.workloads.servegen import servegen_arrivals
from nitsum.workloads.transform import assign_tiers, scale_time, scale_to_rate, summarize_workload, window

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "Phase",
    "TRACE_NAMES",
    "TraceRequest",
    "assign_tiers",
    "default_trace_path",
    "gamma",
    "is_excerpt",
    "phase_bounds",
    "phased",
    "poisson",
    "read_azure",
    "read_burstgpt",
    "read_csv_trace",
    "read_mooncake",
    "scale_time",
    "scale_to_rate",
    "servegen_arrivals",
    "summarize_workload",
    "traces_dir",
    "window",
]
