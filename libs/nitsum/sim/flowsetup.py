"""The Nuska paper's large-scale setup (§6.3): MoE models with hybrid TP/EP parallelism on 32-GPU instances.

Shapes from each model's published config.json (Hugging Face):
- Mixtral-8x22B: the cost model's preset (56 layers, hidden 6144, 8 experts, top-2).
- DBRX (databricks/dbrx-base): 40 layers, d_model 6144, 48 heads, 8 KV heads, ffn_hidden_size 10752,
  vocab 100352, 16 experts, top-4.
- Qwen3-Coder-480B-A35B: 62 layers, hidden 6144, 96 heads, 8 KV heads, moe_intermediate_size 2560,
  vocab 151936, 160 experts, top-8 ("Qwen3-Coder-like" in the brief: the paper does not give its shape).

Compute per instance (the cost model has no EP): a 32-GPU instance of TP=t, EP=e runs e attention groups of
TP t (data parallel over the batch) whose experts are sharded e ways. `shard_spec` is the model one group holds
(all attention layers, num_experts / e experts), so the cost model's roofline gets the right weight bytes per
GPU (weight_bytes / t), while FLOPs per GPU are those of 1/e of the tokens at TP t (= the instance's FLOPs / 32,
expert load assumed uniform). The TP all-reduce inside a group is the cost model's (NVLink); the all-to-all
between the groups of different servers is network traffic (stage 2), see `FlowClusterSim.a2a_bytes_per_flow`.
Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nitsum.policy.costmodel import MODEL_PRESETS, ModelSpec

MOE_PRESETS: dict[str, ModelSpec] = {
    "mixtral-8x22b": MODEL_PRESETS["mixtral-8x22b"],
    "dbrx": ModelSpec("dbrx", 40, 6144, 48, 8, 10752, 100352, num_experts=16, experts_per_token=4),
    "qwen3-coder": ModelSpec("qwen3-coder", 62, 6144, 96, 8, 2560, 151936, num_experts=160, experts_per_token=8),
}


@dataclass(frozen=True)
class ParallelSetup:
    """One of the paper's configurations: model, TP and EP (TP x EP GPUs per instance)."""

    name: str
    model: str
    tp: int
    ep: int

    @property
    def gpus(self) -> int:
        return self.tp * self.ep


PAPER_SETUPS: dict[str, ParallelSetup] = {
    "mixtral-tp4-ep8": ParallelSetup("mixtral-tp4-ep8", "mixtral-8x22b", 4, 8),
    "dbrx-tp2-ep16": ParallelSetup("dbrx-tp2-ep16", "dbrx", 2, 16),
    "qwen3coder-tp1-ep32": ParallelSetup("qwen3coder-tp1-ep32", "qwen3-coder", 1, 32),
}


def moe_spec(name: str) -> ModelSpec:
    try:
        return MOE_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown MoE model {name!r}; known: {', '.join(sorted(MOE_PRESETS))}") from None


def shard_spec(model: ModelSpec, ep: int) -> ModelSpec:
    """What one EP rank (a TP group) holds: every attention layer, num_experts / ep of the experts."""
    if ep < 1:
        raise ValueError(f"EP must be >= 1, got {ep}")
    if ep > 1 and model.num_experts % ep and ep % model.num_experts:
        raise ValueError(f"{model.name}: {model.num_experts} experts do not divide over EP={ep}")
    return replace(model, name=f"{model.name}/ep{ep}", num_experts=max(model.num_experts // ep, 1))


__all__ = ["MOE_PRESETS", "PAPER_SETUPS", "ParallelSetup", "moe_spec", "shard_spec"]
