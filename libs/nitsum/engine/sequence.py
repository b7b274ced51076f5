"""One request's state inside the engine (no torch: the scheduler reads and mutates it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from nitsum.engine.params import FinishReason, SamplingParams
from nitsum.engine.slo import RequestSlo


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PINNED = "pinned"  # prefill role: done, KV blocks held until released (for the P/D transfer)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    # prompt + generated tokens; the KV of the first `num_computed_tokens` is in the cache.
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Engine-side attachments (a torch.Generator, the detokenizer); opaque to the scheduler.
    generator: Any = None
    detokenizer: Any = None
    matcher: Any = None  # llguidance matcher of a guided request (engine/guided.py)
    text: str = ""  # generated text so far (stop strings cut)
    num_text_emitted: int = 0  # chars of `text` already sent
    # Tier and targets; None: no SLO (served in arrival order, like a background request without deadline).
    slo: RequestSlo | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def interactive(self) -> bool:
        return self.slo is not None and self.slo.interactive

    @property
    def deadline_ms(self) -> float:
        """TTFT deadline on the engine clock; +inf without an SLO."""
        return self.slo.deadline_ms if self.slo is not None else float("inf")
