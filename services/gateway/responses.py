"""The answer to a request that was submitted: an SSE stream of chunks (`stream`), one JSON body (`collect`), or
the coordinator's refusal (`refused`); each outcome counted in the SLO accounting."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from nitsum.httpauth import json_error
from nitsum.telemetry.tracing import mark_error
from nitsum_services.gateway.bodies import (
    chat_logprobs,
    choice,
    chunk,
    completion_logprobs,
    full_response,
    usage,
    usage_chunk,
)
from nitsum_services.gateway.choices import choice_deltas
from nitsum_services.gateway.generation import Generation, GenerationError
from nitsum_services.gateway.model_info import ModelInfo
from nitsum_services.gateway.slo import SloAccounting

log = logging.getLogger("nitsum.gateway")


class Responder:
    def __init__(self, model: ModelInfo, slo: SloAccounting) -> None:
        self.model = model
        self.slo = slo

    def refused(self, exc: GenerationError, span, slo, headers: dict) -> web.Response:
        mark_error(span, f"{exc.code}: {exc.message}")
        self.slo.outcome(slo.tier, "rejected" if exc.status in (429, 503) else "error")
        extra = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.status in (429, 503) else {}
        type_ = {429: "rate_limit_error", 503: "service_unavailable", 400: "invalid_request_error"}.get(
            exc.status, "server_error"
        )
        return json_error(exc.status, exc.message, type_, exc.code, headers={**headers, **extra})

    def _logprobs(self, kind: str, delta, text_offset: int) -> dict | None:
        if delta.logprobs is None:
            return None
        if kind == "chat":
            return chat_logprobs(delta.logprobs, self.model.token_text)
        return completion_logprobs(delta.logprobs, self.model.token_text, text_offset)

    def _usage(self, gens: list[Generation]) -> dict:
        # The prompt is one prompt, computed once, whatever n is; completion tokens add up over the choices;
        # cached tokens: the most any choice found in the prefix cache (choices after the first reuse the prompt).
        return usage(
            len(gens[0].request.prompt_token_ids),
            sum(len(g.tokens) for g in gens),
            max(g.num_cached_prompt_tokens for g in gens),
        )

    async def stream(
        self, request, request_id: str, gens: list[Generation], parsed, kind, headers, span, slo, arrival_s
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200, headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        created = int(time.time())
        await response.prepare(request)
        first = [True] * len(gens)
        offsets = [0] * len(gens)
        try:
            async for i, delta in choice_deltas(gens):
                logprobs = self._logprobs(kind, delta, offsets[i])
                offsets[i] += sum(len(self.model.token_text(t)) for t in delta.token_ids) if logprobs is not None else 0
                payload = chunk(
                    kind,
                    request_id,
                    self.model.name,
                    created,
                    delta.text,
                    delta.finish_reason,
                    first[i],
                    delta.token_ids if parsed.return_token_ids else None,
                    i,
                    logprobs,
                )
                if parsed.continuous_usage:
                    payload["usage"] = self._usage(gens)
                first[i] = False
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        except GenerationError as exc:
            mark_error(span, f"{exc.code}: {exc.message}")
            self.slo.outcome(slo.tier, "error")
            error = {"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            mark_error(span, "client_disconnected")
            self.slo.outcome(slo.tier, "cancelled")
            for gen in gens:
                await gen.abort("client_disconnected")
            raise
        except Exception as exc:  # a bug mid-stream: the client is told, never left with a stream cut short as if done
            log.exception("%s: the stream failed", request_id)
            mark_error(span, f"internal: {type(exc).__name__}: {exc}")
            self.slo.outcome(slo.tier, "error")
            for gen in gens:
                await gen.abort("gateway_error")
            message = f"the gateway failed mid-stream: {type(exc).__name__}"
            error = {"error": {"message": message, "type": "server_error", "param": None, "code": "internal"}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        if parsed.include_usage:
            await response.write(
                b"data: "
                + json.dumps(usage_chunk(kind, request_id, self.model.name, created, self._usage(gens))).encode()
                + b"\n\n"
            )
        await response.write(b"data: [DONE]\n\n")
        self._finished(gens, span, slo, arrival_s)
        return response

    async def collect(
        self, request_id: str, gens: list[Generation], parsed, kind, headers, span, slo, arrival_s
    ) -> web.Response:
        texts: list[list[str]] = [[] for _ in gens]
        entries: list[list] = [[] for _ in gens]
        try:
            async for i, delta in choice_deltas(gens):
                texts[i].append(delta.text)
                entries[i].extend(delta.logprobs or ())
        except GenerationError as exc:
            if exc.code == "shed":  # the coordinator's refusal after admission: the same answer as one at once
                return self.refused(exc, span, slo, headers)
            mark_error(span, f"{exc.code}: {exc.message}")
            self.slo.outcome(slo.tier, "error")
            extra = {"Retry-After": "1"} if exc.status == 503 else {}
            return json_error(exc.status, exc.message, "server_error", exc.code, headers={**headers, **extra})
        except asyncio.CancelledError:
            mark_error(span, "client_disconnected")
            self.slo.outcome(slo.tier, "cancelled")
            for gen in gens:
                await gen.abort("client_disconnected")
            raise
        choices = []
        for i, gen in enumerate(gens):
            logprobs = None
            if gen.request.sampling.logprobs >= 0:
                logprobs = (
                    chat_logprobs(entries[i], self.model.token_text)
                    if kind == "chat"
                    else completion_logprobs(entries[i], self.model.token_text, 0)
                )
            choices.append(
                choice(
                    kind,
                    i,
                    "".join(texts[i]),
                    gen.finish_reason,
                    list(gen.tokens) if parsed.return_token_ids else None,
                    logprobs,
                )
            )
        body = full_response(kind, request_id, self.model.name, int(time.time()), choices, self._usage(gens))
        self._finished(gens, span, slo, arrival_s)
        return web.json_response(body, headers=headers)

    def _finished(self, gens: list[Generation], span, slo, arrival_s: float) -> None:
        gen = gens[0]
        span.set_attribute("nitsum.output_tokens", sum(len(g.tokens) for g in gens))
        span.set_attribute("nitsum.worker", gen.worker_id)
        span.set_attribute("nitsum.reroutes", sum(g.reroutes for g in gens))
        # SLO accounting follows the first choice (its TTFT is the request's; the others start after it).
        self.slo.finished(slo, arrival_s, gen.first_token_s, time.monotonic(), len(gen.tokens))
