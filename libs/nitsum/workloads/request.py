"""The one request record every workload source produces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload, before it is sent anywhere.

    `arrival_ms` is relative to the start of the workload (the first request of a trace arrives at 0).
    `prefix_hash_ids` are prefix-block ids (Mooncake: 512-token blocks); two requests share as much KV prefix
    as they have leading ids in common. Empty when the source carries no prefix information.
    """

    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    tier: str = "interactive"
    prefix_hash_ids: tuple[int, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        assert self.arrival_ms >= 0, f"arrival_ms must be >= 0, got {self.arrival_ms}"
        assert self.prompt_tokens >= 1, f"prompt_tokens must be >= 1, got {self.prompt_tokens}"
        assert self.output_tokens >= 1, f"output_tokens must be >= 1, got {self.output_tokens}"
