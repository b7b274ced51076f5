"""A step table from Vidur's public GPU profiles (`nitsum bench profile --from-vidur`).

Vidur (microsoft/vidur, MIT) publishes operator timings measured on real GPUs: per transformer layer, the
time of each linear and elementwise operator of a model at every tensor-parallel degree and token count
(`data/profiling/compute/<gpu>/<model>/mlp.csv`), and NCCL all-reduce times by message size and group size
(`data/profiling/network/<gpu>_dgx/all_reduce.csv`). This module turns them into nitsum's step table
(`nitsum.policy.steptable`), so the simulator and the policy can be priced from measured GPU numbers
rather than from a data-sheet roofline. It reads Vidur's column names, so the original files and the
committed excerpt (`nitsum/data/costmodel/vidur/`) are read alike.

One step of a TP=k group over n new tokens (n = batch for decode, batch x prompt for prefill), in ms:

    layers x ( sum of the measured per-layer operators at (k, n)
               + 2 measured all-reduces of n x hidden x 2 bytes among k GPUs   [k > 1]
               + attention )
    + the measured embedding at (k, n) + LM head + the device's fixed step overhead

Measured: every operator Vidur times per layer (input and post-attention norms, QKV projection, rotary,
output projection, MLP up/gate, activation, down projection, residual add), the embedding, the all-reduces.
Not measured (Vidur's attention-kernel tables are not in its repository as text), so taken from the cost
model's roofline for the device (`nitsum.policy.costmodel`, data-sheet peak and efficiencies): the attention
kernel (max of its FLOPs, 4 x hidden x (query, key) pairs / k with causal pairs for a prefill, and its KV
bytes read / min(k, kv heads)), the LM head (max of 2 x vocab x hidden x batch FLOPs / k and its weight bytes
/ k: logits of the last token per sequence), and the fixed per-step overhead (`DeviceSpec.step_overhead_ms`).
Operator times are linear in the token count between Vidur's measured counts; a point outside them
is not written (the step table prices it by its fitted roofline). Where the profile has the same point twice,
the mean of the repeats' medians is used.

The shapes the profile was measured at (n_embd, n_head, n_kv_head, n_expanded_embd) must be the model's;
a profile of another shape is refused, naming the line. Vidur's Llama-2-70B profile has exactly
Llama-3-70B's layer shapes (hidden 8192, 64 heads, 8 KV heads, FFN 28672; only the vocabulary differs, and
the LM head is priced at the model's own vocabulary), so it prices `llama-3-70b`.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
from collections import defaultdict
from pathlib import Path

from nitsum.policy.costmodel import DeviceSpec, ModelSpec
from nitsum.policy.steptable import StepRow

LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
SHAPE_COLUMNS = ("n_embd", "n_head", "n_kv_head", "n_expanded_embd")
TP_COLUMN = "num_tensor_parallel_workers"
ACT_BYTES = 2  # bf16/fp16 activations, as Vidur measures

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
PREFILL_BATCHES = (1, 2, 4, 8)
PREFILL_PROMPTS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


class VidurProfileError(ValueError):
    """A Vidur profile that cannot be read: the message names the file, the line and the column."""


def _csv(text: str, source: str, needed: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in needed if c not in header]
    if missing:
        raise VidurProfileError(f"{source}: line 1 (header): missing column(s) {', '.join(missing)}")
    return [(i, row) for i, row in enumerate(reader, start=2) if any((v or "").strip() for v in row.values())]


def _number(source: str, line: int, col: str, text: str | None) -> float:
    try:
        value = float((text or "").strip())
    except ValueError:
        raise VidurProfileError(f"{source}: line {line}, column {col!r}: {text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise VidurProfileError(f"{source}: line {line}, column {col!r}: {value} must be finite and >= 0")
    return value


def _averaged(points: dict[tuple[int, int], list[float]]) -> dict[int, list[tuple[int, float]]]:
    out: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (tp, x), values in sorted(points.items()):
        out[tp].append((x, sum(values) / len(values)))
    return dict(out)


def read_mlp_profile(text: str, model: ModelSpec, source: str = "mlp.csv") -> tuple[dict, dict]:
    """({tp: [(num_tokens, ms per layer)]}, {tp: [(num_tokens, embedding ms)]}) from Vidur's mlp.csv; the
    profile's shapes must be the model's (VidurProfileError naming the line otherwise)."""
    ops = tuple(f"time_stats.{op}.median" for op in LAYER_OPS)
    emb = "time_stats.emb.median"
    rows = _csv(text, source, ops + (emb, "num_tokens", TP_COLUMN) + SHAPE_COLUMNS)
    if not rows:
        raise VidurProfileError(f"{source}: no rows after the header")
    want = {
        "n_embd": model.hidden_size,
        "n_head": model.num_heads,
        "n_kv_head": model.num_kv_heads,
        "n_expanded_embd": model.intermediate_size,
    }
    layer: dict[tuple[int, int], list[float]] = defaultdict(list)
    embed: dict[tuple[int, int], list[float]] = defaultdict(list)
    for line, row in rows:
        for col, value in want.items():
            got = _number(source, line, col, row[col])
            if got != value:
                raise VidurProfileError(
                    f"{source}: line {line}, column {col!r}: profiled at {got:g}, model {model.name} has {value}"
                )
        tp = int(_number(source, line, TP_COLUMN, row[TP_COLUMN]))
        n = int(_number(source, line, "num_tokens", row["num_tokens"]))
        if tp < 1 or tp & (tp - 1) or n < 1:
            raise VidurProfileError(
                f"{source}: line {line}: tp {tp} must be a power of two >= 1 and num_tokens {n} >= 1"
            )
        layer[(tp, n)].append(sum(_number(source, line, c, row[c]) for c in ops))
        embed[(tp, n)].append(_number(source, line, emb, row[emb]))
    return _averaged(layer), _averaged(embed)


def read_all_reduce_profile(text: str, source: str = "all_reduce.csv") -> dict[int, list[tuple[int, float]]]:
    """{group size: [(message bytes, ms)]} from Vidur's all_reduce.csv (rank 0's rows, one GPU per rank on one
    node: `devices_per_node` = `num_workers`)."""
    med = "time_stats.all_reduce.median"
    rows = _csv(text, source, (med, "num_workers", "size", "devices_per_node", "rank"))
    points: dict[tuple[int, int], list[float]] = defaultdict(list)
    for line, row in rows:
        if row.get("collective", "all_reduce") != "all_reduce" or row["rank"].strip() != "0":
            continue
        workers = int(_number(source, line, "num_workers", row["num_workers"]))
        if int(_number(source, line, "devices_per_node", row["devices_per_node"])) != workers:
            continue  # a group spread over several nodes: not a node's TP group
        points[(workers, int(_number(source, line, "size", row["size"])))].append(_number(source, line, med, row[med]))
    if not points:
        raise VidurProfileError(f"{source}: no rank-0 all-reduce rows within one node")
    return _averaged(points)


def interpolate(points: list[tuple[int, float]], x: float) -> float | None:
    """Linear between measured points; None outside them (nothing is extrapolated here)."""
    xs = [p[0] for p in points]
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return points[i][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def attention_ms(model: ModelSpec, device: DeviceSpec, tp: int, phase: str, batch: int, tokens: int) -> float:
    """The attention kernel of all layers from the roofline (not in Vidur's text profiles)."""
    if phase == "decode":
        pairs = batch * tokens  # one query per sequence against its context
        kv_tokens = batch * tokens
    else:
        pairs = batch * tokens * (tokens + 1) / 2  # causal
        kv_tokens = batch * tokens  # written, then read by the kernel
    flops = 4.0 * model.num_layers * model.hidden_size * pairs / tp
    nbytes = kv_tokens * model.kv_bytes_per_token / min(tp, model.num_kv_heads)
    return (
        max(
            flops / (device.peak_flops * device.compute_efficiency),
            nbytes / (device.mem_bandwidth_bytes_per_s * device.memory_efficiency),
        )
        * 1e3
    )


def lm_head_ms(model: ModelSpec, device: DeviceSpec, tp: int, batch: int) -> float:
    """Logits of each sequence's last token from the roofline (Vidur's profile stops at the last layer)."""
    flops = 2.0 * model.vocab_size * model.hidden_size * batch / tp
    nbytes = model.vocab_size * model.hidden_size * model.bytes_per_param / tp
    return (
        max(
            flops / (device.peak_flops * device.compute_efficiency),
            nbytes / (device.mem_bandwidth_bytes_per_s * device.memory_efficiency),
        )
        * 1e3
    )


def step_ms(
    layer: dict,
    embed: dict,
    all_reduce: dict,
    model: ModelSpec,
    device: DeviceSpec,
    tp: int,
    phase: str,
    batch: int,
    tokens: int,
) -> float | None:
    """One step's time (module docstring); None when a measured part is outside the profile."""
    n = batch if phase == "decode" else batch * tokens
    per_layer = interpolate(layer.get(tp, []), n)
    emb = interpolate(embed.get(tp, []), n)
    if per_layer is None or emb is None:
        return None
    comm = 0.0
    if tp > 1:
        one = interpolate(all_reduce.get(tp, []), n * model.hidden_size * ACT_BYTES)
        if one is None:
            return None
        comm = 2.0 * one
    attn = attention_ms(model, device, tp, phase, batch, tokens)
    return (
        model.num_layers * (per_layer + comm)
        + attn
        + emb
        + lm_head_ms(model, device, tp, batch)
        + device.step_overhead_ms
    )


def vidur_rows(
    mlp_text: str,
    all_reduce_text: str,
    model: ModelSpec,
    device: DeviceSpec,
    device_name: str,
    mlp_source: str = "mlp.csv",
    all_reduce_source: str = "all_reduce.csv",
) -> list[StepRow]:
    """The step table's rows: every grid point whose measured parts lie inside the profile, at each TP level
    both files have (TP1 needs no all-reduce)."""
    layer, embed = read_mlp_profile(mlp_text, model, mlp_source)
    reduce = read_all_reduce_profile(all_reduce_text, all_reduce_source)
    levels = [tp for tp in sorted(layer) if tp == 1 or tp in reduce]
    rows: list[StepRow] = []
    for tp in levels:
        for b in PREFILL_BATCHES:
            for p in PREFILL_PROMPTS:
                ms = step_ms(layer, embed, reduce, model, device, tp, "prefill", b, p)
                if ms is not None:
                    rows.append(StepRow(device_name, model.name, tp, "prefill", b, p, p, round(ms, 4)))
        for b in DECODE_BATCHES:
            for c in DECODE_CONTEXTS:
                ms = step_ms(layer, embed, reduce, model, device, tp, "decode", b, c)
                if ms is not None:
                    rows.append(StepRow(device_name, model.name, tp, "decode", b, 0, c, round(ms, 4)))
    if not rows:
        raise VidurProfileError(f"{mlp_source}: no grid point lies inside the profile")
    return rows


def model_of_dir(model_dir: Path) -> ModelSpec:
    """The cost model's view of a checkpoint directory in bf16, named by the directory as the coordinator names
    the served model (so `NITSUM_DEVICE_TABLE` finds the rows); VidurProfileError naming a missing field."""
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text())
        # named as modelpath.resolve_model_dir names it
        return ModelSpec.from_hf_config(Path(model_dir).expanduser().name, hf)
    except (OSError, ValueError) as exc:
        raise VidurProfileError(f"{path}: {exc}") from None
    except KeyError as exc:
        raise VidurProfileError(f"{path}: no field {exc.args[0]!r}") from None


def read_text(path: Path) -> str:
    if not path.is_file():
        raise VidurProfileError(f"{path}: no such file")
    return path.read_text(encoding="utf-8-sig")


__all__ = [
    "VidurProfileError",
    "attention_ms",
    "interpolate",
    "lm_head_ms",
    "model_of_dir",
    "read_all_reduce_profile",
    "read_mlp_profile",
    "read_text",
    "step_ms",
    "vidur_rows",
]
