"""The tiny checkpoint maker, the loader and the tokenizer."""

import hashlib
import json

import pytest
import torch

from nitsum.model import loader
from nitsum.model.tiny import make_tiny
from nitsum.model.tokenizer import IncrementalDetokenizer, Tokenizer


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_make_tiny_is_bit_identical_and_idempotent(tmp_path, tiny_dir):
    again = make_tiny(tmp_path / "t")
    assert _digests(again) == _digests(tiny_dir)
    make_tiny(again)
    assert _digests(again) == _digests(tiny_dir)


def test_cli_make_tiny(tmp_path, tiny_dir):
    from nitsum.model.cli import main

    assert main(["make-tiny", str(tmp_path / "c")]) == 0
    assert _digests(tmp_path / "c") == _digests(tiny_dir)


def test_tiny_config_allows_tp_1_2_4(tiny_dir):
    cfg = loader.load_config(tiny_dir)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.max_model_len) == (8, 4, 320, 2048)
    for tp in (1, 2, 4):
        cfg.check_tp(tp)
    with pytest.raises(loader.ModelLoadError, match="not divisible by TP=3"):
        cfg.check_tp(3)


def test_transformers_tokenizer_agrees(tiny_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    ours = Tokenizer(tiny_dir)
    text = "héllo, wörld €5 <|user|>"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.encode("hi", add_bos=True) == [256, 104, 105]
    assert (ours.bos_token_id, ours.eos_token_id) == (256, 257)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages) == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_incremental_detokenizer_never_splits_a_character(tiny_dir):
    tok = Tokenizer(tiny_dir)
    ids = tok.encode("a€b")  # € is three bytes
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["a", "", "", "€", "b"]


def test_loader_counts_bytes_and_shards_are_views(tiny_dir):
    before = loader.bytes_read
    weights = loader.load_weights(tiny_dir, torch.float32)
    total = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert loader.bytes_read - before == total
    cfg = loader.load_config(tiny_dir)
    shards = loader.shard_weights(weights, cfg, rank=1, size=2)
    q = shards["model.layers.0.self_attn.q_proj.weight"]
    o = shards["model.layers.0.self_attn.o_proj.weight"]
    assert q.shape == (64, 128) and o.shape == (128, 64)
    assert (
        q.untyped_storage().data_ptr() == weights["model.layers.0.self_attn.q_proj.weight"].untyped_storage().data_ptr()
    )
    assert torch.equal(o, weights["model.layers.0.self_attn.o_proj.weight"][:, 64:])
    assert loader.bytes_read - before == total  # sharding read nothing


def test_unsupported_architecture_is_named(tmp_path, tiny_dir):
    bad = tmp_path / "bad"
    make_tiny(bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(loader.ModelLoadError, match="GPTNeoXForCausalLM"):
        loader.load_config(bad)


def test_missing_files_are_named(tmp_path):
    d = tmp_path / "m"
    make_tiny(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(loader.ModelLoadError, match="model-00002-of-00002.safetensors"):
        loader.load_weights(d, torch.float32)
    (d / "config.json").unlink()
    with pytest.raises(loader.ModelLoadError, match="config.json"):
        loader.load_config(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer(d)
