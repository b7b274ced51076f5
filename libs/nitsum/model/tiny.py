"""`nitsum model make-tiny DIR`: a deterministic tiny Llama checkpoint in Hugging Face format.

Random weights from a fixed seed (bit-identical files on every run), a byte-level tokenizer built with the
`tokenizers` library plus a few special tokens, and a small chat template. Head counts (8 query, 4 KV)
and every sharded dimension divide by 4, so TP = 1, 2 and 4 all work. The weights are scaled so logits
have a spread of a few units: greedy decoding mostly has clear winners, so batching-order rounding rarely
flips a token -- rarely, not never: over long generations (hundreds of tokens, more so with the larger
`config_overrides` the e2e tests use) a near-tie does come up, see tests/greedy_ties.py and README
"Determinism".
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_SEED = 0
TINY_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "vocab_size": 320,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (printable bytes map to themselves)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping: dict[int, str] = {}
    shift = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shift)
            shift += 1
    return mapping


def build_tokenizer_json() -> str:
    """Byte-level tokenizer: token id == byte value for 0..255, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer.to_str(pretty=True)


def build_weights(config: dict, seed: int = TINY_SEED) -> dict:
    """Hugging Face-named fp32 tensors, generated in a fixed order from one seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    vocab = config["vocab_size"]

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) * (gain / in_features**0.5)

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(q_out, hidden, 2.0)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden, 2.0)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_out)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    weights["lm_head.weight"] = linear(vocab, hidden, 3.0)
    return {name: t.contiguous() for name, t in weights.items()}


def make_tiny(
    directory: str | Path, config_overrides: dict | None = None, seed: int = TINY_SEED, dtype: str = "float32"
) -> Path:
    """Write the tiny checkpoint into `directory` (created if needed); same bytes every time. `dtype`: the
    files' dtype (the weights are drawn in fp32, then rounded; bf16 halves a large random model's files)."""
    import torch
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, **(config_overrides or {}), "torch_dtype": dtype}
    weights = build_weights(config, seed)
    if dtype != "float32":
        weights = {name: t.to(getattr(torch, dtype)) for name, t in weights.items()}

    # Two shards + an index, like real checkpoints: layers in the first half go to shard 1.
    half = config["num_hidden_layers"] // 2
    shards: list[dict] = [{}, {}]
    for name, tensor in weights.items():
        second = name.startswith("lm_head") or name == "model.norm.weight"
        if name.startswith("model.layers."):
            second = int(name.split(".")[2]) >= half
        shards[int(second)][name] = tensor
    weight_map: dict[str, str] = {}
    total_size_bytes = 0
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file_name
            total_size_bytes += tensor.numel() * tensor.element_size()
    index_json = {"metadata": {"total_size": total_size_bytes}, "weight_map": dict(sorted(weight_map.items()))}

    files = {
        "config.json": config,
        "model.safetensors.index.json": index_json,
        "generation_config.json": {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>"},
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(build_tokenizer_json() + "\n")
    return out
