"""TP=1 logits and greedy tokens equal transformers' LlamaForCausalLM on the tiny checkpoint (fp32)."""

import pytest
import torch
from devices import accel_param
from engine_test_helpers import prompts_of_lengths, record_logits

from nitsum.engine import Engine, EngineConfig, SamplingParams

NUM_TOKENS = 64


def hf_reference(hf_model, prompt, tokens):
    """Logits at every position of prompt + tokens; greedy tokens from HF generate."""
    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0]
    return generated, logits


def check_parity(engine, hf_model, prompt):
    recorded = record_logits(engine)
    [tokens] = engine.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    hf_tokens, hf_logits = hf_reference(hf_model, prompt, tokens)
    assert tokens == hf_tokens
    ours = torch.cat(recorded)  # one row per sampled token
    assert ours.shape == (NUM_TOKENS, hf_logits.shape[-1])
    expected = hf_logits[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
    max_diff = (ours - expected).abs().max().item()
    assert max_diff <= 1e-4, f"max abs logit diff {max_diff}"
    return tokens


def test_logits_and_greedy_tokens_match_transformers(tiny_dir, hf_model):
    engine = Engine(EngineConfig(model_dir=str(tiny_dir)))
    [prompt] = prompts_of_lengths([37])
    check_parity(engine, hf_model, prompt)
    engine.check_integrity()


def test_chunked_prefill_over_cached_prefix_matches_transformers(tiny_dir, hf_model):
    # A 7-token budget splits the 37-token prompt into 6 chunks, crossing block boundaries.
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), max_num_batched_tokens=7))
    [prompt] = prompts_of_lengths([37])
    recorded = record_logits(engine)
    [tokens] = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([prompt + tokens])).logits[0]
    rows = torch.cat([r for r in recorded if r.shape[0]])
    assert rows.shape[0] == 8
    assert (rows - hf_logits[36:44]).abs().max().item() <= 1e-4
    assert tokens == hf_logits[36:44].argmax(-1).tolist()


@pytest.mark.parametrize("device", [accel_param()])
def test_logits_and_greedy_tokens_match_transformers_on_cuda(tiny_dir, hf_model, device):
    """fp32 on the accelerator (asked for: bf16 is CUDA's default, see test_parity_bf16), its default decode
    attention (flex on CUDA)."""
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), device=device, dtype="float32"))
    [prompt] = prompts_of_lengths([37])
    hf_cuda = hf_model.to(device)
    try:
        recorded = record_logits(engine)
        [tokens] = engine.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
        with torch.no_grad():
            hf_logits = hf_cuda(torch.tensor([prompt + tokens], device=device)).logits[0].cpu()
    finally:
        hf_model.to("cpu")
    ours = torch.cat([r.cpu() for r in recorded])
    expected = hf_logits[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
    assert tokens == expected.argmax(-1).tolist()
    assert (ours - expected).abs().max().item() <= 1e-4
