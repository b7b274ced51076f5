"""bf16 (the CUDA default) against transformers in bf16, with the fp32 transformers model as the referee.

A bf16 forward's logits are off the fp32 ones by a few percent of their scale, transformers' as much as ours, so
exact equality is not the bar. The bar: on every generated position nitsum's bf16 logits are within 10% of the
logit scale of fp32 transformers' (measured on CPU: 4.6-6.7%), no further from them than twice transformers' own
bf16 logits are (measured: 0.8-1.2 times), within 10% of transformers' bf16 logits (measured: 3.9-5.2%), and the
greedy streams equal transformers' bf16 `generate` up to a bf16 near-tie (`tests/greedy_ties.NEAR_TIE_BF16`).
Runs on the CPU (explicit bf16) and, gpu-marked, on CUDA with the default dtype (which must then be bf16)."""

import pytest
import torch
from devices import DEVICES
from engine_test_helpers import prompts_of_lengths, record_logits

from nitsum.config import WorkerConfig, default_dtype, load
from nitsum.engine import Engine, EngineConfig, SamplingParams
from tests.greedy_ties import NEAR_TIE_BF16, check_greedy

NUM_TOKENS = 48
MAX_REL_TO_FP32 = 0.10
MAX_REL_TO_HF_BF16 = 0.10


def test_dtype_defaults_fp32_on_cpu_and_bf16_on_cuda():
    assert EngineConfig(model_dir="m").dtype == "float32"
    assert EngineConfig(model_dir="m", device="cuda").dtype == "bfloat16"
    assert EngineConfig(model_dir="m", device="cuda:1", dtype="float32").dtype == "float32"
    assert EngineConfig(model_dir="m", device="cpu", dtype="bfloat16").dtype == "bfloat16"
    assert load(WorkerConfig, environ={}).dtype == "auto"
    assert [default_dtype(d) for d in ("cpu", "cuda", "cuda:0", "h200")] == ["float32"] + ["bfloat16"] * 3
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model_dir="m", dtype="bf16")


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-row max |got - ref| / max |ref|."""
    return ((got.float() - ref.float()).abs().amax(-1) / ref.float().abs().amax(-1)).max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_and_greedy_tokens_match_transformers(tiny_dir, hf_model, device):
    from transformers import LlamaForCausalLM

    # On CUDA the default must be bf16; elsewhere bf16 is asked for.
    dtype = "auto" if device.startswith("cuda") else "bfloat16"
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), device=device, dtype=dtype))
    assert engine.runner.dtype == torch.bfloat16 and engine.runner.kv_cache.dtype == torch.bfloat16
    assert all(
        p.dtype == torch.bfloat16 and p.device.type == torch.device(device).type
        for p in engine.runner.model.parameters()
    )
    hf_bf16 = LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.bfloat16).to(device).eval()
    for prompt in prompts_of_lengths([37, 21], seed=5):
        recorded = record_logits(engine)
        [tokens] = engine.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
        engine.runner.execute = type(engine.runner).execute.__get__(engine.runner)  # unwrap for the next prompt
        ours = torch.cat([r.cpu() for r in recorded if r.shape[0]])
        assert ours.shape == (NUM_TOKENS, hf_model.config.vocab_size) and ours.dtype == torch.float32
        n = len(prompt)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            hf_tokens = hf_bf16.generate(
                ids.to(device),
                attention_mask=torch.ones_like(ids).to(device),
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, n:].tolist()
            forced = torch.tensor([prompt + tokens])
            ref32 = hf_model(forced).logits[0, n - 1 : n - 1 + NUM_TOKENS]
            hf16 = hf_bf16(forced.to(device)).logits[0, n - 1 : n - 1 + NUM_TOKENS].float().cpu()
        ours_err, hf_err = relative_error(ours, ref32), relative_error(hf16, ref32)
        assert ours_err <= MAX_REL_TO_FP32, f"{device}: bf16 logits {ours_err:.3f} of the scale off fp32"
        assert ours_err <= 2 * hf_err, f"{device}: {ours_err:.3f} off fp32, transformers' bf16 {hf_err:.3f}"
        assert relative_error(ours, hf16) <= MAX_REL_TO_HF_BF16
        assert len(tokens) == len(hf_tokens) == NUM_TOKENS
        check_greedy(tiny_dir, prompt, tokens, hf_tokens, f"{device} bf16, prompt of {n}", near_tie=NEAR_TIE_BF16)
    engine.check_integrity()
