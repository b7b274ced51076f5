"""The stdlib-only packages import no torch, nats, asyncio or msgpack (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("torch", "nats", "asyncio", "msgpack")
MODULES = (
    "nitsum.policy",
    "nitsum.policy.registry",
    "nitsum.policy.topology",
    "nitsum.policy.baselines",
    "nitsum.policy.costmodel",
    "nitsum.policy.steptable",
    "nitsum.policy.flows",
    "nitsum.policy.flow_baselines",
    "nitsum.kv",
    "nitsum.workloads",
    "nitsum.sim",
    "nitsum.sim.engine",
    "nitsum.sim.network",
    "nitsum.sim.cluster",
    "nitsum.sim.flowsim",
    "nitsum.sim.cli",
    "nitsum.sim.experiments.tiers",
    "nitsum.sim.experiments.flows",
    "nitsum.sim.experiments.reconfig",
)


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_no_heavy_or_async_dependency(module):
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "No module named" in out.stderr and module.split(".")[1] == "kv":
        pytest.skip(f"{module} does not exist yet")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], f"{module} pulled in {out.stdout.strip()}"
