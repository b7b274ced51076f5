"""Engine-facing value types: configuration, sampling parameters, per-step outputs, statistics.
Standard library only (the scheduler imports these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nitsum.config import default_dtype

ROLES = ("prefill", "decode", "hybrid")
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # "auto" is accepted too: resolved from the device
FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "auto"  # float32 on cpu, bfloat16 on cuda (`config.default_dtype`); resolved at construction
    block_size: int = 16
    num_kv_blocks: int | None = None  # None -> derived from kv_cache_mb
    kv_cache_mb: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunks + decodes)
    role: str = "hybrid"  # "prefill" | "decode" | "hybrid"
    enable_prefix_caching: bool = True
    seed: int = 0
    decode_attention: str = "auto"  # auto (flex on cuda, gather on cpu) | flex | gather: model/paged_attention.py

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must name a model directory")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", default_dtype(self.device))
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_mb <= 0:
            raise ValueError(f"kv_cache_mb must be positive, got {self.kv_cache_mb}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.decode_attention not in ("auto", "flex", "gather"):
            raise ValueError(f"decode_attention must be auto, flex or gather, got {self.decode_attention!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI / vLLM logits processing (applied before temperature, top-k and top-p; see engine/sampling.py).
    presence_penalty: float = 0.0  # minus this, once, from the logit of every token already generated
    frequency_penalty: float = 0.0  # minus this times its count, for every token already generated
    repetition_penalty: float = 1.0  # vLLM/CTRL: prompt or output tokens' logits / p if > 0, * p if < 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k most likely
    guide: str = ""  # llguidance grammar the output must match (response_format; see engine/guided.py)
    min_tokens: int = 0  # vLLM: EOS and stop_token_ids cannot be sampled before this many output tokens
    min_p: float = 0.0  # vLLM: tokens below min_p x the top token's probability are cut (after top-k/top-p)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        # Lists are accepted (JSON gives lists) and frozen into tuples.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        # A dict {id: bias} (JSON) or (id, bias) pairs (a migrated request's lists) become sorted pairs.
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = tuple(sorted((int(t), float(b)) for t, b in bias))
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in pairs):
            raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", pairs)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the row needs more than a batched argmax / plain sampling (penalties, bias, logprobs)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.logprobs is not None
            or bool(self.guide)
            or self.min_tokens > 0
        )


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    # When the request asked for logprobs: the sampled token's, and the top (token id, logprob) pairs.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_prefill_tokens_computed: int  # cumulative, prompt (and recomputed) tokens run through the model
    num_cached_prompt_tokens: int  # cumulative, prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_pinned: int = 0  # prefill role: finished requests whose KV is held for transfer
    cached_block_hashes: list[int] = field(default_factory=list)
