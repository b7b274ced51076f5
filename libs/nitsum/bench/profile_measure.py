"""The measuring half of `nitsum bench profile` (profile.py's docstring): the grids, the engine driven through
controlled batches (`Profiler`), TP>1 profiles as rank processes in a node world, and the device's peaks."""

from __future__ import annotations

import dataclasses
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nitsum.bench.profile_fit import StepPoint
from nitsum.policy.costmodel import ModelSpec

# (batch, context per sequence) for decode; (batch, prompt tokens per sequence) for prefill.
FULL_DECODE_GRID = ((1, 16), (1, 512), (1, 1536), (8, 16), (8, 512), (8, 1536), (32, 16), (32, 256), (32, 1024))
FULL_PREFILL_GRID = ((1, 16), (1, 64), (1, 256), (1, 1024), (4, 64), (4, 256), (16, 64))
QUICK_DECODE_GRID = ((1, 16), (1, 128), (4, 16), (4, 128))
QUICK_PREFILL_GRID = ((1, 16), (1, 128), (4, 64))


def model_spec_of(model_dir: Path) -> ModelSpec:
    from nitsum.model.loader import load_config

    cfg = load_config(model_dir)
    spec = ModelSpec(
        Path(model_dir).name,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        bytes_per_param=4.0,
        kv_bytes_per_elem=4.0,
    )
    if spec.head_dim != cfg.head_dim:
        print(
            f"note: head_dim {cfg.head_dim} != hidden/heads {spec.head_dim}; the cost model assumes the latter",
            file=sys.stderr,
        )
    return spec


def engine_config(model_dir: Path, max_batched_tokens: int, kv_cache_mb: int, seed: int):
    from nitsum.engine.params import EngineConfig

    return EngineConfig(
        model_dir=str(model_dir),
        max_num_seqs=256,
        max_num_batched_tokens=max_batched_tokens,
        kv_cache_mb=kv_cache_mb,
        enable_prefix_caching=False,
        seed=seed,
    )


class Profiler:
    """Drives one engine through controlled batches (public Engine API only)."""

    def __init__(self, model_dir: Path, max_batched_tokens: int, kv_cache_mb: int, seed: int, group=None) -> None:
        import torch

        from nitsum.engine.engine import Engine

        self.torch = torch
        self.max_batched_tokens = max_batched_tokens
        cfg = engine_config(model_dir, max_batched_tokens, kv_cache_mb, seed)
        self.engine = Engine(cfg) if group is None else Engine(cfg, group)
        self.vocab_limit = min(256, self.engine.runner.config.vocab_size)  # byte tokens: no special ids (no EOS)
        self.generator = torch.Generator().manual_seed(seed)
        self.next_id = 0

    def _prompts(self, batch: int, length: int) -> list[list[int]]:
        return [
            self.torch.randint(0, self.vocab_limit, (length,), generator=self.generator).tolist() for _ in range(batch)
        ]

    def _add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from nitsum.engine.params import SamplingParams

        ids = []
        for prompt in prompts:
            rid = f"profile-{self.next_id}"
            self.next_id += 1
            self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            ids.append(rid)
        return ids

    def warm_up(self) -> None:
        """Allocator and kernels warmed on a small batch (the first steps of a process are slower)."""
        from nitsum.engine.params import SamplingParams

        self.engine.generate(self._prompts(2, 32), SamplingParams(max_tokens=8, ignore_eos=True))

    def _timed_step(self) -> tuple[float, list, int]:
        before = self.engine.stats().num_prefill_tokens_computed
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        return elapsed_ms, outputs, self.engine.stats().num_prefill_tokens_computed - before

    def prefill(self, batch: int, length: int, repeats: int) -> StepPoint:
        times = []
        for _ in range(repeats + 1):  # the first repeat warms this shape and is not kept
            gc.collect()
            self._add(self._prompts(batch, length), max_tokens=1)
            elapsed_ms, outputs, computed = self._timed_step()
            assert computed == batch * length and len(outputs) == batch and all(o.finished for o in outputs), (
                f"prefill point ({batch}, {length}) did not run as one step: {computed} tokens, {len(outputs)} outputs"
            )
            assert not self.engine.has_unfinished(), "prefill requests must finish in their step"
            times.append(elapsed_ms)
        return StepPoint("prefill", batch, batch * length, batch * length, min(times[1:]))

    def decode(self, batch: int, context: int, steps: int) -> StepPoint:
        warm = 2
        # Sequences prefilled in early chunks decode while later ones prefill: room for those tokens too.
        prefill_steps = -(-batch * context // self.max_batched_tokens) + 1
        ids = self._add(self._prompts(batch, context), max_tokens=warm + steps + prefill_steps + 1)
        generated = dict.fromkeys(ids, 0)
        gc.collect()
        for _ in range(batch * context + 1):  # prefill (untimed) until every sequence has its first token
            outputs = self.engine.step()
            for out in outputs:
                generated[out.request_id] += len(out.new_token_ids)
            if all(generated.values()):
                break
        else:
            raise AssertionError(f"decode point ({batch}, {context}): prefill did not finish")
        times, contexts = [], []
        for i in range(warm + steps):
            context_tokens = sum(context + g for g in generated.values())  # tokens attended, new one included
            elapsed_ms, outputs, computed = self._timed_step()
            assert computed == 0 and len(outputs) == batch, (
                f"decode point ({batch}, {context}): {computed} prefill tokens, {len(outputs)} outputs"
            )
            for out in outputs:
                generated[out.request_id] += 1
            if i >= warm:
                times.append(elapsed_ms)
                contexts.append(context_tokens)
        for rid in ids:
            self.engine.abort(rid)
        assert not self.engine.has_unfinished(), "decode point left requests behind"
        return StepPoint("decode", batch, batch, round(statistics.mean(contexts)), min(times))


def csv_rows(points: list[StepPoint], tp: int, device: str, model: str) -> list:
    """The points as step-table rows (nitsum.policy.steptable: per-sequence prompt / context lengths)."""
    from nitsum.policy.steptable import StepRow

    out = []
    for p in points:
        if p.kind == "prefill":
            out.append(
                StepRow(
                    device,
                    model,
                    tp,
                    "prefill",
                    p.batch_size,
                    p.num_tokens // p.batch_size,
                    p.num_tokens // p.batch_size,
                    p.step_ms,
                )
            )
        else:
            out.append(
                StepRow(device, model, tp, "decode", p.batch_size, 0, round(p.context_tokens / p.batch_size), p.step_ms)
            )
    return out


def measure_points(profiler: Profiler, decode_grid, prefill_grid, steps: int, repeats: int) -> list[StepPoint]:
    profiler.warm_up()
    points = [profiler.decode(b, ctx, steps) for b, ctx in decode_grid]
    points += [profiler.prefill(b, n, repeats) for b, n in prefill_grid]
    return points


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile_tp(
    model_dir: Path,
    tp: int,
    quick: bool,
    threads: int,
    steps: int,
    repeats: int,
    seed: int,
    max_batched: int,
    kv_cache_mb: int,
    timeout_s: float = 600.0,
) -> list[StepPoint]:
    """The grid at TP=tp: `tp` rank processes form a node world (nitsum.parallel.world.NodeWorld, shared-memory
    collectives as the live workers use them), rank 0's engine leads the group and is timed, so every step
    includes the group's all-reduces and the step plan's broadcast."""
    import subprocess

    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="nitsum-profile-tp-") as tmp:
        out = Path(tmp) / "points.json"
        cmd = [
            sys.executable,
            "-m",
            "nitsum.bench.profile",
            "--rank-of-world",
            "",
            "--model",
            str(model_dir),
            "--threads",
            str(threads),
            "--steps",
            str(steps),
            "--repeats",
            str(repeats),
            "--seed",
            str(seed),
        ]
        if quick:
            cmd.append("--quick")
        procs = []
        for rank in range(tp):
            rank_cmd = list(cmd)
            rank_cmd[4] = json.dumps(
                {
                    "rank": rank,
                    "size": tp,
                    "port": port,
                    "out": str(out),
                    "max_batched": max_batched,
                    "kv_cache_mb": kv_cache_mb,
                }
            )
            procs.append(subprocess.Popen(rank_cmd))
        try:
            codes = [p.wait(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"TP{tp} profile: rank exit codes {codes}")
        return [StepPoint(**d) for d in json.loads(out.read_text())]


def _rank_main(spec: dict, args) -> int:
    """One rank of a TP>1 profile (see profile_tp)."""
    import torch

    from nitsum.engine.engine import run_peer
    from nitsum.parallel.world import NodeWorld

    torch.set_num_threads(args.threads)
    size = spec["size"]
    world = NodeWorld(spec["rank"], size, "127.0.0.1", spec["port"], min_tp=size, max_tp=size)
    try:
        world.attach_channels(lambda ranks: True)
        group = world.group(0, size)
        if spec["rank"] != 0:
            run_peer(engine_config(args.model, spec["max_batched"], spec["kv_cache_mb"], args.seed), group)
            return 0
        profiler = Profiler(args.model, spec["max_batched"], spec["kv_cache_mb"], args.seed, group=group)
        try:
            decode_grid = QUICK_DECODE_GRID if args.quick else FULL_DECODE_GRID
            prefill_grid = QUICK_PREFILL_GRID if args.quick else FULL_PREFILL_GRID
            points = measure_points(profiler, decode_grid, prefill_grid, args.steps, args.repeats)
        finally:
            profiler.engine.shutdown()
        Path(spec["out"]).write_text(json.dumps([dataclasses.asdict(p) for p in points]))
        return 0
    finally:
        world.destroy()


def measure_peaks(torch, repeats: int = 5) -> tuple[float, float]:
    """(FLOP/s of a 512³ fp32 matmul, bytes/s of a 64 MiB copy counted read + write), best of `repeats`."""
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best_mm = min(_time(lambda: torch.mm(a, b)) for _ in range(repeats))
    src = torch.ones(16 * 2**20)  # 64 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = min(_time(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * n**3 / best_mm, 2 * src.numel() * src.element_size() / best_copy


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
