"""The sampling options of an OpenAI request body, validated into a `SamplingSpec` (pure: no I/O)."""

from __future__ import annotations

import math

from nitsum.wire.messages import SamplingSpec
from nitsum_services.gateway.fields import MAX_INT_OPTION, MAX_TOKEN_ID, _bad, _boolean, _integer, _number, _token_ids

MAX_STOP_STRINGS = 16
# The worker samples in fp32. A temperature this small already makes sampling argmax in effect, but
# dividing fp32 logits by it can overflow to inf (NaN probabilities), so it is served as greedy, as vLLM does.
GREEDY_BELOW_TEMPERATURE = 1e-5
# A top_p at or below the top token's probability keeps that token alone. That probability is >= 1/vocab,
# so any top_p under 1e-6 means the same for vocabularies under a million tokens; raising it to 1e-6 keeps
# it from rounding to 0 in fp32 (5e-324 does), where the top-p filter would drop every token.
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default limit; OpenAI's chat limit)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias


def _logit_bias(body: dict) -> tuple[tuple[int, ...], tuple[float, ...]]:
    value = body.get("logit_bias")
    if value is None:
        return (), ()
    if not isinstance(value, dict):
        raise _bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' has more than {MAX_LOGIT_BIAS} entries", "logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < MAX_TOKEN_ID or str(token) != str(key).strip():
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not math.isfinite(bias)
            or not -100 <= bias <= 100
        ):
            raise _bad(f"'logit_bias' values must be numbers between -100 and 100, got {bias!r}", "logit_bias")
        pairs.append((token, float(bias)))
    pairs.sort()
    return tuple(t for t, _ in pairs), tuple(b for _, b in pairs)


def _guide(body: dict) -> str:
    """The llguidance grammar of `response_format` ("" for free text)."""
    value = body.get("response_format")
    if value is None:
        return ""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format")
    if value["type"] == "text":
        return ""
    if value["type"] not in ("json_object", "json_schema"):
        raise _bad(
            f"'response_format' type {value['type']!r} is not supported (text, json_object, json_schema)",
            "response_format",
        )
    if _boolean(body, "ignore_eos"):
        raise _bad(
            "'ignore_eos' cannot be combined with a JSON 'response_format' (the document ends where its grammar ends)",
            "ignore_eos",
        )
    from nitsum.engine.guided import GuideError, grammar_for

    try:
        return grammar_for(value)
    except GuideError as exc:
        raise _bad(f"'response_format': {exc}", "response_format") from None


def _logprobs(body: dict, kind: str) -> int:
    """-1 (off) or the number of top alternatives per token."""
    if kind == "chat":
        wanted = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not wanted:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if wanted else -1
    top = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    return -1 if top is None else top


def parse_sampling(
    body: dict, max_tokens_default: int, max_tokens_name: str = "max_tokens", kind: str = "completion"
) -> tuple[SamplingSpec, bool]:
    given = body.get(max_tokens_name) is not None or body.get("max_tokens") is not None
    max_tokens = _integer(body, max_tokens_name, None, 1, MAX_INT_OPTION)
    if max_tokens is None and max_tokens_name != "max_tokens":
        max_tokens = _integer(body, "max_tokens", None, 1, MAX_INT_OPTION)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    stop_ids = body.get("stop_token_ids")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 63)):
        raise _bad("'seed' must be an integer", "seed")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise _bad("'top_p' must be > 0", "top_p")
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 2.0)
    if repetition_penalty <= 0.0:
        raise _bad("'repetition_penalty' must be > 0", "repetition_penalty")
    bias_ids, bias_values = _logit_bias(body)
    top_k = _integer(body, "top_k", 0, -1, MAX_INT_OPTION) or 0
    min_tokens = _integer(body, "min_tokens", 0, 0, MAX_INT_OPTION)
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    if min_tokens and body.get("response_format") not in (None, {"type": "text"}):
        raise _bad(
            "'min_tokens' cannot be combined with a JSON 'response_format' (the grammar decides where the document ends)",
            "min_tokens",
        )
    spec = SamplingSpec(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_p=max(top_p, MIN_TOP_P),
        top_k=max(top_k, 0),
        seed=seed,
        stop=stops,
        stop_token_ids=_token_ids(stop_ids, "stop_token_ids") if stop_ids is not None else (),
        ignore_eos=_boolean(body, "ignore_eos"),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=repetition_penalty,
        logit_bias_ids=bias_ids,
        logit_bias_values=bias_values,
        logprobs=_logprobs(body, kind),
        guide=_guide(body),
        min_tokens=min_tokens,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
    )
    return spec, given
