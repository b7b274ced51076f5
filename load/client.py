"""Streaming OpenAI-compatible client that records each request's lifecycle.

One `send` call = one HTTP request with `stream: true`; it fills a `RequestTracker` as events happen
(dispatch, response headers, every token, finish, error), so whoever cancels the call (duration cut-off,
Ctrl-C) still holds everything observed so far. Times are ms on the runner's clock (`clock()`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from nitsum.metrics import RequestRecord
from nitsum_load.sse import DONE, SseParser, parse_chunk

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PROMPT_FORMATS = ("text", "token-ids")
# Word used to synthesize text prompts: " hello" is one token in common BPE vocabularies (GPT-2, Llama, ...),
# so N repetitions make a prompt of about N tokens (plus the chat template's few tokens on /chat).
PROMPT_WORD = "hello"
# Token ids used for token-id prompts: low ids exist in every vocabulary, and they avoid id 0-2 (special tokens).
PROMPT_TOKEN_ID_BASE = 100
PROMPT_TOKEN_ID_SPAN = 100
ERROR_DETAIL_MAX_CHARS = 300


@dataclass(frozen=True)
class PromptScale:
    """How many tokens a text prompt of W words costs on the server: tokens = overhead + W * tokens_per_word.

    The default (1 token per word, no overhead) holds for common BPE vocabularies; `calibrate_prompt` measures
    it (a byte-level tiny vocabulary spends ~6 tokens on " hello", and a chat template adds a fixed overhead).
    """

    tokens_per_word: float = 1.0
    overhead_tokens: float = 0.0

    def __post_init__(self) -> None:
        assert self.tokens_per_word > 0, "a word costs at least some tokens"

    def words_for(self, num_tokens: int) -> int:
        return max(1, round((num_tokens - self.overhead_tokens) / self.tokens_per_word))

    @classmethod
    def fit(cls, words_a: int, tokens_a: int, words_b: int, tokens_b: int) -> PromptScale:
        """The line through two measurements (words, prompt tokens); the default scale when they are unusable."""
        if words_b == words_a or tokens_b <= tokens_a:
            return cls()
        per_word = (tokens_b - tokens_a) / (words_b - words_a)
        return cls(tokens_per_word=per_word, overhead_tokens=max(0.0, tokens_a - words_a * per_word))


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "chat"  # key of ENDPOINTS
    api_key: str | None = None
    request_timeout_s: float = 300.0
    # Ask for exactly output_tokens tokens (vLLM/SGLang/nitsum extension); off for servers that reject it.
    ignore_eos: bool = True
    return_token_ids: bool = False  # nitsum extension: exact token counts per chunk
    prompt_format: str = "text"  # see PROMPT_FORMATS; token ids only on /v1/completions
    prompt_scale: PromptScale = PromptScale()  # text prompts: words per token

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if self.prompt_format == "token-ids" and self.endpoint != "completions":
            raise ValueError("token-id prompts need --endpoint completions")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: when (ms after the run starts), how long, and which SLO it is held to."""

    request_id: str
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    tier: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    weight: float


def synth_prompt(num_tokens: int, fmt: str, seed_index: int = 0, scale: PromptScale | None = None) -> str | list[int]:
    """A prompt of about `num_tokens` tokens (exactly, for token ids). Deterministic."""
    assert num_tokens >= 1, "a prompt has at least one token"
    if fmt == "token-ids":
        return [PROMPT_TOKEN_ID_BASE + (seed_index + i) % PROMPT_TOKEN_ID_SPAN for i in range(num_tokens)]
    words = (scale or PromptScale()).words_for(num_tokens)
    return " ".join([PROMPT_WORD] * words)


def build_body(cfg: ClientConfig, spec: RequestSpec, seed_index: int = 0) -> dict[str, Any]:
    prompt = synth_prompt(spec.prompt_tokens, cfg.prompt_format, seed_index, cfg.prompt_scale)
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": spec.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    return body


CALIBRATION_WORDS = (8, 40)


async def calibrate_prompt(session: aiohttp.ClientSession, cfg: ClientConfig) -> PromptScale:
    """Measure the server's prompt-token cost of text prompts with two 1-token requests (not part of the run).

    Raises RuntimeError when the server does not answer them with a usage block."""
    measured = []
    for words in CALIBRATION_WORDS:
        spec = RequestSpec(
            request_id=f"calibrate-{words}",
            arrival_ms=0.0,
            prompt_tokens=words,
            output_tokens=1,
            tier="background",
            ttft_slo_ms=1.0,
            tpot_slo_ms=1.0,
            weight=1.0,
        )
        body = build_body(dataclasses.replace(cfg, prompt_scale=PromptScale()), spec)
        body["stream"] = False
        body.pop("stream_options", None)
        body.pop("return_token_ids", None)
        headers = {k: v for k, v in build_headers(cfg, spec).items() if not k.startswith("x-slo-")}
        try:
            async with session.post(
                cfg.url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"prompt calibration: HTTP {resp.status}: {(await resp.text())[:200]}")
                data = await resp.json()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RuntimeError(f"prompt calibration: {exc!r}") from exc
        tokens = (data.get("usage") or {}).get("prompt_tokens")
        if not isinstance(tokens, int):
            raise RuntimeError("prompt calibration: the server's answer has no usage.prompt_tokens")
        measured.append((words, tokens))
    (wa, ta), (wb, tb) = measured
    return PromptScale.fit(wa, ta, wb, tb)


def build_headers(cfg: ClientConfig, spec: RequestSpec) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        "accept": "text/event-stream",
        "x-request-tier": spec.tier,
        "x-slo-ttft-ms": _num(spec.ttft_slo_ms),
        "x-slo-tpot-ms": _num(spec.tpot_slo_ms),
    }
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    return headers


def classify_status(status: int) -> str:
    if status == 429:
        return "http_429"
    if status == 503:
        return "http_503"
    if 400 <= status < 500:
        return "http_4xx"
    return "http_5xx"


@dataclass
class RequestTracker:
    """Mutable lifecycle of one request while it runs; `to_record()` at any moment gives its record."""

    spec: RequestSpec
    dispatched_ms: float | None = None
    http_status: int | None = None
    server_request_id: str | None = None
    server_tier: str | None = None  # the x-request-tier the server answered with (nitsum echoes it)
    token_times_ms: list[float] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    done_ms: float | None = None  # [DONE] seen (or the stream ended after a finish_reason)
    error: str | None = None
    error_detail: str | None = None

    @property
    def finished(self) -> bool:
        return self.done_ms is not None and self.error is None

    def fail(self, kind: str, detail: str) -> None:
        if self.error is None:  # the first failure is the cause; later ones are consequences
            self.error = kind
            self.error_detail = detail[:ERROR_DETAIL_MAX_CHARS]

    def to_record(self) -> RequestRecord:
        """send_ms is the *scheduled* arrival, so client-side queueing (concurrency limit, a late event loop)
        counts against TTFT instead of hiding it. finish_ms is the last token's time (the trailing usage
        chunk and [DONE] are not part of TPOT); a finished request with no token finishes at [DONE]."""
        s = self.spec
        first = self.token_times_ms[0] if self.token_times_ms else None
        finish = None
        if self.finished:
            finish = self.token_times_ms[-1] if self.token_times_ms else self.done_ms
        counted = len(self.token_times_ms)
        out = counted if self.usage_completion_tokens is None else max(counted, self.usage_completion_tokens)
        return RequestRecord(
            request_id=s.request_id,
            tier=s.tier,
            ttft_slo_ms=s.ttft_slo_ms,
            tpot_slo_ms=s.tpot_slo_ms,
            weight=s.weight,
            send_ms=s.arrival_ms,
            first_token_ms=first,
            finish_ms=finish,
            output_tokens=out,
            prompt_tokens=self.usage_prompt_tokens if self.usage_prompt_tokens is not None else s.prompt_tokens,
            token_times_ms=tuple(self.token_times_ms),
            error=self.error,
        )

    def to_log(self) -> dict[str, Any]:
        """One line of the lifecycle log: the record plus what only the client saw."""
        d = self.to_record().to_dict()
        d.update(
            dispatched_ms=self.dispatched_ms,
            done_ms=self.done_ms,
            http_status=self.http_status,
            server_request_id=self.server_request_id,
            server_tier=self.server_tier,
            requested_prompt_tokens=self.spec.prompt_tokens,
            requested_output_tokens=self.spec.output_tokens,
            error_detail=self.error_detail,
        )
        return d


async def send(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    tracker: RequestTracker,
    clock: Callable[[], float],
    seed_index: int = 0,
) -> None:
    """Send one streaming request and fill `tracker`. Expected failures land in tracker.error, not raised;
    cancellation propagates (the tracker keeps what was seen)."""
    spec = tracker.spec
    body = build_body(cfg, spec, seed_index)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    tracker.dispatched_ms = clock()
    streaming = False
    try:
        async with session.post(cfg.url, json=body, headers=build_headers(cfg, spec), timeout=timeout) as resp:
            tracker.http_status = resp.status
            tracker.server_request_id = resp.headers.get("x-request-id")
            tracker.server_tier = resp.headers.get("x-request-tier")
            if resp.status != 200:
                text = await resp.text(errors="replace")
                tracker.fail(classify_status(resp.status), f"HTTP {resp.status}: {text}")
                return
            streaming = True
            await _read_stream(resp, tracker, clock)
    except TimeoutError:
        tracker.fail("timeout", f"no complete response within {cfg.request_timeout_s} s")
    except aiohttp.ClientPayloadError as exc:
        tracker.fail("stream_error", f"payload: {exc}")
    except aiohttp.ClientError as exc:
        # Before the 200 arrived the server was unreachable; after it, the stream broke.
        tracker.fail("stream_error" if streaming else "connection", f"{type(exc).__name__}: {exc}")


async def _read_stream(resp: aiohttp.ClientResponse, tracker: RequestTracker, clock: Callable[[], float]) -> None:
    parser = SseParser()
    finish_reason: str | None = None
    async for raw in resp.content.iter_any():
        now = clock()
        for payload in parser.feed(raw):
            if payload.strip() == DONE:
                tracker.done_ms = now
                return
            try:
                info = parse_chunk(payload)
            except ValueError as exc:
                tracker.fail("stream_error", str(exc))
                return
            if info.error is not None:
                tracker.fail("stream_error", f"in-stream error: {info.error}")
                return
            tracker.token_times_ms.extend([now] * info.tokens)
            finish_reason = info.finish_reason or finish_reason
            if info.prompt_tokens is not None:
                tracker.usage_prompt_tokens = info.prompt_tokens
            if info.completion_tokens is not None:
                tracker.usage_completion_tokens = info.completion_tokens
    parser.close()
    if finish_reason is not None:
        # Some servers close without [DONE]; a finish_reason already said the generation ended.
        tracker.done_ms = clock()
    else:
        tracker.fail("stream_error", "stream ended without [DONE] or a finish_reason")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
