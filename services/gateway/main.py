"""`nitsum serve gateway`: the OpenAI-compatible HTTP API in front of the mesh.

Validates and authenticates, tokenizes, classifies the tier, submits to the coordinator, streams the
tokens back (SSE with a final usage chunk) and re-routes requests whose worker is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web

from nitsum.config import GatewayConfig
from nitsum.httpauth import json_error
from nitsum.modelpath import resolve_model_dir
from nitsum.service import ServiceContext, run_service
from nitsum.telemetry.tracing import mark_error
from nitsum.wire.messages import SamplingSpec, SubmitRequest, WorkerLost
from nitsum_services.gateway.app import build_app
from nitsum_services.gateway.choices import choice_sampling
from nitsum_services.gateway.frames import FrameDispatcher
from nitsum_services.gateway.generation import Generation, GenerationError, GenerationRegistry
from nitsum_services.gateway.intake import RequestIntake
from nitsum_services.gateway.model_info import ModelInfo
from nitsum_services.gateway.openapi import OPENAPI
from nitsum_services.gateway.protocol import ApiError, parse_chat, parse_completion
from nitsum_services.gateway.responses import Responder
from nitsum_services.gateway.slo import SloAccounting

log = logging.getLogger("nitsum.gateway")

DRAIN_TIMEOUT_S = 60.0
HANDLER_GRACE_S = 2.0


class Gateway:
    def __init__(self, ctx: ServiceContext, model: ModelInfo) -> None:
        self.ctx = ctx
        self.config: GatewayConfig = ctx.config
        self.model = model
        self.registry = GenerationRegistry()
        self.draining = False
        self.slo = SloAccounting(ctx.metrics)
        self.intake = RequestIntake(self.config, model)
        self.responder = Responder(model, self.slo)
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
                body = await self.intake.json_body(request)
                allow = self.config.allow_unknown_fields
                if kind == "chat":
                    parsed, messages = parse_chat(body, self.config.max_messages, allow_unknown=allow)
                else:
                    parsed = parse_completion(body, allow_unknown=allow)
                slo = self.intake.slo(request, parsed.priority)
                tier_name = slo.tier
                span.set_attribute("nitsum.tier", slo.tier)
                self.intake.check_model(parsed.model)
                self.intake.check_bias(parsed.sampling)
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
                refusal = json_error(
                    exc.status,
                    exc.message,
                    exc.type,
                    exc.code,
                    exc.param,
                    headers={"x-request-id": request_id, **exc.headers},
                )
                if exc.status == 413:
                    # The body was not read: close the connection rather than keep it open behind an unread
                    # body (the server's shutdown then waited its whole grace period for that "request").
                    refusal.force_close()
                return refusal
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
                    choice_sampling(sampling, i),
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
                return self.responder.refused(exc, span, slo, headers)
            try:
                if parsed.stream:
                    return await self.responder.stream(
                        request, request_id, gens, parsed, kind, headers, span, slo, arrival_s
                    )
                return await self.responder.collect(request_id, gens, parsed, kind, headers, span, slo, arrival_s)
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
    # The drain first waits for every generation (streamed or not, up to DRAIN_TIMEOUT_S); what is still in a
    # handler after that generates nothing (an upload the gateway refused unread, a /v1/models): a short grace.
    runner = web.AppRunner(
        build_app(gateway, config.resolved_api_keys()),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=HANDLER_GRACE_S,
    )
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
        if len(gateway.registry):
            log.info(
                "draining: waiting for %d stream(s) to end (at most %.0f s)", len(gateway.registry), DRAIN_TIMEOUT_S
            )
        while len(gateway.registry) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await runner.cleanup()
        log.info("drain: HTTP server closed in %.2f s", time.monotonic() - t0)

    ctx.drain_hooks.append(drain)


def main(argv: list[str]) -> int:
    # The gateway serves /metrics on its API port; no separate metrics server.
    return run_service(
        "gateway", GatewayConfig, argv[1:] if argv[:1] == ["gateway"] else argv, body, metrics_port=lambda _c: 0
    )
