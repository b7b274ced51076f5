"""Shared fixtures for the model/engine tests: one tiny checkpoint per session."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from nitsum.model.tiny import make_tiny

    torch.set_num_threads(1)
    return make_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
