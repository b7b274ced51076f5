"""The coordinator prices steps from a measured table: NITSUM_DEVICE_TABLE, else (cpu) the committed profile."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nitsum.config import ConfigError, CoordinatorConfig
from nitsum.policy.registry import make_policy
from nitsum.policy.snapshot import NodeView
from nitsum.policy.steptable import StepTableError, write_rows
from nitsum_services.coordinator import main as coordinator_main
from nitsum_services.coordinator.core import policy_config
from nitsum_services.coordinator.steps import committed_cpu_rows

HEADER = "device,model,tp,phase,batch_size,prompt_tokens,context_tokens,ms\n"


def _node() -> NodeView:
    return NodeView("node0", 2, 1, 2, (), "cpu")


def test_cpu_without_the_variable_uses_the_committed_profile_tp2_included():
    config = policy_config(CoordinatorConfig())
    assert [kind for kind, _ in config.step_tables] == ["cpu"]
    cost = make_policy("adaptive", config).cost_for(_node())
    rows = [r for r in committed_cpu_rows() if r.model == "tiny"]
    for tp in (1, 2):
        row = next(r for r in rows if r.tp == tp and r.phase == "decode")
        # a measured point is priced at its measured time, exactly
        got = cost.step_time_ms(tp, row.batch_size, row.batch_size, row.batch_size * row.context_tokens)
        assert got == pytest.approx(row.ms, rel=1e-9)


def test_the_variable_names_a_table_the_policy_prices_from(tmp_path):
    rows = [r for r in committed_cpu_rows() if r.model == "tiny"]
    doubled = [r.__class__(**{**r.__dict__, "ms": r.ms * 2}) for r in rows]
    path = tmp_path / "steps.csv"
    path.write_text(write_rows(doubled))
    config = policy_config(CoordinatorConfig(device_table=str(path)))
    cost = make_policy("adaptive", config).cost_for(_node())
    row = next(r for r in doubled if r.tp == 2 and r.phase == "decode")
    got = cost.step_time_ms(2, row.batch_size, row.batch_size, row.batch_size * row.context_tokens)
    assert got == pytest.approx(row.ms, rel=1e-9)


@pytest.mark.parametrize(
    "text, says",
    [
        (HEADER + "cpu,tiny,1,decode,one,0,21,8.1\n", "line 2"),
        (HEADER + "h100,llama-3-70b,8,decode,32,0,1024,14.9\n", "h100/llama-3-70b"),
    ],
)
def test_a_bad_table_is_refused_at_boot_with_a_clear_error(tmp_path, text, says):
    path = tmp_path / "steps.csv"
    path.write_text(text)
    config = CoordinatorConfig(device_table=str(path))
    with pytest.raises(StepTableError, match=says):
        policy_config(config)
    ctx = SimpleNamespace(config=config)
    with pytest.raises(ConfigError, match="NITSUM_DEVICE_TABLE"):
        asyncio.run(coordinator_main.body(ctx))


def test_a_missing_table_file_is_refused(tmp_path):
    with pytest.raises(StepTableError, match="no such file"):
        policy_config(CoordinatorConfig(device_table=str(tmp_path / "none.csv")))
