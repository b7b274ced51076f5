"""schemathesis against a live `nitsum up` (gateway, coordinator, one real worker): every operation of
/openapi.json, positive and negative data, 50 examples each: no 5xx, and every response matches the
document (status code, content type, body schema; for SSE, every event's JSON payload).

Generated max_tokens are folded into 1..8 so the run stays fast; that changes how many tokens come back,
not which code paths run (a request without a limit would generate to the end of the 2048-token context).
Negative data keeps its invalid part: only valid limits are folded, and adding a limit to a body cannot
make an invalid body valid (the limits are known properties of both request schemas).

The fast tests at the end pin the protocol fixes schemathesis led to.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from nitsum_services.gateway.openapi import OPENAPI
from nitsum_services.gateway.protocol import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_INT_OPTION,
    MIN_TOP_P,
    ApiError,
    parse_chat,
    parse_completion,
)
from tests.e2e.conftest import start_mesh, stop_mesh

API_KEY = "sk-schemathesis"
MAX_EXAMPLES = 50
TOKEN_CAP = 8
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")

# Every operation the document declares; negative data only where there is an input to violate.
OPERATIONS = [(method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item]
WITH_INPUT = [(m, p) for m, p in OPERATIONS if {"parameters", "requestBody"} & set(OPENAPI["paths"][p][m.lower()])]
CASES = [pytest.param(m, p, "positive", id=f"{m} {p} positive") for m, p in OPERATIONS] + [
    pytest.param(m, p, "negative", id=f"{m} {p} negative") for m, p in WITH_INPUT
]


# Pinned examples (besides the generated ones) so that a non-streamed and a streamed answer of each
# generation route are always validated, whatever hypothesis draws.
PINNED = {
    "/v1/completions": [
        {"prompt": "Hello", "max_tokens": 4, "return_token_ids": True},
        {
            "prompt": [1, 2, 3],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.7,
            "seed": 1,
        },
    ],
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4},
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "stream": True,
            "temperature": 0,
        },
    ],
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("schemathesis-mesh"), devices=1, env_extra={"NITSUM_API_KEYS": API_KEY})
    yield mesh
    stop_mesh(mesh.process)


@pytest.fixture(scope="module")
def api_schema(mesh):
    return schemathesis.openapi.from_url(
        mesh.url + "/openapi.json",
        config=schemathesis.Config(),
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )


def _fold(value):
    """A valid token limit folded into 1..TOKEN_CAP; anything else (absent, null, invalid) as it was."""
    if isinstance(value, int) and not isinstance(value, bool) and TOKEN_CAP < value <= MAX_INT_OPTION:
        return 1 + (value - 1) % TOKEN_CAP
    return value


def cap_generation(case):
    body = case.body
    if case.operation.path in GENERATION_PATHS and isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body:
                body[name] = _fold(body[name])
        if (
            case.operation.path == "/v1/chat/completions"
            and body.get("max_tokens") is None
            and body.get("max_completion_tokens") is None
        ):
            body["max_completion_tokens"] = TOKEN_CAP  # without one, chat fills the context
    return case


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method, path, mode", CASES)
def test_operation_conforms_to_openapi(api_schema, method, path, mode):
    operation = api_schema[path][method]
    session = requests.Session()
    seen: list[tuple[int, str]] = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)).map(cap_generation))
    def run(case):
        response = case.call(session=session, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        content_type = response.headers.get("content-type", [""])[0].split(";")[0]  # lower-cased names, lists of values
        seen.append((response.status_code, content_type))
        case.validate_response(response, checks=CHECKS)

    if mode == "positive":
        for body in PINNED.get(path, []):
            run = example(case=operation.Case(body=body, media_type="application/json"))(run)
    run()
    # An operation without input has one distinct request, and hypothesis stops there.
    assert len(seen) >= (MAX_EXAMPLES if (method, path) in WITH_INPUT else 1), seen
    # Guard against a run that passes without reaching the mesh: generation requests produced tokens,
    # both as one JSON body and as a validated SSE stream.
    if mode == "positive" and path in GENERATION_PATHS:
        assert (200, "application/json") in seen, seen
        assert (200, "text/event-stream") in seen, seen
    if mode == "negative":
        assert any(400 <= status < 500 for status, _ in seen), seen


# ---- the fixes, pinned without the mesh --------------------------------------------------------------


def test_tiny_temperature_is_greedy_and_tiny_top_p_is_fp32_safe():
    # schemathesis found top_p=5e-324 (0 in fp32: the top-p filter dropped every token, NaN probabilities, 5xx).
    parsed = parse_completion({"prompt": "x", "temperature": 5e-324, "top_p": 5e-324})
    assert parsed.sampling.temperature == 0.0
    assert parsed.sampling.top_p == MIN_TOP_P
    assert float(np.float32(MIN_TOP_P)) > 0.0
    kept = parse_completion({"prompt": "x", "temperature": GREEDY_BELOW_TEMPERATURE, "top_p": 0.5})
    assert kept.sampling.temperature == GREEDY_BELOW_TEMPERATURE and kept.sampling.top_p == 0.5


@pytest.mark.parametrize("top_p", [0, 0.0, -1e-300])
def test_top_p_zero_is_still_rejected(top_p):
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x", "top_p": top_p})
    assert info.value.status == 400 and info.value.param == "top_p"


def test_document_bounds_match_the_parser():
    sampling = OPENAPI["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"
    ]
    assert sampling["max_tokens"]["maximum"] == MAX_INT_OPTION
    parse_completion({"prompt": "x", "max_tokens": MAX_INT_OPTION})
    with pytest.raises(ApiError):
        parse_completion({"prompt": "x", "max_tokens": MAX_INT_OPTION + 1})
    assert sampling["top_k"]["maximum"] == MAX_INT_OPTION
    with pytest.raises(ApiError):
        parse_completion({"prompt": "x", "top_k": MAX_INT_OPTION + 1})
    # Every prompt shape the document offers is one the parser accepts.
    for prompt in ("x", [1, 2], ["x"], [[1, 2]]):
        assert parse_completion({"prompt": prompt}).kind == "completion"
    parse_chat(
        {
            "messages": [
                {"role": "tool", "content": [{"type": "text", "text": "t"}]},
                {"role": "assistant", "content": None},
            ]
        },
        8,
    )


def test_fold_keeps_invalid_limits_and_caps_valid_ones():
    assert [_fold(v) for v in (1, 8, 9, 16, 17, MAX_INT_OPTION)] == [1, 8, 1, 8, 1, 8]
    for invalid in (0, -3, MAX_INT_OPTION + 1, "ten", True, None, 2.5, math.inf):
        assert _fold(invalid) is invalid
