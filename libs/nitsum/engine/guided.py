"""Structured generation (OpenAI `response_format` json_object / json_schema) with llguidance.

The gateway turns a response format into an llguidance grammar (`grammar_for`, which also validates it);
the grammar travels in `SamplingParams.guide`. The engine gives each guided request a matcher
(`Guides.matcher`); before every sampled token the matcher's allowed-token mask sets every other logit to
-inf (`allowed`), and the sampled token is fed back to it. So the output always parses and matches the
schema when the request ends with "stop"; a request cut by max_tokens ends with "length" and may be an
unfinished document, as in OpenAI. A request that moves to another engine (TP change, P/D hand-off)
gets a new matcher that replays its output so far.

JSON is generated compact (no whitespace between tokens of the document), which keeps a small or random
model from wandering in whitespace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JSON_OPTIONS = {"whitespace_flexible": False}


class GuideError(ValueError):
    """The response format cannot be turned into a grammar (the message says why)."""


def grammar_for(response_format: dict) -> str:
    """An llguidance grammar for an OpenAI `response_format` of type json_object or json_schema."""
    import llguidance

    kind = response_format.get("type")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise GuideError("'response_format.json_schema' must be an object with a 'schema' object")
        schema = spec.get("schema", {})
    else:
        raise GuideError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GuideError(f"the JSON schema is not usable: {exc}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GuideError(f"the JSON schema is not usable: {problem}")
    return grammar


class Guides:
    """One engine's llguidance tokenizer (built on first use) and the matchers made from it."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_id: int | None) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = None

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            text = (self.model_dir / "tokenizer.json").read_text()
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_id)
        return self._tokenizer

    def matcher(self, grammar: str, replay: list[int] | tuple[int, ...] = ()):
        """A matcher for `grammar` that has consumed `replay` (a moved request's output so far)."""
        import llguidance

        m = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"the response format's grammar is not usable: {m.get_error()}")
        if replay and not m.consume_tokens(list(replay)):
            raise ValueError(f"the output so far does not match the response format: {m.get_error()}")
        return m


def allowed(matcher, vocab_size: int):
    """Bool tensor [vocab_size]: the tokens the matcher allows next."""
    import torch

    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    mask = bits.flatten()[:vocab_size].bool()
    if mask.shape[0] < vocab_size:  # tokens past the tokenizer's vocabulary (padding rows) are never allowed
        mask = torch.cat([mask, torch.zeros(vocab_size - mask.shape[0], dtype=torch.bool)])
    return mask
