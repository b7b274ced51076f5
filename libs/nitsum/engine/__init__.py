"""The worker's engine: continuous batching with chunked prefill over a paged KV cache.

Importing the package is cheap; torch loads only when `Engine` is first touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nitsum.engine.params import EngineConfig, EngineStats, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from nitsum.engine.engine import Engine, run_peer

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams", "run_peer"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "run_peer"):
        from nitsum.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
