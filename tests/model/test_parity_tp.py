"""TP = 2 and 4 (gloo, one process per rank): logits equal transformers' (<= 1e-4), 64 greedy tokens identical.

Also on CUDA (gpu-marked): two and four ranks on one GPU (NCCL refuses two ranks on one device, so the group
runs gloo with host staging, `parallel.group.tp_backend`), in fp32, against transformers on the CPU. Decode
attention is the gather path here (what these tests check is TP; test_paged_attention_flex checks flex, and each
TP rank would compile it afresh: minutes of the device check's 8)."""

import json
import sys

import pytest
import torch
from devices import DEVICES
from engine_test_helpers import free_port, prompts_of_lengths, run_workers

NUM_TOKENS = 64


def run_group(model_dir, world_size, prompt, out_path, device="cpu"):
    port = free_port()
    run_workers(
        [
            [
                sys.executable,
                "-m",
                "nitsum.bench.tp_run",
                "--model-dir",
                str(model_dir),
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--master-port",
                str(port),
                "--device",
                device,
                "--prompt-ids",
                ",".join(map(str, prompt)),
                "--max-tokens",
                str(NUM_TOKENS),
                "--out",
                str(out_path),
                "--decode-attention",
                "gather",
            ]
            for rank in range(world_size)
        ]
    )
    return json.loads(out_path.read_text())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_logits_and_greedy_tokens_match_transformers(tiny_dir, hf_model, tmp_path, world_size, device):
    [prompt] = prompts_of_lengths([29], seed=7)
    result = run_group(tiny_dir, world_size, prompt, tmp_path / "out.json", device=device)
    assert result["device"].split(":")[0] == device.split(":")[0]
    if device.startswith("cuda"):
        assert result["host_staging"] == (torch.cuda.device_count() < world_size)
    with torch.no_grad():
        hf_tokens = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        hf_logits = hf_model(torch.tensor([prompt + result["tokens"]])).logits[0]
    assert result["tokens"] == hf_tokens
    ours = torch.tensor(result["logits"])
    expected = hf_logits[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
    assert ours.shape == expected.shape
    max_diff = (ours - expected).abs().max().item()
    assert max_diff <= 1e-4, f"TP={world_size}: max abs logit diff {max_diff}"


def test_ranks_sharing_a_gpu_use_gloo():
    """NCCL refuses two ranks on one device: with more ranks than visible GPUs a CUDA group runs gloo."""
    from nitsum.parallel.group import tp_backend

    assert tp_backend("cpu", 4) == "gloo"
    assert tp_backend("cuda", torch.cuda.device_count() + 1) == "gloo"
    if torch.cuda.device_count() >= 2:
        assert tp_backend("cuda:0", 2) == "nccl"
