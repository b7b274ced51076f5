"""TP = 2 and 4 (gloo, one process per rank): logits equal transformers' (<= 1e-4), 64 greedy tokens identical."""

import json
import sys

import pytest
import torch
from engine_test_helpers import free_port, prompts_of_lengths, run_workers

NUM_TOKENS = 64


def run_group(model_dir, world_size, prompt, out_path, device="cpu"):
    port = free_port()
    run_workers([
        [sys.executable, "-m", "nitsum.bench.tp_run", "--model-dir", str(model_dir), "--rank", str(rank),
         "--world-size", str(world_size), "--master-port", str(port), "--device", device,
         "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(NUM_TOKENS), "--out", str(out_path)]
        for rank in range(world_size)
    ])
    return json.loads(out_path.read_text())


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_logits_and_greedy_tokens_match_transformers(tiny_dir, hf_model, tmp_path, world_size):
    [prompt] = prompts_of_lengths([29], seed=7)
    result = run_group(tiny_dir, world_size, prompt, tmp_path / "out.json")
    with torch.no_grad():
        hf_tokens = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt):].tolist()
        hf_logits = hf_model(torch.tensor([prompt + result["tokens"]])).logits[0]
    assert result["tokens"] == hf_tokens
    ours = torch.tensor(result["logits"])
    expected = hf_logits[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
    assert ours.shape == expected.shape
    max_diff = (ours - expected).abs().max().item()
    assert max_diff <= 1e-4, f"TP={world_size}: max abs logit diff {max_diff}"
