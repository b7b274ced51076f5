"""Cost model (ALGORITHMS.md §3): how long one engine step takes, shared by the policy and the simulator.

step_time = max(compute, memory) + all-reduce + overheads, per device of a TP=k group:
- compute  = FLOPs / k / (peak FLOP/s · compute efficiency); FLOPs = 2 · active params · tokens in the step
  + attention 4 · layers · (heads · head_dim) · (query, key) pairs.
- memory   = (weight bytes / k + KV bytes read / min(k, kv_heads)) / (HBM bandwidth · memory efficiency).
  KV heads are split across ranks until TP exceeds the KV-head count, then replicated — so KV reads stop
  shrinking past TP = kv_heads.
- all-reduce: two per layer (attention output, MLP down), message = tokens · hidden · activation bytes; ring
  cost 2(k−1)/k · message / (link bandwidth · link efficiency) + a fixed latency per collective; 0 at TP1.
- overheads: fixed per step (scheduling, sampling, kernel launches), + per sequence in the step, + once for a
  step that computes prompt tokens (the last two fitted on CPU by `nitsum bench profile`, 0 for the GPUs).

Device tables: H100 SXM, H200 SXM and A100 80 GB SXM from NVIDIA's public data sheets (dense BF16 peak,
HBM bandwidth, NVLink bandwidth per direction); efficiencies and per-step overheads are our assumptions,
named as such. The CPU table comes from `nitsum bench profile` as JSON (format: `DeviceSpec.to_json`);
a default with placeholder figures ships in nitsum/data/costmodel/cpu.json until the profile is run.

Approximation stated once: attention (query, key) pairs are taken as num_tokens · context_tokens /
batch_size (exact for decode; for a prefill of n tokens it counts n² instead of n²/2).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path

from nitsum.policy.steptable import DeviceStepTable

DEVICE_TABLE_SCHEMA = "nitsum.costmodel.device/1"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_elem: float = 2.0
    num_experts: int = 1  # MoE: experts per layer (1 = dense)
    experts_per_token: int = 1

    @classmethod
    def from_hf_config(cls, name: str, hf: dict, bytes_per_param: float = 2.0) -> ModelSpec:
        """The cost model's view of a Hugging Face config.json (KeyError naming a missing field)."""
        return cls(
            name=name,
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=int(hf["hidden_size"]),
            num_heads=int(hf["num_attention_heads"]),
            num_kv_heads=int(hf.get("num_key_value_heads", hf["num_attention_heads"])),
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            bytes_per_param=bytes_per_param,
            kv_bytes_per_elem=bytes_per_param,
        )

    @cached_property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @cached_property
    def attn_params_per_layer(self) -> int:
        q_o = 2 * self.hidden_size * self.hidden_size
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_o + k_v

    @cached_property
    def mlp_params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    @cached_property
    def total_params(self) -> int:
        per_layer = self.attn_params_per_layer + self.num_experts * self.mlp_params_per_expert
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size

    @cached_property
    def active_params(self) -> int:
        """Parameters touched per token (MoE: only the routed experts)."""
        per_layer = self.attn_params_per_layer + self.experts_per_token * self.mlp_params_per_expert
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size  # LM head; embedding is a gather

    @cached_property
    def weight_bytes(self) -> float:
        return self.total_params * self.bytes_per_param

    @cached_property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem


# Shapes from the models' published configs (Hugging Face config.json of each).
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    "mixtral-8x22b": ModelSpec("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, num_experts=8, experts_per_token=2),
    # nitsum's deterministic tiny Llama (fp32 on CPU); a test keeps it in step with nitsum/model/tiny.py.
    "tiny": ModelSpec("tiny", 4, 128, 8, 4, 256, 320, bytes_per_param=4.0, kv_bytes_per_elem=4.0),
}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}") from None


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense, in the serving dtype, FLOP/s
    mem_bandwidth_bytes_per_s: float
    link_bandwidth_bytes_per_s: float  # per direction, per device (NVLink / shared memory)
    memory_bytes: float
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    link_efficiency: float = 0.7
    collective_latency_ms: float = 0.008  # fixed cost of one all-reduce
    step_overhead_ms: float = 1.0
    # Host-side costs that grow with the step's shape, not its FLOPs or bytes (fitted by `nitsum bench profile`
    # for the CPU table; 0 in the GPU presets): per sequence in the step (Python scheduling, sampling and
    # detokenising of each sequence), and once per step that computes prompt tokens (num_tokens > batch_size:
    # the prefill path builds its attention metadata and copies its KV in more kernels than a decode step).
    seq_overhead_ms: float = 0.0
    prefill_step_overhead_ms: float = 0.0
    memory_reserved_fraction: float = 0.1  # activations, allocator slack: not for weights or KV
    source: str = ""
    placeholder: bool = False  # True: figures are guesses awaiting a profile

    def to_json(self) -> str:
        return json.dumps({"schema": DEVICE_TABLE_SCHEMA, **asdict(self)}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DeviceSpec:
        data = json.loads(text)
        schema = data.pop("schema", None)
        if schema != DEVICE_TABLE_SCHEMA:
            raise ValueError(f"device table schema {schema!r}, expected {DEVICE_TABLE_SCHEMA!r}")
        data.pop("measurements", None)  # raw profile points kept in the file for reference only
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown device table fields: {', '.join(unknown)}")
        return cls(**data)


_TB = 1e12
_GB = 1e9
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # NVIDIA H100 Tensor Core GPU data sheet (SXM5): 989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB,
    # NVLink 4 900 GB/s bidirectional (450 GB/s per direction).
    "h100": DeviceSpec("h100", 989e12, 3.35 * _TB, 450 * _GB, 80 * _GB, source="NVIDIA H100 data sheet (SXM5)"),
    # NVIDIA H200 Tensor Core GPU data sheet (SXM): same compute as H100, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s.
    "h200": DeviceSpec("h200", 989e12, 4.8 * _TB, 450 * _GB, 141 * _GB, source="NVIDIA H200 data sheet (SXM)"),
    # NVIDIA A100 Tensor Core GPU data sheet (80 GB SXM): 312 TFLOPS dense BF16, 2.039 TB/s HBM2e,
    # NVLink 3 600 GB/s bidirectional (300 GB/s per direction).
    "a100": DeviceSpec("a100", 312e12, 2.039 * _TB, 300 * _GB, 80 * _GB, source="NVIDIA A100 data sheet (80GB SXM)"),
}


def load_device_table(path: str | Path | None = None) -> DeviceSpec:
    """A device table from JSON; with no path, the shipped CPU table (nitsum/data/costmodel/cpu.json)."""
    if path is None:
        text = resources.files("nitsum").joinpath("data/costmodel/cpu.json").read_text()
    else:
        text = Path(path).read_text()
    return DeviceSpec.from_json(text)


@lru_cache(maxsize=1)
def _default_cpu() -> DeviceSpec:
    return load_device_table(None)


def device_spec(kind: str) -> DeviceSpec:
    """Device table by kind: 'h100' | 'h200' | 'a100' | 'cpu' (the shipped CPU table)."""
    if kind == "cpu":
        return _default_cpu()
    try:
        return DEVICE_PRESETS[kind]
    except KeyError:
        raise ValueError(
            f"unknown device kind {kind!r}; known: cpu, {', '.join(sorted(DEVICE_PRESETS))}, or a path "
            f"to a device table JSON (nitsum bench profile --out)"
        ) from None


def resolve_device(kind: str | Path | DeviceSpec | CostModel) -> DeviceSpec:
    """A device table from what a config may name: a preset kind ('cpu' | 'h100' | 'h200' | 'a100'), a path to
    a device table JSON (what `nitsum bench profile --out` writes), a loaded `DeviceSpec`, or a `CostModel`
    (its device). Anything else is a ValueError that says what is accepted."""
    if isinstance(kind, DeviceSpec):
        return kind
    if isinstance(kind, CostModel):
        return kind.device
    if isinstance(kind, Path) or (isinstance(kind, str) and kind.endswith(".json")):
        path = Path(kind)
        if not path.is_file():
            raise ValueError(f"device table {str(path)!r}: no such file")
        return load_device_table(path)
    if isinstance(kind, str):
        return device_spec(kind)
    raise ValueError(
        f"device kind must be a preset name, a table path, a DeviceSpec or a CostModel, not {type(kind).__name__}"
    )


@dataclass(frozen=True)
class CostModel:
    """Pure step-time estimates. Methods are memoized per instance (the policy asks the same questions often)."""

    model: ModelSpec
    device: DeviceSpec
    reconfig_fixed_ms: float = 5.0  # switch cost beyond moving KV: views, communicator swap, barrier
    # A measured step-time table (steptable.py, `--device-table FILE`): when set, step_time_ms is the table's
    # (exact at measured points, interpolated between, the roofline fitted to it outside); memory, KV
    # capacity and link figures still come from `device`.
    steps: DeviceStepTable | None = None
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    # -- roofline -----------------------------------------------------------------------------------------
    def memory_floor_ms(self, tp: int, context_tokens: int = 0) -> float:
        """Time to read this rank's weights (+KV) once at full HBM bandwidth: the hard floor of a step."""
        return self._bytes_per_rank(tp, context_tokens) / self.device.mem_bandwidth_bytes_per_s * 1e3

    def _bytes_per_rank(self, tp: int, context_tokens: float) -> float:
        m = self.model
        kv_split = min(tp, m.num_kv_heads)
        return m.weight_bytes / tp + context_tokens * m.kv_bytes_per_token / kv_split

    def step_time_ms(self, tp: int, batch_size: int, num_tokens: int, context_tokens: int) -> float:
        """One forward step of a TP=tp group over `num_tokens` new tokens of `batch_size` sequences that
        attend to `context_tokens` cached + new tokens in total."""
        key = (tp, batch_size, num_tokens, context_tokens)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if self.steps is not None:
            out = self.steps.step_ms(tp, batch_size, num_tokens, context_tokens)
            if len(self._memo) < 65536:
                self._memo[key] = out
            return out
        m, d = self.model, self.device
        batch = max(batch_size, 1)
        pairs = num_tokens * context_tokens / batch
        flops = 2.0 * m.active_params * num_tokens + 4.0 * m.num_layers * m.hidden_size * pairs
        compute_ms = flops / tp / (d.peak_flops * d.compute_efficiency) * 1e3
        memory_ms = self._bytes_per_rank(tp, context_tokens) / (d.mem_bandwidth_bytes_per_s * d.memory_efficiency) * 1e3
        comm_ms = 0.0
        if tp > 1:
            msg_bytes = num_tokens * m.hidden_size * m.kv_bytes_per_elem
            ring_ms = 2.0 * (tp - 1) / tp * msg_bytes / (d.link_bandwidth_bytes_per_s * d.link_efficiency) * 1e3
            comm_ms = 2 * m.num_layers * (ring_ms + d.collective_latency_ms)
        out = max(compute_ms, memory_ms) + comm_ms + d.step_overhead_ms + d.seq_overhead_ms * batch
        if num_tokens > batch_size:
            out += d.prefill_step_overhead_ms
        if len(self._memo) < 65536:
            self._memo[key] = out
        return out

    def decode_step_ms(self, tp: int, batch_size: int, context_tokens: int) -> float:
        """One decode step: one new token per sequence; `context_tokens` summed over the batch."""
        return self.step_time_ms(tp, batch_size, batch_size, context_tokens)

    def prefill_time_ms(self, tp: int, prompt_tokens: int, cached_tokens: int = 0, chunk_tokens: int = 0) -> float:
        """Prefill of one prompt (cached prefix skipped); in chunks of `chunk_tokens` when > 0."""
        new = max(prompt_tokens - cached_tokens, 0)
        if new == 0:
            return 0.0
        if chunk_tokens <= 0 or chunk_tokens >= new:
            return self.step_time_ms(tp, 1, new, prompt_tokens)
        total = 0.0
        done = cached_tokens
        while done < prompt_tokens:
            n = min(chunk_tokens, prompt_tokens - done)
            total += self.step_time_ms(tp, 1, n, done + n)
            done += n
        return total

    # -- capacity -----------------------------------------------------------------------------------------
    def kv_capacity_tokens(self, tp: int) -> int:
        """KV tokens a TP=tp group can hold after weights; 0 when the weights do not fit."""
        key = ("kvcap", tp)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        m, d = self.model, self.device
        usable = d.memory_bytes * (1.0 - d.memory_reserved_fraction) - m.weight_bytes / tp
        per_token_per_rank = m.kv_bytes_per_token / min(tp, m.num_kv_heads)
        out = int(usable / per_token_per_rank) if usable > 0 else 0
        self._memo[key] = out
        return out

    def fits(self, tp: int) -> bool:
        return self.kv_capacity_tokens(tp) > 0

    def max_decode_batch(
        self, tp: int, tpot_ms: float, context_per_seq: int, extra_tokens: int = 0, limit: int = 4096
    ) -> int:
        """Largest batch whose decode step (plus `extra_tokens` of chunked prefill) stays within tpot_ms and
        whose KV fits; 0 when even one sequence misses."""
        key = ("maxb", tp, round(tpot_ms, 3), context_per_seq, extra_tokens, limit)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        cap = min(limit, self.kv_capacity_tokens(tp) // max(context_per_seq, 1))

        def ok(b: int) -> bool:
            return self.step_time_ms(tp, b, b + extra_tokens, b * context_per_seq + extra_tokens) <= tpot_ms

        if cap <= 0 or not ok(1):
            out = 0
        else:
            lo, hi = 1, cap  # invariant: ok(lo)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if ok(mid):
                    lo = mid
                else:
                    hi = mid - 1
            out = lo
        self._memo[key] = out
        return out

    # -- reconfiguration ----------------------------------------------------------------------------------
    def reconfig_cost_ms(self, kv_bytes: float, num_devices_moving: int = 2) -> float:
        """A TP change: fixed switch cost + KV bytes over the links, all pairs moving at once (§1.3)."""
        pairs = max(num_devices_moving // 2, 1)
        link = self.device.link_bandwidth_bytes_per_s * self.device.link_efficiency * pairs
        return self.reconfig_fixed_ms + kv_bytes / link * 1e3


def cost_model(model: str | ModelSpec, device: str | DeviceSpec) -> CostModel:
    m = model_spec(model) if isinstance(model, str) else model
    d = device_spec(device) if isinstance(device, str) else device
    return CostModel(m, d)


__all__ = [
    "DEVICE_PRESETS",
    "DEVICE_TABLE_SCHEMA",
    "MODEL_PRESETS",
    "CostModel",
    "DeviceSpec",
    "ModelSpec",
    "cost_model",
    "device_spec",
    "load_device_table",
    "model_spec",
    "resolve_device",
]
