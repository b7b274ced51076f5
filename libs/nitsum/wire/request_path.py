"""Messages of the request path: a request as the gateway submits it (SubmitRequest, its SamplingSpec) and the
coordinator's answer (SubmitReply); its placement on a worker (RunRequest → RunAck); the tokens a worker streams
back (TokenChunk, one per request, or TokenBatch, one per step) and aborts (AbortRequest).

Part of `nitsum.wire.messages` (import them from there; its module docstring states the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters as they travel; mirrors nitsum.engine.SamplingParams."""

    KIND: ClassVar[str] = "sampling"
    VERSION: ClassVar[int] = 1
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # issue 21 (OpenAI logits processing and logprobs); defaults mean "off", so older frames decode.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias_ids: tuple[int, ...] = ()  # logit_bias as two parallel arrays (msgpack maps want str keys)
    logit_bias_values: tuple[float, ...] = ()
    logprobs: int = -1  # -1: no logprobs; k >= 0: the sampled token's logprob and the k most likely
    guide: str = ""  # llguidance grammar of response_format json_object / json_schema ("" = free text)
    min_tokens: int = 0
    min_p: float = 0.0


@dataclass(frozen=True)
class SubmitRequest:
    """Gateway → coordinator: admit and route one request.

    `output_token_ids` is non-empty when the gateway re-submits a request whose worker was lost: the new
    worker continues from prompt + those tokens, and `max_tokens` in `sampling` counts the remaining ones.
    """

    KIND: ClassVar[str] = "submit"
    VERSION: ClassVar[int] = 1
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    tier: str
    ttft_ms: float
    tpot_ms: float
    weight: float
    arrival_unix_ms: float
    stream_subject: str
    output_token_ids: tuple[int, ...] = ()
    attempt: int = 0
    exclude_workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class SubmitReply:
    """Coordinator → gateway: where the request went, or why it was refused (HTTP status + Retry-After)."""

    KIND: ClassVar[str] = "submit_reply"
    VERSION: ClassVar[int] = 1
    request_id: str
    accepted: bool
    worker_id: str = ""
    group_id: str = ""
    status: int = 200
    retry_after_s: float = 0.0
    reason: str = ""
    # Workers that may take the request's stream over from `worker_id` (TP change, P/D hand-off): the P/D
    # decode worker and the workers of the nodes of both (a node is one process world and trust domain).
    successors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunRequest:
    """Coordinator → group leader: run this request and stream its tokens to `stream_subject`."""

    KIND: ClassVar[str] = "run"
    VERSION: ClassVar[int] = 1
    request: SubmitRequest
    # P/D: run the prefill here, then hand the request (KV + state) to this decode worker.
    decode_worker: str = ""
    # KV reuse (stage 1): before prefilling, fetch these chained prefix-block hashes from `reuse_from`.
    reuse_from: str = ""
    reuse_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class RunAck:
    KIND: ClassVar[str] = "run_ack"
    VERSION: ClassVar[int] = 1
    request_id: str
    worker_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class TokenChunk:
    """Worker → gateway on the request's stream subject.

    `index` is the position (in the request's output) of the first token in `token_ids`, so the gateway
    drops duplicates and detects gaps after a re-route. `error_code` non-empty ends the stream in error.
    """

    KIND: ClassVar[str] = "tokens"
    VERSION: ClassVar[int] = 1
    request_id: str
    worker_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str = ""
    finished: bool = False
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    error_code: str = ""
    error_message: str = ""
    # When the request asked for logprobs: one per token in `token_ids`, and `top_k` alternatives per token
    # as flat (id, logprob) arrays, token after token.
    logprobs: tuple[float, ...] = ()
    top_k: int = 0
    top_logprob_ids: tuple[int, ...] = ()
    top_logprob_values: tuple[float, ...] = ()
    # The SubmitRequest.attempt this frame answers (-1: not known, e.g. a stream adopted in a hand-off): a
    # request re-routed to the worker it left must not take that worker's late frames of the older attempt.
    attempt: int = -1


@dataclass(frozen=True)
class TokenBatch:
    """Worker → one gateway on `Subjects.gateway_frames`: the chunks of one turn of the step thread (one engine
    step or a run of decode steps, one chunk per request; or of the turns its publisher fell behind by) for every
    request that gateway serves, in the order they were produced. Each
    chunk keeps its own request id, index, attempt, usage and error fields, exactly as a TokenChunk alone."""

    KIND: ClassVar[str] = "token_batch"
    VERSION: ClassVar[int] = 1
    worker_id: str
    chunks: tuple[TokenChunk, ...]


@dataclass(frozen=True)
class AbortRequest:
    KIND: ClassVar[str] = "abort"
    VERSION: ClassVar[int] = 1
    request_id: str
    reason: str = "client_disconnected"
    worker_id: str = ""  # only this worker acts on it ("" = whichever runs the request)
