"""Guided (response_format) generation in the engine itself: the output matches the schema, and a request
moved to another engine mid-document (as a TP change or P/D hand-off moves it) continues it validly."""

from __future__ import annotations

import json

import jsonschema_rs

from nitsum.engine.engine import Engine
from nitsum.engine.guided import grammar_for
from nitsum.engine.params import EngineConfig, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}


def _drain(engine: Engine, rid: str) -> tuple[list[int], str, str]:
    tokens, text, finish = [], "", None
    while finish is None:
        for out in engine.step():
            if out.request_id == rid:
                tokens.extend(out.new_token_ids)
                text += out.text_delta
                finish = out.finish_reason if out.finished else None
    return tokens, text, finish


def test_guided_output_validates_and_survives_a_move(tiny_dir):
    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    cfg = EngineConfig(model_dir=str(tiny_dir), kv_cache_mb=8)
    a, b = Engine(cfg), Engine(cfg)
    prompt = [1, 40, 50, 60, 70]
    for seed in (0, 1):
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, guide=grammar)
        a.add_request(f"whole-{seed}", prompt, params)
        _tokens, text, finish = _drain(a, f"whole-{seed}")
        assert finish == "stop"
        jsonschema_rs.validate(SCHEMA, json.loads(text))
        # The same request again, moved to engine b after 4 tokens: b's matcher replays them and goes on.
        rid = f"moved-{seed}"
        a.add_request(rid, prompt, params)
        head = []
        while len(head) < 4:
            head += [t for out in a.step() if out.request_id == rid for t in out.new_token_ids]
        state = a.export_state(rid)
        a.abort(rid)
        b.install_state(state, None)
        tail, _text, finish = _drain(b, rid)
        assert finish == "stop"
        jsonschema_rs.validate(SCHEMA, json.loads(a.tokenizer.decode(head + tail)))
