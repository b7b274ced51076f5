"""`nitsum serve gateway`: the OpenAI-compatible HTTP API in front of the mesh.

Validates and authenticates, tokenizes, classifies the tier, submits to the coordinator, streams the
tokens back (SSE with a final usage chunk) and re-routes requests whose worker is lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace

from aiohttp import web

from nitsum.config import GatewayConfig, parse_objectives
from nitsum.httpauth import auth_middleware, json_error
from nitsum.modelpath import resolve_model_dir
from nitsum.policy.tiers import UnknownTierError, resolve_slo
from nitsum.service import ServiceContext, run_service
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import SamplingSpec, SubmitRequest, WorkerLost
from nitsum_services.gateway.frames import FrameDispatcher
from nitsum_services.gateway.generation import Generation, GenerationError, GenerationRegistry
from nitsum_services.gateway.model_info import ModelInfo
from nitsum_services.gateway.openapi import OPENAPI
from nitsum_services.gateway.protocol import (
    ApiError,
    chat_logprobs,
    choice,
    chunk,
    completion_logprobs,
    full_response,
    parse_chat,
    parse_completion,
    usage,
    usage_chunk,
)
from nitsum_services.gateway.slo import SloAccounting

log = logging.getLogger("nitsum.gateway")

DRAIN_TIMEOUT_S = 60.0


class Gateway:
    def __init__(self, ctx: ServiceContext, model: ModelInfo) -> None:
        self.ctx = ctx
        self.config: GatewayConfig = ctx.config
        self.model = model
        self.registry = GenerationRegistry()
        self.draining = False
        self.slo = SloAccounting(ctx.metrics)
        self.objectives = parse_objectives(self.config.objectives)
        # Workers send this gateway's token frames to its own subject (one batch per step, `FrameDispatcher`):
        # with several gateways (`nitsum up --gateways N`) each one's requests name its id.
        self.gateway_id = "gw-" + uuid.uuid4().hex[:12]
        self.frames = FrameDispatcher(
            ctx.bus,
            self.registry,
            self.gateway_id,
            self._count_foreign,
            on_batch=ctx.metrics.stream_frames_total().labels(kind="batch").inc,
        )

    def _count_foreign(self, _sender: str) -> None:
        self.ctx.metrics.dropped_frames_total().labels(
            subject=f"{self.ctx.bus.subjects.namespace}.stream.*.*", code="foreign_stream_frame"
        ).inc()

    # ---- helpers -------------------------------------------------------------------------------
    async def _json_body(self, request: web.Request):
        if request.content_type != "application/json":
            raise ApiError(
                400,
                f"Content-Type must be application/json, got {request.content_type or 'none'}",
                None,
                "invalid_content_type",
            )
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise ApiError(
                413, f"the request body is over the {self.config.max_body_bytes}-byte limit", None, "body_too_large"
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413, f"the request body is over the {self.config.max_body_bytes}-byte limit", None, "body_too_large"
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None

    def _slo(self, request: web.Request, priority: int | None):
        """The request's tier (README "Tiers from other APIs"): x-request-tier, else the GIE objective header
        through NITSUM_GATEWAY_OBJECTIVES, else vLLM's `priority` (< 0 interactive, > 0 background), else
        NITSUM_DEFAULT_TIER."""
        tier = request.headers.get("x-request-tier")
        objective = request.headers.get("x-gateway-inference-objective")
        if tier is None and objective is not None:
            tier = self.objectives.get(objective.strip())
            if tier is None:
                known = ", ".join(sorted(self.objectives))
                raise ApiError(
                    400,
                    f"unknown inference objective {objective!r}; known objectives: {known}",
                    "x-gateway-inference-objective",
                    "unknown_objective",
                )
        if tier is None and priority is not None and priority != 0:
            tier = "interactive" if priority < 0 else "background"
        tier = tier or self.config.default_tier
        fairness = request.headers.get("x-gateway-inference-fairness-id")
        if fairness is not None and not 0 < len(fairness) <= 256:
            raise ApiError(
                400,
                "header x-gateway-inference-fairness-id must be 1..256 characters",
                "x-gateway-inference-fairness-id",
            )
        values = {}
        for header in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
            raw = request.headers.get(header)
            if raw is None:
                values[header] = None
                continue
            try:
                values[header] = float(raw)
            except ValueError:
                raise ApiError(400, f"header {header} must be a number of milliseconds, got {raw!r}", header) from None
        try:
            return resolve_slo(tier, values["x-slo-ttft-ms"], values["x-slo-tpot-ms"])
        except UnknownTierError as exc:
            raise ApiError(400, str(exc), "x-request-tier", "unknown_tier") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), "x-slo", "invalid_slo") from None

    def _check_bias(self, sampling: SamplingSpec) -> None:
        bad = [t for t in sampling.logit_bias_ids if t >= self.model.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"logit_bias names token id {bad[0]}, outside the vocabulary (size {self.model.vocab_size})",
                "logit_bias",
            )

    def _check_model(self, name: str) -> None:
        if name and name != self.model.name:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model.name}'.",
                "model",
                "model_not_found",
            )

    # ---- routes ----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        arrival_s = time.monotonic()
        arrival_unix_ms = time.time() * 1000.0
        tier_name = "unknown"
        with self.ctx.tracer.start_as_current_span(
            "gateway.request", attributes={"nitsum.request_id": request_id, "nitsum.route": request.path}
        ) as span:
            try:
                if self.draining:
                    raise ApiError(
                        503,
                        "the gateway is shutting down",
                        None,
                        "shutting_down",
                        "service_unavailable",
                        {"Retry-After": "1"},
                    )
                body = await self._json_body(request)
                allow = self.config.allow_unknown_fields
                if kind == "chat":
                    parsed, messages = parse_chat(body, self.config.max_messages, allow_unknown=allow)
                else:
                    parsed = parse_completion(body, allow_unknown=allow)
                slo = self._slo(request, parsed.priority)
                tier_name = slo.tier
                span.set_attribute("nitsum.tier", slo.tier)
                self._check_model(parsed.model)
                self._check_bias(parsed.sampling)
                if kind == "chat":
                    prompt_ids = self.model.encode_chat(messages)
                else:
                    prompt_ids = (
                        list(parsed.prompt_token_ids)
                        if parsed.prompt_token_ids is not None
                        else self.model.encode(parsed.prompt_text)
                    )
                    if parsed.prompt_token_ids is not None:
                        self.model.check_ids(prompt_ids)
                sampling = self.model.fit_max_tokens(
                    parsed.sampling, len(prompt_ids), fill_context=(kind == "chat" and not parsed.max_tokens_given)
                )
                if sampling.min_tokens > sampling.max_tokens:
                    raise ApiError(
                        400,
                        f"'min_tokens' ({sampling.min_tokens}) exceeds max_tokens ({sampling.max_tokens})",
                        "min_tokens",
                    )
            except ApiError as exc:
                mark_error(span, exc.code)
                self.slo.outcome(tier_name, "rejected")
                return json_error(
                    exc.status,
                    exc.message,
                    exc.type,
                    exc.code,
                    exc.param,
                    headers={"x-request-id": request_id, **exc.headers},
                )
            span.set_attribute("nitsum.prompt_tokens", len(prompt_ids))
            fairness = request.headers.get("x-gateway-inference-fairness-id")
            if fairness:
                span.set_attribute("nitsum.fairness_id", fairness)
            if parsed.user:
                span.set_attribute("nitsum.user", parsed.user)
            gens = [
                self._generation(
                    request_id if parsed.n == 1 else f"{request_id}-{i}",
                    prompt_ids,
                    _choice_sampling(sampling, i),
                    slo,
                    arrival_unix_ms,
                )
                for i in range(parsed.n)
            ]
            headers = {"x-request-id": request_id, "x-request-tier": slo.tier, "x-nitsum-gateway": self.gateway_id}
            if parsed.ignored_fields:
                headers["x-nitsum-ignored-fields"] = ",".join(parsed.ignored_fields)
            try:
                # The first choice is submitted alone: the others follow once its prompt is computed, so that
                # they find it in the prefix cache (the prompt is computed once for all n).
                await gens[0].start()
            except GenerationError as exc:
                return self._refused(exc, span, slo, headers)
            try:
                if parsed.stream:
                    return await self._stream(request, request_id, gens, parsed, kind, headers, span, slo, arrival_s)
                return await self._collect(request_id, gens, parsed, kind, headers, span, slo, arrival_s)
            finally:
                for gen in gens:
                    await gen.close()

    def _generation(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec, slo, arrival_unix_ms: float
    ) -> Generation:
        submit = SubmitRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            tier=slo.tier,
            ttft_ms=slo.ttft_ms,
            tpot_ms=slo.tpot_ms,
            weight=slo.weight,
            arrival_unix_ms=arrival_unix_ms,
            stream_subject=self.ctx.bus.subjects.gateway_frames(self.gateway_id),
        )
        gen = Generation(
            self.ctx.bus,
            submit,
            self.config.stream_timeout_s,
            self.config.max_reroutes,
            self.config.submit_timeout_s,
            self.registry,
        )
        # The decode pause a stream sees when its request moves to another worker (TP change, P/D).
        gen.on_handoff_gap = self.ctx.metrics.reconfiguration_duration_ms().labels(phase="stream_pause").observe
        gen.on_foreign_frame = self._count_foreign
        gen.on_single_frame = self.ctx.metrics.stream_frames_total().labels(kind="single").inc
        return gen

    def _refused(self, exc: GenerationError, span, slo, headers: dict) -> web.Response:
        mark_error(span, f"{exc.code}: {exc.message}")
        self.slo.outcome(slo.tier, "rejected" if exc.status in (429, 503) else "error")
        extra = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.status in (429, 503) else {}
        type_ = {429: "rate_limit_error", 503: "service_unavailable", 400: "invalid_request_error"}.get(
            exc.status, "server_error"
        )
        return json_error(exc.status, exc.message, type_, exc.code, headers={**headers, **extra})

    async def _deltas(self, gens: list[Generation]):
        """(choice index, Delta) from every generation as they come; the first is already started, the
        others start once it has produced its first token (or finished). Raises the first GenerationError."""
        if len(gens) == 1:  # no pump task and queue between the stream and the response: one hop less per token
            async for item in self._single_deltas(gens[0]):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()
        prefilled = asyncio.Event()

        async def pump(i: int, gen: Generation) -> None:
            try:
                if i > 0:
                    await prefilled.wait()
                    await gen.start()
                async for delta in gen.deltas():
                    prefilled.set()
                    queue.put_nowait((i, delta))
                queue.put_nowait((i, None))
            except GenerationError as exc:
                queue.put_nowait((i, exc))
            except Exception as exc:  # a bug must end the request with an error, not leave it waiting
                log.exception("%s: choice %d failed", gen.request_id, i)
                queue.put_nowait((i, GenerationError(500, "gateway_error", f"{type(exc).__name__}: {exc}")))
            finally:
                prefilled.set()

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        reason = "request_ended"
        try:
            running = len(gens)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, GenerationError):
                    raise item
                else:
                    yield i, item
        except asyncio.CancelledError:
            reason = "client_disconnected"
            raise
        finally:
            for gen in gens:  # a failed sibling (or a disconnect) ends them all
                if gen.worker_id and not gen.finished:
                    await gen.abort(reason)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _single_deltas(self, gen: Generation):
        """`_deltas` of one generation, read in the handler's own task (same errors, same abort at the end)."""
        reason = "request_ended"
        try:
            async for delta in gen.deltas():
                yield 0, delta
        except GenerationError:
            raise
        except asyncio.CancelledError:
            reason = "client_disconnected"
            raise
        except Exception as exc:  # a bug must end the request with an error, not leave it waiting
            log.exception("%s: choice 0 failed", gen.request_id)
            raise GenerationError(500, "gateway_error", f"{type(exc).__name__}: {exc}") from None
        finally:
            if gen.worker_id and not gen.finished:
                await gen.abort(reason)

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

    async def _stream(
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
            async for i, delta in self._deltas(gens):
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
        if parsed.include_usage:
            await response.write(
                b"data: "
                + json.dumps(usage_chunk(kind, request_id, self.model.name, created, self._usage(gens))).encode()
                + b"\n\n"
            )
        await response.write(b"data: [DONE]\n\n")
        self._finished(gens, span, slo, arrival_s)
        return response

    async def _collect(
        self, request_id: str, gens: list[Generation], parsed, kind, headers, span, slo, arrival_s
    ) -> web.Response:
        texts: list[list[str]] = [[] for _ in gens]
        entries: list[list] = [[] for _ in gens]
        try:
            async for i, delta in self._deltas(gens):
                texts[i].append(delta.text)
                entries[i].extend(delta.logprobs or ())
        except GenerationError as exc:
            if exc.code == "shed":  # the coordinator's refusal after admission: the same answer as one at once
                return self._refused(exc, span, slo, headers)
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

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "nitsum",
                        "max_model_len": self.model.max_model_len,
                    }
                ],
            }
        )

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response(
                {"ready": False, "reason": "shutting down"}, status=503, headers={"Retry-After": "1"}
            )
        submit = SubmitRequest(
            request_id="ready-" + uuid.uuid4().hex,
            prompt_token_ids=(self.model.probe_token_id,),
            sampling=SamplingSpec(max_tokens=1, ignore_eos=True),
            tier="interactive",
            ttft_ms=self.config.ready_timeout_s * 1000.0,
            tpot_ms=1000.0,
            weight=0.0,
            arrival_unix_ms=time.time() * 1000.0,
            stream_subject="",
        )
        submit = SubmitRequest(**{**submit.__dict__, "stream_subject": self.ctx.bus.subjects.stream(submit.request_id)})
        gen = Generation(
            self.ctx.bus, submit, self.config.ready_timeout_s, 0, self.config.ready_timeout_s, GenerationRegistry()
        )
        try:
            async with asyncio.timeout(self.config.ready_timeout_s):
                await gen.start()
                async for _ in gen.deltas():
                    pass
        except (GenerationError, TimeoutError) as exc:
            await gen.abort("ready_probe_failed")
            reason = (
                exc.message if isinstance(exc, GenerationError) else f"no token within {self.config.ready_timeout_s} s"
            )
            return web.json_response({"ready": False, "reason": reason}, status=503, headers={"Retry-After": "1"})
        finally:
            await gen.close()
        return web.json_response({"ready": True, "worker": gen.worker_id})

    async def metrics(self, _request: web.Request) -> web.Response:
        body, content_type = self.ctx.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)


ROUTES = (
    ("POST", "/v1/chat/completions", "chat_completions"),
    ("POST", "/v1/completions", "completions"),
    ("GET", "/v1/models", "models"),
    ("GET", "/health", "health"),
    ("GET", "/ready", "ready"),
    ("GET", "/metrics", "metrics"),
    ("GET", "/openapi.json", "openapi"),
)


def build_app(gateway: Gateway, api_keys: tuple[str, ...]) -> web.Application:
    app = web.Application(
        middlewares=[auth_middleware(api_keys), _error_middleware], client_max_size=gateway.config.max_body_bytes
    )
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, getattr(gateway, handler))
    return app


@web.middleware
async def _error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        return json_error(
            413, f"the request body is over the limit ({exc.text})", "invalid_request_error", "body_too_large"
        )
    except web.HTTPNotFound:
        return json_error(404, f"no route {request.method} {request.path}", "invalid_request_error", "not_found")
    except web.HTTPMethodNotAllowed:
        return json_error(
            405,
            f"method {request.method} is not allowed on {request.path}",
            "invalid_request_error",
            "method_not_allowed",
        )


async def body(ctx: ServiceContext) -> None:
    config: GatewayConfig = ctx.config
    model_dir = await asyncio.to_thread(resolve_model_dir, config.model)
    model = await asyncio.to_thread(ModelInfo.load, model_dir, config.served_model_name)
    gateway = Gateway(ctx, model)

    async def on_worker_lost(msg: WorkerLost, _delivery) -> None:
        n = gateway.registry.on_worker_lost(msg.worker_id)
        if n:
            log.warning("worker %s lost: re-routing %d request(s)", msg.worker_id, n)

    await ctx.bus.subscribe(ctx.bus.subjects.worker_lost, on_worker_lost, expected=WorkerLost)
    await gateway.frames.start()
    runner = web.AppRunner(build_app(gateway, config.resolved_api_keys()), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port or None).start()
    log.info(
        "gateway %s listening on http://%s:%d (model %s%s)",
        gateway.gateway_id,
        config.host,
        config.port,
        model.name,
        ", port shared with other gateways" if config.reuse_port else "",
    )

    async def drain() -> None:
        gateway.draining = True
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while len(gateway.registry) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await runner.cleanup()

    ctx.drain_hooks.append(drain)


def _choice_sampling(spec: SamplingSpec, index: int) -> SamplingSpec:
    """Choice `index` of n: a given seed is advanced by the index (choices differ, yet reproducibly)."""
    if index == 0 or spec.seed is None:
        return spec
    seed = (spec.seed + index + (1 << 63)) % (1 << 64) - (1 << 63)
    return replace(spec, seed=seed)


def main(argv: list[str]) -> int:
    # The gateway serves /metrics on its API port; no separate metrics server.
    return run_service(
        "gateway", GatewayConfig, argv[1:] if argv[:1] == ["gateway"] else argv, body, metrics_port=lambda _c: 0
    )
