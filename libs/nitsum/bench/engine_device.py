"""`nitsum bench engine --device cuda`: output tokens/s of the engine against transformers `generate`, batched,
on one accelerator, same weights, same process, same run.

The model is a random-weight Llama of about 1.1B parameters (Llama-3.2-1B's shapes with a 32000-token vocab:
hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192), generated here from a fixed seed in bf16 (nothing is
downloaded). For each concurrency c (default 1, 8, 32, 128): c requests with equal-length random prompts
(`--prompt-len`, default 128), greedy, `--max-tokens` new tokens each (default 128, EOS ignored), all started
together: nitsum's `Engine.generate` (continuous batching, paged KV, its default decode attention: flex on CUDA)
against one `generate` call on the batch of c (transformers' static batching, its best case here, since all
prompts have one length). Both sides run in the default dtype of the device (bf16 on CUDA) and are warmed first
(nitsum's flex attention is compiled then, transformers' kernels loaded). Time is wall time after a device
synchronisation; each figure is the best of `--repeat` interleaved runs. Greedy streams are compared too: in bf16
two correct engines part at near-ties (tests/greedy_ties.py), so the count of equal streams is reported, not
asserted.

`--device cpu --size tiny` runs the same steps on the tiny checkpoint (the dry run of `.ci/gpu-check`).
`--out DIR` writes the rows (JSON) and the table with the machine's details (Markdown). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

CONFIG_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 16,
    "vocab_size": 32000,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
}
SIZES = {"1b": CONFIG_1B, "tiny": {}}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompts(concurrency: int, prompt_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (prompt_len,), generator=gen).tolist() for _ in range(concurrency)]


def time_nitsum(engine, prompts, max_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    from nitsum.engine.params import SamplingParams

    _sync(device)
    start = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    _sync(device)
    return time.perf_counter() - start, out


@torch.inference_mode()
def time_hf(model, prompts, max_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    _sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (nvidia-smi did not answer)"
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def run(
    device: str,
    size: str,
    concurrencies: list[int],
    prompt_len: int,
    max_tokens: int,
    repeat: int,
    workdir: Path,
    log=print,
    decode_attention: str = "auto",
    save=None,
) -> tuple[dict, list[dict]]:
    """The measurements; `save(info, rows)` is called after each concurrency (a run cut short keeps its rows)."""
    from transformers import LlamaForCausalLM

    from nitsum.config import default_dtype
    from nitsum.engine.engine import Engine
    from nitsum.engine.params import EngineConfig
    from nitsum.model.tiny import make_tiny

    dtype = default_dtype(device)
    t0 = time.perf_counter()
    model_dir = make_tiny(workdir / f"random-{size}", config_overrides=SIZES[size], dtype=dtype)
    log(f"model written in {time.perf_counter() - t0:.1f} s ({dtype})")
    biggest = max(concurrencies)
    tokens_per_seq = prompt_len + max_tokens
    engine = Engine(
        EngineConfig(
            model_dir=str(model_dir),
            device=device,
            max_num_seqs=biggest,
            max_num_batched_tokens=max(2048, 4 * prompt_len),
            kv_cache_mb=_kv_mb(model_dir, dtype, biggest * tokens_per_seq),
            enable_prefix_caching=False,
            decode_attention=decode_attention,
        )
    )
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    num_params = sum(p.numel() for p in hf.parameters())
    info = {
        **machine(device),
        "model": f"random Llama {num_params / 1e9:.2f}B" if size == "1b" else "tiny",
        "num_params": num_params,
        "dtype": dtype,
        "decode_attention": engine.runner.decode_attention,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "repeat": repeat,
    }
    log(f"loaded {info['model']} on {device} in {time.perf_counter() - t0:.1f} s; warming up")
    # Compiles the flex call outside the timings: batch 1 (specialised), 2 (static), 3 (the dynamic-shape recompile).
    for c in (1, 2, 3):
        time_nitsum(engine, _prompts(c, prompt_len, seed=99 + c), 4, device)
        time_hf(hf, _prompts(c, prompt_len, seed=99 + c), 4, device)
    log(f"warm after {time.perf_counter() - t0:.1f} s")
    rows = []
    for c in concurrencies:
        best = {"nitsum": float("inf"), "hf": float("inf")}
        same = 0
        for attempt in range(repeat):
            prompts = _prompts(c, prompt_len, seed=1000 * attempt + c)
            t_ours, ours = time_nitsum(engine, prompts, max_tokens, device)
            t_hf, theirs = time_hf(hf, prompts, max_tokens, device)
            best["nitsum"], best["hf"] = min(best["nitsum"], t_ours), min(best["hf"], t_hf)
            assert all(len(t) == max_tokens for t in ours + theirs), "a stream came back short"
            same += sum(a == b for a, b in zip(ours, theirs))
        engine.check_integrity()
        total = c * max_tokens
        row = {
            "concurrency": c,
            "nitsum_tok_s": total / best["nitsum"],
            "hf_batched_tok_s": total / best["hf"],
            "same_streams": same,
            "num_streams": c * repeat,
        }
        row["ratio"] = row["nitsum_tok_s"] / row["hf_batched_tok_s"]
        rows.append(row)
        if save is not None:
            save(info, rows)
        log(
            f"c={c}: nitsum {row['nitsum_tok_s']:.0f} tok/s, transformers {row['hf_batched_tok_s']:.0f} tok/s, "
            f"{row['ratio']:.2f}x, greedy streams equal {same}/{c * repeat}"
        )
    return info, rows


def _kv_mb(model_dir: Path, dtype: str, tokens: int) -> int:
    """KV cache MB for `tokens` tokens at once, with a quarter spare (blocks round up per sequence)."""
    from nitsum.model.loader import load_config

    cfg = load_config(model_dir)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (4 if dtype == "float32" else 2)
    return max(16, int(tokens * per_token * 1.25) >> 20)


def format_table(info: dict, rows: list[dict]) -> str:
    lines = [
        f"{info['model']}, {info['dtype']}, prompt {info['prompt_len']} + {info['max_tokens']} new tokens per "
        f"request, decode attention {info['decode_attention']}, best of {info['repeat']}; "
        + ", ".join(f"{k} {info[k]}" for k in ("gpu", "driver", "cuda", "cpu", "torch", "transformers") if k in info),
        "",
        "| concurrency | nitsum tok/s | transformers generate (batched) tok/s | ratio | greedy streams equal |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['nitsum_tok_s']:.0f} | {r['hf_batched_tok_s']:.0f} | {r['ratio']:.2f}x | "
            f"{r['same_streams']}/{r['num_streams']} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nitsum bench engine --device", description=__doc__.split("\n")[0])
    parser.add_argument("--device", required=True, help="cuda, cuda:N, or cpu (the dry run)")
    parser.add_argument(
        "--size", choices=tuple(SIZES), default=None, help="1b (default on cuda) or tiny (default on cpu)"
    )
    parser.add_argument("--concurrency", default="1,8,32,128", help="comma-separated concurrencies")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--decode-attention",
        choices=("auto", "flex", "gather"),
        default="auto",
        help="nitsum's decode attention (default auto: flex on cuda, gather on cpu)",
    )
    parser.add_argument("--out", default=None, help="directory for bench_engine_<device>.json and .md")
    args = parser.parse_args(argv)
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if min(concurrencies) < 1 or args.prompt_len < 1 or args.max_tokens < 1 or args.repeat < 1:
        parser.error("--concurrency, --prompt-len, --max-tokens and --repeat must be >= 1")
    size = args.size or ("tiny" if args.device == "cpu" else "1b")

    def save(info: dict, rows: list[dict]) -> None:
        if not args.out:
            return
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = args.device.split(":")[0]
        (out / f"bench_engine_{tag}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
        command = "nitsum bench engine " + " ".join(argv)
        (out / f"bench_engine_{tag}.md").write_text(f"`{command}`\n\n{format_table(info, rows)}\n")

    with tempfile.TemporaryDirectory(prefix="nitsum-bench-device-") as tmp:
        info, rows = run(
            args.device,
            size,
            concurrencies,
            args.prompt_len,
            args.max_tokens,
            args.repeat,
            Path(tmp),
            log=lambda msg: print(f"bench engine --device {args.device}: {msg}", flush=True),
            decode_attention=args.decode_attention,
            save=save,
        )
    print("\n" + format_table(info, rows))
    return 0
