"""`nitsum bench gateway`: what the gateway + NATS hop costs, against calling the engine in-process.

Both sides serve the same 1-token requests (prompts of `--prompt-tokens` token ids, a different prompt per
request so prefix caching treats both alike) with the same engine configuration: the in-process engine is
built by the worker's own `build_engine` from the worker's default config (one torch thread).

1. Latency: `--requests` requests one after another. In-process: `Engine.generate([prompt], max_tokens=1)`.
   Through the mesh: a non-streaming POST /v1/completions, timed at the client (HTTP + gateway + NATS +
   coordinator routing + worker + back). Reported: p50/p90 of both, the added latency and the ratio.
2. Throughput: `--concurrency` requests in flight until `--requests` are done. In-process: batches of
   `--concurrency` prompts through `Engine.generate`. Through the mesh: closed-loop clients. Reported:
   requests/s of both and the ratio.

The in-process baseline runs first, while no mesh is running, so the two never share the CPU. Without
`--url`, the bench starts `nitsum up --devices 1` itself (one worker, like the in-process engine) and stops it.

3. Per token (`--stream-tokens`, default 64; 0: none): `--streams` streamed requests of that many tokens, one
   at a time, through the mesh; their TPOT at the client ((last token - first) / (tokens - 1), p50) against the
   in-process engine's decode step for one stream, measured in the same run before the mesh starts
   ((time of N tokens - time of 1) / (N - 1) on a cached prompt, median of 10 prompts); and each stream against
   the same engine's step on its prompt measured right before it is sent (`per_token.paired`: the median of the
   per-stream ratios), since on a shared VM the step itself drifts within the run.

With `--floor`, the same requests then go through bare relays of the mesh's processes and hops (an aiohttp
server alone; aiohttp -> NATS -> coord -> NATS -> worker -> frame back, no nitsum code): what the hops alone
cost, so mesh-added minus floor-added is what nitsum's own code adds (load/bench_floor.py); and through the
same relays with the real engine stepping in the worker relay: the most any mesh with these hops and this
engine serves here. `--floor-only`
skips the mesh phase (the in-process engine still runs first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from nitsum.metrics import percentile
from nitsum_load import bench_floor, bench_floor_tokens
from nitsum_load.mesh import start_mesh

TOKEN_ID_BASE = 100
TOKEN_ID_SPAN = 100
STEP_SAMPLES = 10  # prompts the engine's decode step is timed on (--floor-tokens)


def prompts(n: int, length: int) -> list[list[int]]:
    """n distinct prompts of `length` low token ids (present in every vocabulary)."""
    return [[TOKEN_ID_BASE + (i * 7 + j) % TOKEN_ID_SPAN for j in range(length)] for i in range(n)]


def build_in_process(model: str):
    """The in-process engine: the worker's own `build_engine` from the worker's default config."""
    from nitsum.config import WorkerConfig, load
    from nitsum_services.worker.main import build_engine

    return build_engine(load(WorkerConfig, argv=["--model", model], environ=os.environ), "hybrid")


def in_process(
    model: str,
    latency_prompts: list[list[int]],
    tput_prompts: list[list[int]],
    concurrency: int,
    warmup: int,
    step_tokens: int = 0,
    engine=None,
) -> dict[str, Any]:
    import torch

    from nitsum.engine.params import SamplingParams

    engine = engine if engine is not None else build_in_process(model)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with torch.inference_mode():
        for p in latency_prompts[:warmup]:
            engine.generate([p], params)
        lat_ms = []
        for p in latency_prompts[warmup:]:
            t = time.perf_counter()
            engine.generate([p], params)
            lat_ms.append((time.perf_counter() - t) * 1000.0)
        step_ms = decode_step_ms(engine, latency_prompts[:STEP_SAMPLES], step_tokens) if step_tokens > 1 else None
        t, cpu = time.perf_counter(), time.process_time()
        for i in range(0, len(tput_prompts), concurrency):
            engine.generate(tput_prompts[i : i + concurrency], params)
        tput_s, cpu = time.perf_counter() - t, time.process_time() - cpu
    return {
        "latency_ms": lat_ms,
        "requests_per_s": len(tput_prompts) / tput_s,
        "throughput_cpu_ms_per_request": cpu * 1000.0 / len(tput_prompts),
        "torch_threads": torch.get_num_threads(),
        "decode_step_ms": step_ms,
    }


def step_probe(engine, tokens: int):
    """`mesh_streams`' probe: the engine's decode step on one prompt, measured now (decode_step_ms)."""
    import torch

    def probe(prompt: list[int]) -> float:
        with torch.inference_mode():
            return decode_step_ms(engine, [prompt], tokens)

    return probe


def decode_step_ms(engine, prompts: list[list[int]], tokens: int) -> float:
    """The engine's decode step for one stream: per prompt (cached by a first run, so both runs prefill alike),
    (time of `tokens` tokens - time of 1 token) / (tokens - 1); the median over the prompts."""
    from nitsum.engine.params import SamplingParams

    one, many = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=tokens, ignore_eos=True)
    steps = []
    for p in prompts:
        engine.generate([p], one)
        t = time.perf_counter()
        engine.generate([p], one)
        t1 = time.perf_counter()
        engine.generate([p], many)
        steps.append(((time.perf_counter() - t1) - (t1 - t)) * 1000.0 / (tokens - 1))
    return float(statistics.median(steps))


async def through_gateway(
    url: str,
    model: str,
    latency_prompts: list[list[int]],
    tput_prompts: list[list[int]],
    concurrency: int,
    warmup: int,
    timeout_s: float,
) -> dict[str, Any]:
    endpoint = url.rstrip("/") + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0.0}
        async with session.post(
            endpoint, json=body, timeout=timeout, headers={"x-request-tier": "interactive"}
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"gateway answered HTTP {resp.status}: {(await resp.text())[:200]}")
            data = await resp.json()
            if data["usage"]["completion_tokens"] != 1:
                raise RuntimeError(f"expected 1 token, got {data['usage']}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for p in latency_prompts[:warmup]:
            await one(session, p)
        lat_ms = []
        for p in latency_prompts[warmup:]:
            t = time.perf_counter()
            await one(session, p)
            lat_ms.append((time.perf_counter() - t) * 1000.0)
        queue = list(reversed(tput_prompts))

        async def worker() -> None:
            while queue:
                await one(session, queue.pop())

        cpu = bench_floor.tree_cpu_s()  # before the clock starts: it reads /proc
        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        tput_s, cpu_end = time.perf_counter() - t, bench_floor.tree_cpu_s()
    # CPU of this process and its children (the client, and the mesh or relays the bench started).
    cpu_ms = (cpu_end - cpu) * 1000.0 / len(tput_prompts) if cpu is not None and cpu_end is not None else None
    return {"latency_ms": lat_ms, "requests_per_s": len(tput_prompts) / tput_s, "throughput_cpu_ms_per_request": cpu_ms}


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90)}


def compare(engine: dict[str, Any], gateway: dict[str, Any]) -> dict[str, Any]:
    e, g = _stats(engine["latency_ms"]), _stats(gateway["latency_ms"])
    return {
        "engine_latency_ms": e,
        "gateway_latency_ms": g,
        "added_latency_p50_ms": g["p50"] - e["p50"],
        "added_latency_p90_ms": g["p90"] - e["p90"],
        "latency_ratio_p50": g["p50"] / e["p50"],
        "engine_requests_per_s": engine["requests_per_s"],
        "gateway_requests_per_s": gateway["requests_per_s"],
        "throughput_ratio": gateway["requests_per_s"] / engine["requests_per_s"],
    }


def format_result(r: dict[str, Any]) -> str:
    e, g = r["engine_latency_ms"], r["gateway_latency_ms"]
    return "\n".join(
        [
            "1-token requests          in-process engine   through gateway + NATS   gateway / engine",
            f"latency p50 (ms)          {e['p50']:17.2f}   {g['p50']:22.2f}   {r['latency_ratio_p50']:14.2f}x",
            f"latency p90 (ms)          {e['p90']:17.2f}   {g['p90']:22.2f}   {g['p90'] / e['p90']:14.2f}x",
            f"throughput (requests/s)   {r['engine_requests_per_s']:17.1f}   {r['gateway_requests_per_s']:22.1f}   "
            f"{r['throughput_ratio']:14.2f}x",
            f"added latency: p50 {r['added_latency_p50_ms']:.2f} ms, p90 {r['added_latency_p90_ms']:.2f} ms",
        ]
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="nitsum bench gateway", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=None, help="measure this running mesh instead of starting one")
    p.add_argument("--model", default="tiny", help="model the in-process engine loads (must match the mesh)")
    p.add_argument("--requests", type=int, default=100, help="requests per phase (after warm-up)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--gateways", type=int, default=1, help="gateway processes of the mesh the bench starts (nitsum up)")
    p.add_argument(
        "--cpu-affinity",
        choices=("auto", "off"),
        default="auto",
        help="`nitsum up --cpu-affinity` of the mesh the bench starts (auto: the worker on a CPU of its own)",
    )
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per-request timeout")
    p.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    p.add_argument("--floor", action="store_true", help="after the mesh, measure the bare relays' floor too")
    p.add_argument("--floor-only", action="store_true", help="the engine and the floor, no mesh phase")
    p.add_argument("--floor-tokens", type=int, default=64, help="tokens per stream of the per-token floor (0: none)")
    p.add_argument("--floor-streams", type=int, default=30, help="streams of the per-token floor (after warm-up)")
    p.add_argument(
        "--stream-tokens",
        type=int,
        default=64,
        help="tokens per stream of the mesh's per-token phase (TPOT against the engine's step; 0: none)",
    )
    p.add_argument("--streams", type=int, default=30, help="streams of the mesh's per-token phase (after warm-up)")
    args = p.parse_args(argv)
    if args.floor_only and args.url:
        p.error("--floor-only measures no mesh: drop --url")
    for name in ("requests", "concurrency", "prompt_tokens", "gateways", "floor_streams", "streams"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.floor_tokens < 0 or args.floor_tokens == 1:
        p.error("--floor-tokens must be 0 (no per-token floor) or >= 2")
    if args.stream_tokens < 0 or args.stream_tokens == 1:
        p.error("--stream-tokens must be 0 (no per-token phase) or >= 2")
    lat = prompts(args.warmup + args.requests, args.prompt_tokens)
    tput = prompts(args.requests, args.prompt_tokens)
    # Shift throughput prompts so they share no prefix block with the latency phase either.
    tput = [[TOKEN_ID_BASE + (t + 50) % TOKEN_ID_SPAN for t in q] for q in tput]

    print(
        f"in-process engine: {args.requests} sequential + {args.requests} at concurrency {args.concurrency} ...",
        flush=True,
    )
    floor = args.floor or args.floor_only
    mesh_tokens = 0 if args.floor_only else args.stream_tokens
    step_tokens = max(mesh_tokens, args.floor_tokens if floor else 0)
    local = build_in_process(args.model)
    engine = in_process(args.model, lat, tput, args.concurrency, args.warmup, step_tokens, engine=local)
    run_dir = Path(tempfile.mkdtemp(prefix="nitsum-bench-gateway-"))
    probe = step_probe(local, args.stream_tokens) if args.stream_tokens else None
    gateway = None if args.floor_only else mesh_phase(args, run_dir, lat, tput, probe)
    result = compare(engine, gateway) if gateway is not None else {"engine_latency_ms": _stats(engine["latency_ms"])}
    if gateway is not None and "streams" in gateway:
        result["per_token"] = bench_floor_tokens.mesh_tokens_result(
            args.stream_tokens, engine["decode_step_ms"], gateway.pop("streams")
        )
    result["engine_requests_per_s"] = engine["requests_per_s"]
    if floor:
        result["floor"] = floor_phase(args, run_dir, engine, gateway, lat, tput)
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "engine_torch_threads": engine["torch_threads"],
    }
    result["date"] = time.strftime("%Y-%m-%d")
    if gateway is not None:
        print(format_result(result))
        if "per_token" in result:
            print(bench_floor_tokens.format_mesh_tokens(result["per_token"]))
    if "floor" in result:
        print(bench_floor.format_floor(result["engine_latency_ms"], engine["requests_per_s"], result["floor"]))
        if "per_token" in result["floor"]:
            print(bench_floor_tokens.format_tokens(result["floor"]["per_token"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def floor_phase(args, run_dir: Path, engine: dict, gateway: dict | None, lat, tput) -> dict[str, Any]:
    """The same requests through the bare relays (load/bench_floor.py), then the per-token floor."""
    sizes = bench_floor.message_sizes(lat[0])
    step_ms = engine["decode_step_ms"]
    stream_prompts = lat[: args.warmup + args.floor_streams]

    def per_token(url: str, paced_ms: float, spin: bool = False) -> dict:
        return asyncio.run(
            bench_floor_tokens.streams(
                url, stream_prompts, args.floor_tokens, paced_ms, args.warmup, args.timeout, spin
            )
        )

    def token_floors(url: str) -> tuple[dict, dict, dict]:
        return per_token(url, 0.0), per_token(url, step_ms), per_token(url, step_ms, spin=True)

    floors = bench_floor.run_floors(
        lambda url: asyncio.run(
            through_gateway(url, args.model, lat, tput, args.concurrency, args.warmup, args.timeout)
        ),
        run_dir / "floor",
        sizes,
        args.timeout,
        per_token=token_floors if args.floor_tokens else None,
        model=args.model,
    )
    tokens = floors.pop("per_token", None)
    result = bench_floor.floor_result(compare, engine, floors, gateway, sizes, warmup=args.warmup)
    result["concurrency"] = args.concurrency
    if tokens is not None:
        result["per_token"] = bench_floor_tokens.tokens_result(args.floor_tokens, step_ms, *tokens)
    return result


def mesh_phase(args, run_dir: Path, lat: list[list[int]], tput: list[list[int]], probe=None) -> dict[str, Any]:
    """The same requests through the mesh at `--url`, or through a `nitsum up` this starts and stops; `probe`
    (step_probe) pairs each stream of the per-token phase with the in-process engine's step right before it."""
    mesh = None
    url = args.url
    if url is None:
        print(
            f"starting nitsum up --devices 1 --gateways {args.gateways} --cpu-affinity {args.cpu_affinity} "
            f"(logs in {run_dir}) ...",
            flush=True,
        )
        extra = ("--model", args.model, "--gateways", str(args.gateways), "--cpu-affinity", args.cpu_affinity)
        mesh = start_mesh(run_dir, devices=1, extra_args=extra)
        url = mesh.url
    try:
        print(f"gateway {url}: the same requests ...", flush=True)
        measured = asyncio.run(
            through_gateway(url, _served_model(url), lat, tput, args.concurrency, args.warmup, args.timeout)
        )
        if mesh is None:  # a mesh of its own: its CPU is not this process tree's
            measured["throughput_cpu_ms_per_request"] = None
        if args.stream_tokens:
            print(
                f"gateway {url}: {args.streams} streams of {args.stream_tokens} tokens, one at a time ...", flush=True
            )
            stream_prompts = lat[: args.warmup + args.streams]
            measured["streams"] = asyncio.run(
                bench_floor_tokens.mesh_streams(
                    url, _served_model(url), stream_prompts, args.stream_tokens, args.warmup, args.timeout, probe
                )
            )
        return measured
    finally:
        if mesh is not None:
            mesh.stop()


def _served_model(url: str) -> str:
    async def get() -> str:
        async with aiohttp.ClientSession() as s:
            async with s.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return str((await r.json())["data"][0]["id"])

    return asyncio.run(get())
