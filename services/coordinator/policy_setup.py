"""The coordinator's policy configuration: the served model as the cost model sees it (from its config.json) and
the device's step table."""

from __future__ import annotations

import json

from nitsum.config import CoordinatorConfig, default_dtype
from nitsum.modelpath import resolve_model_dir
from nitsum.policy.base import PolicyConfig
from nitsum.policy.costmodel import ModelSpec
from nitsum_services.coordinator.steps import step_table_for


def model_spec_of(config: CoordinatorConfig) -> ModelSpec:
    """The cost model's view of the served model, from its Hugging Face config.json."""
    model_dir = resolve_model_dir(config.model)
    hf = json.loads((model_dir / "config.json").read_text())
    dtype = default_dtype(config.device_kind) if config.dtype == "auto" else config.dtype
    bytes_per = 4.0 if dtype == "float32" else 2.0
    # The directory's name, as `nitsum bench profile` names the model in the step tables it writes.
    return ModelSpec.from_hf_config(model_dir.name, hf, bytes_per)


def policy_config(config: CoordinatorConfig) -> PolicyConfig:
    """StepTableError when NITSUM_DEVICE_TABLE (or the committed CPU profile) cannot be used."""
    model = model_spec_of(config)
    table, _source = step_table_for(config.device_table, config.device_kind, model)
    return PolicyConfig(
        model=model,
        step_tables=() if table is None else ((config.device_kind, table),),
        epoch_ms=float(config.reconfig_interval_ms),
        queue_bounds=(("interactive", config.queue_limit_interactive), ("background", config.queue_limit_background)),
    )
