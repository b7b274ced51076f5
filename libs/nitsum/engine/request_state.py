"""A request's full state as a msgpack-ready dict, and back: what moves with a request between engines.

Engine-owned: `Engine.export_state(s)` / `Engine.install_state(s)` / `Engine.export_kv` call these two
functions and do the engine's own part (its request table, KV manager and scheduler) themselves; nothing
outside `engine/` builds or reads a `Sequence`. No pickle: a torch generator's state travels as bytes, the
SLO as its age (engines on other hosts have other clocks).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from nitsum.engine.params import SamplingParams
from nitsum.engine.sequence import Sequence
from nitsum.engine.slo import RequestSlo
from nitsum.model.tokenizer import IncrementalDetokenizer


def state_of(seq: Sequence, prefill_target: int | None, now_ms: float) -> dict[str, Any]:
    """`seq` as a dict; `prefill_target`: the scheduler's, `now_ms`: the engine clock (ages the SLO)."""
    detok = seq.detokenizer
    return {
        "id": seq.request_id,
        "prompt": list(seq.prompt_token_ids),
        "tokens": list(seq.token_ids),
        "params": _params_of(seq.params),
        "computed": seq.num_computed_tokens,
        "cached_prompt": seq.num_cached_prompt_tokens,
        "status": seq.status.value,
        "preemptions": seq.num_preemptions,
        "generator": bytes(seq.generator.get_state().numpy().tobytes()) if seq.generator is not None else None,
        "detok": detok.export() if detok is not None else None,
        "text": seq.text,
        "emitted": seq.num_text_emitted,
        "prefill_target": prefill_target,
        "slo": None
        if seq.slo is None
        else {
            "tier": seq.slo.tier,
            "ttft_ms": seq.slo.ttft_ms,
            "tpot_ms": seq.slo.tpot_ms,
            "age_ms": now_ms - seq.slo.arrival_ms,
        },
    }


def _params_of(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters as plain values (every field is a scalar or a tuple of scalars or pairs;
    `dataclasses.asdict` deep-copied each of them: half of a state's export)."""
    out = {}
    for name in _PARAM_FIELDS:
        v = getattr(params, name)
        out[name] = list(v) if v.__class__ is tuple else v
    return out


_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


def sequence_of(state: dict[str, Any], arrival_index: int, tokenizer: Any, guides: Any, now_ms: float) -> Sequence:
    """A fresh `Sequence` from `state_of`'s dict: tokens, text, generator, detokenizer, matcher and SLO restored;
    its status and computed tokens are left for the engine to set (they depend on the KV that came along)."""
    import torch

    params = SamplingParams(**state["params"])
    seq = Sequence(state["id"], list(state["prompt"]), params, arrival_index=arrival_index)
    seq.token_ids = list(state["tokens"])
    seq.num_cached_prompt_tokens = state["cached_prompt"]
    seq.num_preemptions = state["preemptions"]
    seq.text = state["text"]
    seq.num_text_emitted = state["emitted"]
    slo = state.get("slo")
    if slo is not None:
        seq.slo = RequestSlo(slo["tier"], slo["ttft_ms"], slo["tpot_ms"], arrival_ms=now_ms - slo["age_ms"])
    if state["generator"] is not None:
        generator = torch.Generator(device="cpu")
        generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))
        seq.generator = generator
    detok = IncrementalDetokenizer(tokenizer)
    if state["detok"] is not None:
        detok.restore(state["detok"])
    seq.detokenizer = detok
    if params.guide:  # a guided request's matcher replays the output so far
        seq.matcher = guides.matcher(params.guide, seq.output_token_ids)
    return seq
