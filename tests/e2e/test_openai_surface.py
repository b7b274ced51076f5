"""The OpenAI surface through the official `openai` client against `nitsum up` (one real worker): logprobs,
penalties and logit_bias checked on the logits against `transformers` (an independent implementation of
the same checkpoint), n > 1 with a seed, stream_options.include_usage, tiers from vLLM's `priority`.

The reference: the log-softmax, at each sampled step, of HF's logits for prompt + the tokens generated so
far, processed as OpenAI/vLLM define it (bias added; repetition, frequency, presence penalties; divided by
the temperature). The engine's fp32 logits differ from HF's by rounding only, so logprobs agree to 1e-3.
"""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

from tests.e2e.conftest import start_mesh, stop_mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [1, 17, 93, 250, 7, 41, 3, 88, 120, 9, 66, 301, 5, 14, 200, 33, 71, 12, 45, 99]
ATOL = 1e-3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    mesh = start_mesh(tmp_path_factory.mktemp("openai-surface"), devices=1, extra_args=("--model", str(tiny_model_dir)))
    yield mesh
    stop_mesh(mesh.process)


@pytest.fixture(scope="module")
def client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _reference_logits(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: HF's logits at each step that sampled an output token."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    return logits[len(prompt) - 1 :]


def _process(
    logits: torch.Tensor, history: list[int], num_prompt: int, bias=None, freq=0.0, pres=0.0, rep=1.0, temperature=1.0
) -> torch.Tensor:
    out = logits.clone()
    for token, b in (bias or {}).items():
        out[int(token)] += b
    if rep != 1.0:
        for t in set(history):
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    counts = torch.bincount(torch.tensor(history[num_prompt:] or [0], dtype=torch.long), minlength=out.shape[0]).float()
    if len(history) == num_prompt:
        counts.zero_()
    out = out - freq * counts - pres * (counts > 0).float()
    return torch.log_softmax(out / temperature, dim=-1)


def _check_completion_logprobs(hf, choice, prompt, top: int, **processing) -> None:
    tokens = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(tokens) == len(lp.top_logprobs) == len(lp.tokens)
    ref = _reference_logits(hf, prompt, tokens)
    for j, token in enumerate(tokens):
        expected = _process(ref[j], prompt + tokens[:j], len(prompt), **processing)
        assert math.isclose(lp.token_logprobs[j], float(expected[token]), abs_tol=ATOL), (
            j,
            lp.token_logprobs[j],
            float(expected[token]),
        )
        want = torch.topk(expected, top).values.tolist()
        got = sorted(lp.top_logprobs[j].values(), reverse=True)
        # Tokens whose texts coincide share a key; every reported value is one of the top ones.
        assert len(got) >= 1 and all(any(math.isclose(g, w, abs_tol=ATOL) for w in want) for g in got), (j, got, want)
        assert math.isclose(got[0], want[0], abs_tol=ATOL)


def test_completion_logprobs_are_the_sampled_distribution(client, hf):
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.7,
        seed=5,
        logprobs=5,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = out.choices[0]
    _check_completion_logprobs(hf, choice, PROMPT, 5, temperature=0.7)
    assert choice.logprobs.text_offset[0] == 0
    assert "".join(choice.logprobs.tokens).startswith(choice.text[:1])


def test_chat_logprobs_streamed_and_not(client, hf, tiny_model_dir):
    from nitsum.model.loader import read_raw_config
    from nitsum.model.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Say something long."}]
    tok = Tokenizer(tiny_model_dir, read_raw_config(tiny_model_dir))
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    full = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens = full.choices[0].model_extra["token_ids"]
    content = full.choices[0].logprobs.content
    assert len(content) == len(tokens) == 5
    ref = _reference_logits(hf, prompt, tokens)
    for j, entry in enumerate(content):
        expected = torch.log_softmax(ref[j], dim=-1)  # greedy: temperature read as 1
        assert math.isclose(entry.logprob, float(expected[tokens[j]]), abs_tol=ATOL)
        assert len(entry.top_logprobs) == 3
        assert math.isclose(entry.top_logprobs[0].logprob, float(expected.max()), abs_tol=ATOL)
        assert entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [e.logprob for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=ATOL)


def test_logit_bias_shifts_the_logits(client, hf):
    base = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, extra_body={"return_token_ids": True}
    )
    first = base.choices[0].model_extra["token_ids"][0]
    ref = _reference_logits(hf, PROMPT, [first])[0]
    boosted = int(torch.topk(ref, 5).indices[4])  # the 5th most likely token
    bias = {str(first): -100, str(boosted): 3.5}
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        logit_bias=bias,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens = out.choices[0].model_extra["token_ids"]
    assert first not in tokens
    _check_completion_logprobs(hf, out.choices[0], PROMPT, 3, bias={first: -100.0, boosted: 3.5})


def test_penalties_change_the_logits_as_defined(client, hf):
    processing = {"freq": 0.8, "pres": 0.6, "rep": 1.4}
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logprobs=3,
        frequency_penalty=0.8,
        presence_penalty=0.6,
        extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.4},
    )
    _check_completion_logprobs(hf, out.choices[0], PROMPT, 3, **processing)
    # Sampled (temperature 0.9, top_k 20) with penalties: the logprobs are still those of the distribution drawn from.
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.9,
        seed=3,
        logprobs=2,
        frequency_penalty=1.5,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    _check_completion_logprobs(hf, out.choices[0], PROMPT, 2, freq=1.5, temperature=0.9)


def test_n_choices_with_a_seed_are_reproducible_and_share_the_prompt(client):
    prompt = PROMPT * 3  # 60 tokens: 3 whole KV blocks of 16 to share
    kwargs = dict(
        model="tiny",
        prompt=prompt,
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=42,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    ids_a = [c.model_extra["token_ids"] for c in a.choices]
    assert ids_a == [c.model_extra["token_ids"] for c in b.choices]
    assert len({tuple(t) for t in ids_a}) > 1, "three seeded choices should not all be the same draw"
    assert a.usage.prompt_tokens == len(prompt) and a.usage.completion_tokens == 24
    assert a.usage.prompt_tokens_details.cached_tokens >= 48  # the later choices found the prompt cached
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    per_index: dict[int, list[int]] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            per_index.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
    assert [per_index[i] for i in range(3)] == ids_a
    assert usage is not None and usage.completion_tokens == 24


def test_include_usage_only_when_asked(client):
    def chunks(**extra):
        return list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True, **extra
            )
        )

    assert all(c.usage is None for c in chunks())
    assert all(c.usage is None for c in chunks(stream_options={"include_usage": False}))
    with_usage = chunks(stream_options={"include_usage": True})
    assert with_usage[-1].usage is not None and with_usage[-1].choices == []
    assert all(c.usage is None for c in with_usage[:-1])
    # vLLM's continuous_usage_stats (guidellm sends it): every chunk carries the usage so far.
    continuous = chunks(stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in continuous]
    assert all(c.usage is not None for c in continuous) and counts == sorted(counts)
    assert counts[-1] == with_usage[-1].usage.completion_tokens == 3
    assert len({c.usage.prompt_tokens for c in continuous}) == 1


def test_priority_and_objective_pick_the_tier(client):
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": 5}
    )
    assert raw.headers["x-request-tier"] == "background"
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": -1}
    )
    assert raw.headers["x-request-tier"] == "interactive"
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="hi", max_tokens=1, extra_headers={"x-gateway-inference-objective": "sheddable"}
    )
    assert raw.headers["x-request-tier"] == "background"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=1, extra_headers={"x-gateway-inference-objective": "gold"}
        )
    assert info.value.body["code"] == "unknown_objective"


def test_refused_fields_through_the_client(client):
    for kwargs, param in (
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"extra_body": {"some_vendor_field": True}}, "some_vendor_field"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kwargs
            )
        assert info.value.body["param"] == param


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_parses_and_validates(client, seed):
    import jsonschema_rs

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=400,
        temperature=1.0,
        seed=seed,
        response_format=fmt,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content))
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=400,
        temperature=1.0,
        seed=seed,
        response_format=fmt,
        stream=True,
    )
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert text == choice.message.content  # same seed, same constrained draws


def test_json_object_output_parses(client):
    # The random model needs luck to close strings, so the completion gets room; "stop" means the grammar's end.
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=1500,
        temperature=0.7,
        seed=4,
        response_format={"type": "json_object"},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content[:200]
    assert isinstance(json.loads(choice.message.content), dict)
    # The legacy completions route takes it too (as an extra body field: the client does not type it there).
    out = client.completions.create(
        model="tiny",
        prompt="{",
        max_tokens=1500,
        temperature=0.7,
        seed=5,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_min_tokens_holds_eos_back(client, tiny_model_dir):
    import json as _json

    eos = _json.loads((tiny_model_dir / "config.json").read_text()).get("eos_token_id")
    bias = {str(eos): 100}  # EOS would be the next token every time
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias=bias,
        extra_body={"return_token_ids": True},
    )
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias=bias,
        extra_body={"min_tokens": 5, "return_token_ids": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 6 and eos not in out.choices[0].model_extra["token_ids"][:5]
