"""`nitsum up --device cuda --devices 1` serves the official openai client from the GPU (gpu-marked; with
NITSUM_TEST_ACCEL=cpu, `.ci/gpu-check --dry-run` runs the same steps with `--device cpu`).

The worker must say it computes on the accelerator in the device's default dtype (bf16 on CUDA) with the
device's default decode attention (flex on CUDA); chat (streamed and not) must agree; and the greedy tokens the
mesh returns for a token-id prompt must equal an in-process engine's on the same device, dtype and checkpoint
(one request at a time on both sides: the same batch composition, so the same tokens; on CUDA up to a bf16
near-tie, since each process compiles its own flex kernel)."""

import openai
import pytest
from devices import ON_CUDA, accel_param
from engine_test_helpers import prompts_of_lengths

from nitsum.config import default_dtype
from nitsum.engine import Engine, EngineConfig, SamplingParams
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.greedy_ties import NEAR_TIE, NEAR_TIE_BF16, check_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.mark.parametrize("device", [accel_param()])
def test_up_on_one_device_serves_the_openai_client(tiny_dir, tmp_path, device):
    up_device = "cuda" if ON_CUDA else "cpu"
    mesh = start_mesh(
        tmp_path, devices=1, extra_args=("--device", up_device, "--model", str(tiny_dir)), ready_timeout_s=240.0
    )
    try:
        log = (mesh.run_dir / "worker-0.log").read_text()
        dtype = default_dtype(up_device)
        attention = "flex" if ON_CUDA else "gather"
        assert f"engine on {'cuda:0' if ON_CUDA else 'cpu'}: {dtype}, decode attention {attention}" in log, log[-2000:]
        assert ("flex decode attention compiled in" in log) == ON_CUDA  # before serving, not in a request
        client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Say something."}]
        full = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        assert full.usage.completion_tokens >= 1
        streamed = client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        text = "".join(choice.delta.content or "" for chunk in streamed for choice in chunk.choices)
        assert text == full.choices[0].message.content
        engine = Engine(EngineConfig(model_dir=str(tiny_dir), device=device))
        for prompt in prompts_of_lengths([9, 30], seed=8):
            out = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            [expected] = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))
            got = out.choices[0].model_extra["token_ids"]
            assert len(got) == 16
            # Equal; on CUDA a near-tie may still part them (two processes compile their own kernels).
            check_greedy(
                tiny_dir,
                prompt,
                got,
                expected,
                "mesh vs in-process engine",
                near_tie=NEAR_TIE_BF16 if ON_CUDA else NEAR_TIE,
            )
    finally:
        stop_mesh(mesh.process)
