"""The devices a device-parametrized model test runs on: `cpu` always, and the accelerator as a gpu-marked case.

The accelerator is `cuda` unless NITSUM_TEST_ACCEL names another device: `.ci/gpu-check --dry-run` sets it to
`cpu`, so that every gpu-marked case runs its exact steps on the CPU (a rehearsal of the device run; the
cuda-only assertions are skipped there). On a machine without CUDA the gpu-marked cases are skipped with a reason.
"""

from __future__ import annotations

import os

import pytest
import torch

ACCEL = os.environ.get("NITSUM_TEST_ACCEL", "cuda")
ON_CUDA = ACCEL.startswith("cuda")
ACCEL_MISSING = ON_CUDA and not torch.cuda.is_available()


def accel_param(*extra_marks) -> object:
    """The accelerator as one pytest parameter (id `accel`), gpu-marked, skipped where it is missing."""
    marks = [
        pytest.mark.gpu,
        pytest.mark.skipif(ACCEL_MISSING, reason="needs a CUDA device (none visible to torch)"),
        *extra_marks,
    ]
    return pytest.param(ACCEL, marks=marks, id="accel")


# `@pytest.mark.parametrize("device", DEVICES)`: the CPU case, then the accelerator's.
DEVICES = [pytest.param("cpu", id="cpu"), accel_param()]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
