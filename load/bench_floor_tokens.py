"""The per-token floor of `nitsum bench gateway --floor`: streams of `--floor-tokens` tokens, one at a time,
through the relay floor (load/bench_floor.py, relays in load/floor_relays.py). Its worker publishes one frame per token -- back to back, then
paced at the in-process engine's decode step (its step thread sleeps, or spins holding the GIL, to a fixed grid of step ends, as an
engine's step thread would step) -- and the front streams each as an SSE chunk.

`mesh_streams` sends the same kind of streams through the real mesh: its TPOT at the client against the engine's
decode step measured in-process in the same run (`nitsum bench gateway --stream-tokens`).

Back to back, what one more token costs the hops and the client: a stream's extra time over a single-token
stream's, per token (`tokens_result`). Paced, the TPOT a stream sees at the engine's step ((last token - first
token) / (tokens - 1) at the client), against the step: the issue's goal is <= 1.2x.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp

from nitsum.metrics import percentile
from nitsum_load.sse import DONE, SseParser, parse_chunk


async def _stream(session, endpoint: str, body: dict, tokens: int, timeout_s: float, who: str, headers=None):
    """One streamed request; the arrival time of each token (perf_counter seconds) and the time it was sent."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    parser = SseParser()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(endpoint, json=body, timeout=timeout, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{who} answered HTTP {resp.status}: {(await resp.text())[:200]}")
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            for payload in parser.feed(data):
                if payload != DONE:
                    stamps.extend([now] * parse_chunk(payload).tokens)
    if len(stamps) != tokens:
        raise RuntimeError(f"{who} streamed {len(stamps)} tokens, expected {tokens}")
    return t0, stamps


def _floor_body(prompt: list[int], tokens: int, step_ms: float, spin: bool) -> dict:
    return {"prompt": prompt, "max_tokens": tokens, "stream": True, "floor_step_ms": step_ms, "floor_step_spin": spin}


async def streams(
    url: str, prompts: list[list[int]], tokens: int, step_ms: float, warmup: int, timeout_s: float, spin: bool = False
) -> dict[str, list[float]]:
    """One stream after another, each of `tokens` tokens, alternating with one of a single token; the first
    `warmup` pairs are not counted. Per stream: TTFT, (last - first) / (tokens - 1), and the whole stream's time
    (for the single-token ones too)."""
    endpoint = url.rstrip("/") + "/v1/completions"
    out: dict[str, list[float]] = {"ttft_ms": [], "per_token_ms": [], "total_ms": [], "single_total_ms": []}
    async with aiohttp.ClientSession() as session:
        for n, prompt in enumerate(prompts):
            body, one = _floor_body(prompt, tokens, step_ms, spin), _floor_body(prompt, 1, 0.0, False)
            t0, stamps = await _stream(session, endpoint, body, tokens, timeout_s, "relay floor")
            s0, single = await _stream(session, endpoint, one, 1, timeout_s, "relay floor")
            if n >= warmup:
                out["ttft_ms"].append((stamps[0] - t0) * 1000.0)
                out["per_token_ms"].append((stamps[-1] - stamps[0]) * 1000.0 / (tokens - 1))
                out["total_ms"].append((stamps[-1] - t0) * 1000.0)
                out["single_total_ms"].append((single[0] - s0) * 1000.0)
    return out


async def mesh_streams(
    url: str,
    model: str,
    prompts: list[list[int]],
    tokens: int,
    warmup: int,
    timeout_s: float,
    step_probe: Callable[[list[int]], float] | None = None,
) -> dict[str, list[float]]:
    """The same streams through the mesh (greedy, `ignore_eos`: exactly `tokens` tokens each, interactive tier),
    one at a time; the first `warmup` are not counted. Per stream: TTFT and (last - first) / (tokens - 1), the TPOT
    the client sees, to set against the in-process engine's decode step measured in the same run.

    `step_probe` (the bench's in-process engine): called with each counted stream's prompt right before the stream
    is sent, it returns the engine's decode step on that prompt then (`engine_step_ms`, one per stream), so each
    stream's TPOT has a baseline from the same few hundred milliseconds: on this shared VM the step alone drifts by
    2x within minutes, more than the goal's margin (BENCHMARKS.md, issue 23)."""
    endpoint = url.rstrip("/") + "/v1/completions"
    headers = {"x-request-tier": "interactive"}
    out: dict[str, list[float]] = {"ttft_ms": [], "per_token_ms": [], "max_gap_ms": []}
    if step_probe is not None:
        out["engine_step_ms"] = []
    async with aiohttp.ClientSession() as session:
        for n, prompt in enumerate(prompts):
            if step_probe is not None and n >= warmup:
                out["engine_step_ms"].append(step_probe(prompt))  # blocks the loop: nothing else is in flight
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": tokens,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0.0,
                "return_token_ids": True,  # every token counted, also those whose text the detokenizer holds back
            }
            t0, stamps = await _stream(session, endpoint, body, tokens, timeout_s, "gateway", headers)
            if n >= warmup:
                out["ttft_ms"].append((stamps[0] - t0) * 1000.0)
                out["per_token_ms"].append((stamps[-1] - stamps[0]) * 1000.0 / (tokens - 1))
                out["max_gap_ms"].append(max(b - a for a, b in zip(stamps, stamps[1:])) * 1000.0)
    return out


def mesh_tokens_result(tokens: int, step_ms: float, measured: dict) -> dict[str, Any]:
    """The mesh's per-token figures against the engine's decode step (the issue's goal: p50 <= 1.2x)."""
    per_token = _stats(measured["per_token_ms"])
    out = {
        "tokens": tokens,
        "streams": len(measured["per_token_ms"]),
        "engine_step_ms": step_ms,
        "per_token_ms": per_token,
        "ttft_ms": _stats(measured["ttft_ms"]),
        # the longest time between two tokens of a stream (a worker's run of decode steps, NITSUM_DECODE_TURN_MS,
        # sends its tokens together: TPOT is the mean, this is the burst)
        "max_gap_ms": _stats(measured.get("max_gap_ms", [])),
        "per_token_over_step": per_token["p50"] / step_ms if step_ms > 0 else None,
    }
    paired = measured.get("engine_step_ms")
    if paired:
        # Each stream against the engine step measured right before it (mesh_streams' step_probe): the median of
        # the per-stream ratios, and the steps' own spread (how far the machine moved during the phase).
        ratios = [t / s for t, s in zip(measured["per_token_ms"], paired, strict=True) if s > 0]
        out["paired"] = {
            "engine_step_ms": _stats(paired),
            "engine_step_min_ms": min(paired),
            "engine_step_max_ms": max(paired),
            "per_token_over_step": _stats(ratios),
        }
    return out


def format_mesh_tokens(r: dict[str, Any]) -> str:
    p = r["per_token_ms"]
    return (
        f"per-token through the mesh: {r['streams']} streams of {r['tokens']} tokens, one at a time: TPOT p50 "
        f"{p['p50']:.3f} ms, p90 {p['p90']:.3f} ms, against the in-process engine's decode step "
        f"{r['engine_step_ms']:.3f} ms (same run): {r['per_token_over_step']:.2f}x; TTFT p50 {r['ttft_ms']['p50']:.2f} ms"
        + (
            f"; longest gap between two tokens p50 {g['p50']:.2f} ms"
            if (g := r.get("max_gap_ms") or {}).get("p50")
            else ""
        )
        + (
            f"\n  paired with the engine step measured right before each stream ({q['engine_step_min_ms']:.3f}-"
            f"{q['engine_step_max_ms']:.3f} ms, p50 {q['engine_step_ms']['p50']:.3f}): TPOT / step p50 "
            f"{q['per_token_over_step']['p50']:.2f}x, p90 {q['per_token_over_step']['p90']:.2f}x"
            if (q := r.get("paired"))
            else ""
        )
    )


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90)}


def tokens_result(tokens: int, step_ms: float, back_to_back: dict, paced: dict, spun: dict) -> dict[str, Any]:
    """Back to back, the frames of a stream reach the client in a few reads (the same arrival time for many
    tokens), so their cost is the stream's extra time over a single-token one: (p50 of whole `tokens`-token
    streams - p50 of single-token streams) / (tokens - 1). Paced, it is the time between the first token and the
    last one / (tokens - 1), against the engine step they were paced at: with the worker's step thread asleep
    (`paced`, the GIL free) and spinning in Python (`paced_spinning`, the GIL held as pure-Python engine code
    would hold it; a torch step is in between)."""
    b_total, b_single = _stats(back_to_back["total_ms"])["p50"], _stats(back_to_back["single_total_ms"])["p50"]
    out: dict[str, Any] = {
        "tokens": tokens,
        "streams": len(paced["per_token_ms"]),
        "engine_step_ms": step_ms,
        "back_to_back": {
            "per_token_ms": (b_total - b_single) / (tokens - 1),
            "stream_ms": _stats(back_to_back["total_ms"]),
            "single_token_stream_ms": _stats(back_to_back["single_total_ms"]),
            "ttft_ms": _stats(back_to_back["ttft_ms"]),
        },
    }
    for name, measured in (("paced", paced), ("paced_spinning", spun)):
        per_token = _stats(measured["per_token_ms"])
        out[name] = {
            "per_token_ms": per_token,
            "ttft_ms": _stats(measured["ttft_ms"]),
            "per_token_over_step": per_token["p50"] / step_ms if step_ms > 0 else None,
        }
    return out


def format_tokens(r: dict[str, Any]) -> str:
    b = r["back_to_back"]
    lines = [
        f"per-token floor: {r['streams']} streams of {r['tokens']} tokens, one at a time, SSE through the relay floor",
        f"  back to back: {b['per_token_ms']:.3f} ms per token (stream p50 {b['stream_ms']['p50']:.2f} ms, "
        f"single-token stream p50 {b['single_token_stream_ms']['p50']:.2f} ms)",
    ]
    for name, how in (("paced", "step thread asleep"), ("paced_spinning", "step thread spinning")):
        p = r[name]
        lines.append(
            f"  paced at the engine's decode step {r['engine_step_ms']:.3f} ms, {how}: per token p50 "
            f"{p['per_token_ms']['p50']:.3f} ms, p90 {p['per_token_ms']['p90']:.3f} ms "
            f"({p['per_token_over_step']:.2f}x the step); TTFT p50 {p['ttft_ms']['p50']:.2f} ms"
        )
    return "\n".join(lines)
