"""One request's stream on this worker (`Running`): where its frames go, how far it has streamed, and the
frames it sends (`output_chunk`, `error_chunk`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace

from nitsum.wire.messages import TokenChunk


@dataclass
class Running:
    request_id: str
    stream_subject: str
    prompt_len: int
    next_index: int
    span: trace.Span
    started_s: float = field(default_factory=time.monotonic)
    decode_worker: str = ""  # P/D: hand the request to this worker after its first token
    max_tokens: int = 0
    tpot_ms: float = 0.0
    attempt: int = -1  # the SubmitRequest.attempt being served (an adopted stream: the one its prefill served)
    # When its first token came out (time.monotonic()); None: still prefilling here. A request adopted past
    # its first token (P/D, TP change) counts from its adoption: the coordinator keeps the earlier time it
    # heard of, if any (WorkerStats.running_first_token_age_ms).
    first_token_s: float | None = None
    # The step inbox's count of items put when this stream was set up here (-1: with the engine already, adopted
    # at a TP commit): the engine's outputs of a turn that took no item past it are an earlier incarnation's
    # (an attempt this one replaced), never this stream's (`WorkerSession._publish`).
    since: int = -1

    def __post_init__(self) -> None:
        if self.next_index > 0 and self.first_token_s is None:
            self.first_token_s = time.monotonic()

    def output_chunk(self, outs, worker_id: str, finished: bool) -> TokenChunk:
        """The frame of this request's outputs of one turn (one per engine step, in order: a run of decode steps
        gives several), from `next_index` on (the caller advances it)."""
        last = outs[-1]
        logprobs = outs[0].logprob is not None
        return TokenChunk(
            request_id=last.request_id,
            worker_id=worker_id,
            index=self.next_index,
            token_ids=tuple(t for o in outs for t in o.new_token_ids),
            text="".join(o.text_delta for o in outs),
            finished=finished,
            finish_reason=(last.finish_reason or "") if finished else "",
            num_prompt_tokens=self.prompt_len,
            num_cached_prompt_tokens=last.num_cached_prompt_tokens,
            logprobs=tuple(o.logprob for o in outs) if logprobs else (),
            top_k=len(last.top_logprobs),
            top_logprob_ids=tuple(t for o in outs for t, _ in o.top_logprobs),
            top_logprob_values=tuple(v for o in outs for _, v in o.top_logprobs),
            attempt=self.attempt,
        )

    def error_chunk(self, worker_id: str, code: str, message: str) -> TokenChunk:
        """The last frame of a stream that ends with an error the client hears."""
        return TokenChunk(
            request_id=self.request_id,
            worker_id=worker_id,
            index=self.next_index,
            token_ids=(),
            finished=True,
            finish_reason="error",
            error_code=code,
            error_message=message,
            attempt=self.attempt,
        )


def outputs_by_request(outputs) -> list[list]:
    """A turn's engine outputs (step after step) as one list per request, each in step order: one chunk each."""
    grouped: dict[str, list] = {}
    for out in outputs:
        grouped.setdefault(out.request_id, []).append(out)
    return list(grouped.values())
