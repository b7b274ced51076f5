"""Decode attention in place over the paged KV (flex attention with a block mask, `model/paged_attention.py`)
against the gather path, on the CPU and (gpu-marked) on CUDA, where it is the default.

Two engines on the same checkpoint, one per path, generate the same batch: prompts of lengths that end inside a
block, on a block boundary and one token past it, so that decode rows have full blocks only, a partial last
block, and a single slot in a fresh block; sequences finish at different steps (the batch shrinks), and a
late prompt joins mid-run (a prefill chunk beside decode rows in one step). Logits of every sampled row must
agree to fp32 rounding, and the greedy tokens must be equal."""

import shutil

import pytest
import torch
from devices import DEVICES, ON_CUDA
from engine_test_helpers import prompts_of_lengths, record_logits

from nitsum.engine import Engine, EngineConfig, SamplingParams
from nitsum.model.paged_attention import resolve_decode_attention

pytestmark = pytest.mark.slow  # the flex call is compiled once per process: tens of seconds on a CPU

LENGTHS = [5, 16, 17, 31, 40, 9]
MAX_TOKENS = [20, 12, 26, 7, 18, 24]


def test_auto_is_flex_on_cuda_and_gather_on_cpu():
    assert resolve_decode_attention("auto", "cuda:0") == "flex"
    assert resolve_decode_attention("auto", "cpu") == "gather"
    assert resolve_decode_attention("flex", "cpu") == "flex"
    assert resolve_decode_attention("auto", "cuda", block_size=8) == "gather"  # below the kernel's KV tile
    with pytest.raises(ValueError, match="multiple of 16"):
        resolve_decode_attention("flex", "cuda", block_size=8)
    with pytest.raises(ValueError, match="decode attention must be one of"):
        resolve_decode_attention("paged", "cpu")
    with pytest.raises(ValueError, match="decode_attention must be"):
        EngineConfig(model_dir="m", decode_attention="paged")


def run(engine: Engine, prompts, late_prompt):
    """Greedy streams of `prompts` (started together) and of `late_prompt`, added after the 6th step."""
    recorded = record_logits(engine)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    streams: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished():
        if steps == 6:
            engine.add_request("late", late_prompt, SamplingParams(max_tokens=10, ignore_eos=True))
            streams["late"] = []
        for out in engine.step():
            streams[out.request_id].extend(out.new_token_ids)
        steps += 1
    engine.check_integrity()
    return streams, [r.cpu() for r in recorded]


@pytest.mark.parametrize("device", DEVICES)
def test_flex_decode_equals_the_gather_path(tiny_dir, device):
    if device == "cpu" and shutil.which("g++") is None:
        pytest.skip("torch.compile's CPU backend needs a C++ compiler (g++), none on PATH")
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    [late] = prompts_of_lengths([23], seed=4)
    results = {}
    for path in ("gather", "flex"):
        engine = Engine(
            EngineConfig(
                model_dir=str(tiny_dir),
                device=device,
                dtype="float32",
                block_size=16,
                num_kv_blocks=64,
                decode_attention=path,
                enable_prefix_caching=False,
            )
        )
        assert engine.runner.decode_attention == path
        results[path] = run(engine, prompts, late)
        if path == "flex":
            assert engine.runner.flex.calls > 0  # the decode rows went through flex attention
    (tokens_g, logits_g), (tokens_f, logits_f) = results["gather"], results["flex"]
    assert tokens_f == tokens_g
    assert [len(tokens_g[f"r{i}"]) for i in range(len(LENGTHS))] == MAX_TOKENS
    assert len(logits_f) == len(logits_g)
    # fp32 either way; CUDA's kernels may reduce in another order (and flex's dots may run in tf32).
    tolerance = 1e-3 if device.startswith("cuda") else 1e-4
    for step, (a, b) in enumerate(zip(logits_f, logits_g)):
        assert a.shape == b.shape, step
        if a.numel():
            assert (a - b).abs().max().item() <= tolerance, step


@pytest.mark.skipif(not ON_CUDA, reason="the cuda default only")
@pytest.mark.parametrize("device", [d for d in DEVICES if d.id == "accel"])
def test_cuda_default_is_flex_in_bf16(tiny_dir, device):
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), device=device))
    assert engine.runner.decode_attention == "flex" and engine.runner.dtype == torch.bfloat16
    [tokens] = engine.generate(prompts_of_lengths([19]), SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(tokens) == 8 and engine.runner.flex.calls > 0
