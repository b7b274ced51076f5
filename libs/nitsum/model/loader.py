"""Load a Hugging Face model directory: config.json -> `ModelConfig`, *.safetensors -> weights.

Each tensor is read from disk once (`bytes_read` counts it) into a full-size tensor; tensor-parallel
shards are then cut from it as *views* (`shard_weights`), so a later TP change can re-cut without reading
anything again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Bytes read from checkpoint files by this process (all loads together).
bytes_read = 0


class ModelLoadError(ValueError):
    """The model directory cannot be served: the message names the missing file or unsupported feature."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def max_model_len(self) -> int:
        # Sliding-window attention is not implemented: serve only contexts that fit in the window.
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: unsupported hidden_act {act!r} (only silu)")
        num_heads = raw["num_attention_heads"]
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        rope_scaling = raw.get("rope_scaling") or (rope_params if rope_params else None)
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in ("default", "llama3", "linear"):
                raise ModelLoadError(f"{source}: unsupported rope scaling {rope_type!r} (default, linear, llama3)")
            if rope_type == "default":
                rope_scaling = None
        sliding_window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding_window = None
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=sliding_window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
        )

    def check_tp(self, tp_size: int) -> None:
        """Raise if this model cannot be split `tp_size` ways."""
        for name, value in (
            ("num_attention_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ):
            if value % tp_size:
                raise ModelLoadError(f"{name}={value} is not divisible by TP={tp_size}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise ModelLoadError(f"num_key_value_heads={self.num_kv_heads} does not fit TP={tp_size}")


def read_raw_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing model file: {path}")
    return json.loads(path.read_text())


def load_config(model_dir: str | Path) -> ModelConfig:
    return ModelConfig.from_dict(read_raw_config(model_dir), str(Path(model_dir) / "config.json"))


def _weight_files(model_dir: Path) -> dict[str, list[str]]:
    """file name -> tensor names, from the index when there is one."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            by_file.setdefault(file_name, []).append(name)
        for file_name in by_file:
            if not (model_dir / file_name).is_file():
                raise ModelLoadError(f"missing weight file listed in {index_path.name}: {model_dir / file_name}")
        return by_file
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"missing model weights: no *.safetensors in {model_dir}")
    return {f: [] for f in files}


def load_weights(model_dir: str | Path, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, full size, in `dtype` on `device` (each read exactly once)."""
    global bytes_read
    from safetensors import safe_open

    directory = Path(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for file_name, names in _weight_files(directory).items():
        with safe_open(str(directory / file_name), framework="pt", device="cpu") as handle:
            for name in names or list(handle.keys()):
                tensor = handle.get_tensor(name)
                bytes_read += tensor.numel() * tensor.element_size()
                weights[name] = tensor.to(device=device, dtype=dtype)
    return weights


def shard_span(
    name: str, shape: tuple[int, ...], cfg: ModelConfig, rank: int, size: int
) -> tuple[int, int, int] | None:
    """Where this rank's slice of tensor `name` (full shape `shape`) lies: (dim, start, length), or None when
    every rank uses the whole tensor. Positions, not tensors: a device-resident copy that holds only part
    of a weight (`parallel.weights.ResidentWeights`) cuts its views with the same arithmetic."""
    if name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")) or name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        n = shape[0] // size
        return (0, rank * n, n)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        # KV-head rows of this rank; when TP exceeds the KV-head count, heads are replicated.
        if cfg.num_kv_heads >= size:
            n = shape[0] // size
            return (0, rank * n, n)
        head = rank * cfg.num_kv_heads // size
        return (0, head * cfg.head_dim, cfg.head_dim)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        n = shape[1] // size
        return (1, rank * n, n)
    if name.endswith("norm.weight") or name.endswith(("o_proj.bias", "down_proj.bias")):
        return None
    raise ModelLoadError(f"unexpected tensor in checkpoint: {name}")


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's slice of every weight, as views of `weights`, under the model's parameter names."""
    cfg.check_tp(size)
    shards: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if "rotary_emb" in name:
            continue
        span = shard_span(name, tuple(tensor.shape), cfg, rank, size)
        shards[name] = tensor if span is None else tensor.narrow(*span)
    if cfg.tie_word_embeddings or "lm_head.weight" not in shards:
        shards["lm_head.weight"] = shards["model.embed_tokens.weight"]
    return shards


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    return max(1, cfg.num_kv_heads // size)
