"""`nitsum bench engine --workload trace`: closed-loop serving of requests whose lengths come from a real trace.

What "concurrency c" means for a server: c requests in flight, each with its own prompt and output length,
and a new one starts as soon as one finishes. Prompt and output lengths are drawn (seeded, with
replacement, each row's pair kept together) from a committed Azure LLM inference 2023 excerpt and scaled
down by one factor to fit the small models' context; prompt tokens are random bytes. Every request runs
greedy to exactly its own output length (EOS ignored), so every runner produces the same number of tokens.

Runners, on the same weights and thread count:
- nitsum: closed loop at concurrency c (a finished request's slot is refilled before the next step);
- hf-batched: successive `generate` calls on batches of c requests in the same order (static batching: left
  padding to the batch's longest prompt; the batch runs until its longest output, and each request's output
  is then trimmed to its own length: only the requested tokens count);
- hf-serial: one `generate` per request, one after another (no batching, no padding).
The figure is output tokens/s: the sum of the requests' output lengths over the wall time of the run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from nitsum.bench.engine import Stopwatch, keep_best, rates, ratio_cells
from nitsum.engine.engine import Engine
from nitsum.engine.params import SamplingParams
from nitsum.workloads import default_trace_path, read_azure

TRACES = ("azure-conv", "azure-code")
PAD_TOKEN_ID = 0  # masked out by the attention mask; any id would do


@dataclass(frozen=True)
class TraceItem:
    prompt: list[int]
    max_tokens: int


def trace_lengths(trace: str, num_requests: int, scale: float, max_context: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths of `num_requests` rows drawn from the committed excerpt of `trace`, each
    length times `scale` (at least 1), the pair fitted into `max_context` tokens (output first)."""
    if trace not in TRACES:
        raise ValueError(f"unknown trace {trace!r}: choose one of {', '.join(TRACES)}")
    if not 0 < scale <= 1:
        raise ValueError(f"length scale must be in (0, 1], got {scale}")
    rows = read_azure(default_trace_path(trace, prefer_excerpt=True))
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        row = rng.choice(rows)
        output = min(max(1, round(row.output_tokens * scale)), max_context - 1)
        prompt = min(max(1, round(row.prompt_tokens * scale)), max_context - output)
        out.append((prompt, output))
    return out


def trace_workload(lengths: list[tuple[int, int]], seed: int, vocab_limit: int = 256) -> list[TraceItem]:
    gen = torch.Generator().manual_seed(seed)
    return [TraceItem(torch.randint(0, vocab_limit, (p,), generator=gen).tolist(), o) for p, o in lengths]


def run_nitsum(
    engine: Engine, items: list[TraceItem], concurrency: int, tag: str
) -> tuple[tuple[float, float], list[list[int]]]:
    """Closed loop: `concurrency` requests in flight; each finished one is replaced by the next. Returns
    ((wall s, CPU s), each request's output tokens)."""
    outputs: list[list[int]] = [[] for _ in items]
    index_of: dict[str, int] = {}

    def submit(i: int) -> None:
        rid = f"{tag}-{i}"
        index_of[rid] = i
        engine.add_request(rid, items[i].prompt, SamplingParams(max_tokens=items[i].max_tokens, ignore_eos=True))

    watch = Stopwatch()
    submitted = min(concurrency, len(items))
    for i in range(submitted):
        submit(i)
    done = 0
    while done < len(items):
        step_outputs = engine.step()
        assert step_outputs or engine.has_unfinished(), "engine stalled with requests pending"
        for out in step_outputs:
            i = index_of[out.request_id]
            outputs[i].extend(out.new_token_ids)
            if out.finished:
                done += 1
                if submitted < len(items):
                    submit(submitted)
                    submitted += 1
    return watch.stop(), outputs


@torch.inference_mode()
def run_hf(
    model, items: list[TraceItem], concurrency: int, batched: bool
) -> tuple[tuple[float, float], list[list[int]], int]:
    """Static batches of `concurrency` (or one request at a time). Returns ((wall s, CPU s), each request's output
    trimmed to its length, token positions the batches computed: prompts padded plus generated)."""
    groups = (
        [items[i : i + concurrency] for i in range(0, len(items), concurrency)] if batched else [[x] for x in items]
    )
    outputs: list[list[int]] = []
    computed = 0
    watch = Stopwatch()
    for group in groups:
        width = max(len(x.prompt) for x in group)
        new_tokens = max(x.max_tokens for x in group)
        ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(x.prompt)) + x.prompt for x in group])
        mask = torch.tensor([[0] * (width - len(x.prompt)) + [1] * len(x.prompt) for x in group])
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
        )
        generated = out[:, width:].tolist()
        outputs.extend(row[: x.max_tokens] for row, x in zip(generated, group))
        computed += len(group) * (width + new_tokens)
    return watch.stop(), outputs, computed


def bench_trace_model(
    name: str,
    engine: Engine,
    hf,
    concurrencies: list[int],
    trace: str,
    scale: float,
    requests_per_slot: int,
    serial_limit: int,
    repeat: int,
    seed: int,
) -> list[dict]:
    """Each concurrency c serves `requests_per_slot * c` requests (at least 8), `repeat` times (same lengths,
    fresh prompts), the three runners interleaved; the best wall and CPU time of each is kept."""
    rows = []
    for c in concurrencies:
        n = max(8, requests_per_slot * c)
        best: dict[str, tuple[float, float]] = {}
        same = {"batched": 0, "serial": 0}
        run_serial = 1 < c <= serial_limit  # at c = 1 a batch is one request: hf-serial is hf-batched
        # One draw of lengths per concurrency (so every attempt produces the same tokens and best-of
        # compares like with like); fresh prompt tokens per attempt (no prefix-cache hits across them).
        lengths = trace_lengths(trace, n, scale, engine.max_model_len, seed + c)
        tokens = sum(o for _, o in lengths)
        prompt_tokens = sum(p for p, _ in lengths)
        useful = prompt_tokens + tokens
        computed = 0
        for attempt in range(repeat):
            items = trace_workload(lengths, seed + 1000 * attempt + c)
            t_ours, ours = run_nitsum(engine, items, c, tag=f"trace-{name}-{c}-{attempt}")
            t_hf_b, hf_tokens, computed = run_hf(hf, items, c, batched=True)
            keep_best(best, "nitsum", t_ours)
            keep_best(best, "hf_batched", t_hf_b)
            assert all(len(a) == x.max_tokens for a, x in zip(ours, items)), "nitsum produced the wrong length"
            same["batched"] += sum(a == b for a, b in zip(ours, hf_tokens))
            if run_serial:
                t_hf_s, serial_tokens, _ = run_hf(hf, items, c, batched=False)
                keep_best(best, "hf_serial", t_hf_s)
                same["serial"] += sum(a == b for a, b in zip(ours, serial_tokens))
        row = {
            "model": name,
            "concurrency": c,
            "requests": n,
            "mean_prompt": prompt_tokens / n,
            "mean_output": tokens / n,
            "same_as_batched": same["batched"],
            "num_outputs": n * repeat,
            "hf_batched_waste": computed / useful,
            **rates(best, tokens),
        }
        if run_serial:
            row["same_as_serial"] = same["serial"]
        rows.append(row)
        engine.check_integrity()
    return rows


def format_trace_table(rows: list[dict]) -> str:
    head = (
        "| model | concurrency | requests (mean prompt / output) | nitsum tok/s | hf-batched tok/s "
        "| ratio (CPU time) | hf-serial tok/s | ratio (CPU time) | hf-batched positions / useful "
        "| greedy outputs equal (vs batched / serial) |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        vs_batched, serial, vs_serial = ratio_cells(r)
        lines.append(
            f"| {r['model']} | {r['concurrency']} | {r['requests']} ({r['mean_prompt']:.0f} / {r['mean_output']:.0f}) | "
            f"{r['nitsum_tok_s']:.0f} | {r['hf_batched_tok_s']:.0f} | {vs_batched} | "
            f"{serial} | {vs_serial} | {r['hf_batched_waste']:.2f} | "
            f"{r['same_as_batched']}/{r['num_outputs']} / {r.get('same_as_serial', '-')} |"
        )
    return "\n".join(lines)
