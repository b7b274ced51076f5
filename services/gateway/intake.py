"""What the gateway checks of a request before it submits it: the JSON body, the tier and its SLO (headers), and
the model name and logit-bias ids against the model it serves."""

from __future__ import annotations

import json

from aiohttp import web

from nitsum.config import GatewayConfig, parse_objectives
from nitsum.policy.tiers import UnknownTierError, resolve_slo
from nitsum.wire.messages import SamplingSpec
from nitsum_services.gateway.model_info import ModelInfo
from nitsum_services.gateway.protocol import ApiError


class RequestIntake:
    def __init__(self, config: GatewayConfig, model: ModelInfo) -> None:
        self.config = config
        self.model = model
        self.objectives = parse_objectives(config.objectives)

    async def json_body(self, request: web.Request):
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

    def slo(self, request: web.Request, priority: int | None):
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

    def check_bias(self, sampling: SamplingSpec) -> None:
        bad = [t for t in sampling.logit_bias_ids if t >= self.model.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"logit_bias names token id {bad[0]}, outside the vocabulary (size {self.model.vocab_size})",
                "logit_bias",
            )

    def check_model(self, name: str) -> None:
        if name and name != self.model.name:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model.name}'.",
                "model",
                "model_not_found",
            )
