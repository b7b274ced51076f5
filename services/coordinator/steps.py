"""The measured step-time table the coordinator's policy prices steps from (policy/steptable.py format).

`NITSUM_DEVICE_TABLE` names a CSV (what `nitsum bench profile --csv FILE [--tp 1,2,...]` writes, the same file
`nitsum sim --device-table` reads); its rows for (NITSUM_DEVICE_KIND, the served model) are used. Without it,
on `NITSUM_DEVICE_KIND=cpu`, the committed CPU profile of the tiny model (nitsum/data/costmodel/cpu_tiny_steps.csv,
TP 1-8, measured on this project's 2-core testbed) when it has rows for the served model; otherwise none (the
roofline device table prices steps). A table that does not parse, or lacks the (device, model) rows, is refused
at boot with a message naming the file, line and column or what the table holds.
"""

from __future__ import annotations

from importlib import resources

from nitsum.policy.costmodel import ModelSpec
from nitsum.policy.steptable import DeviceStepTable, StepTableError, load_step_rows, parse_rows, select

COMMITTED_CPU_PROFILE = "data/costmodel/cpu_tiny_steps.csv"


def committed_cpu_rows():
    text = resources.files("nitsum").joinpath(COMMITTED_CPU_PROFILE).read_text()
    return parse_rows(text, f"nitsum/{COMMITTED_CPU_PROFILE}")


def step_table_for(path: str, device_kind: str, model: ModelSpec) -> tuple[DeviceStepTable | None, str]:
    """(table, where it came from); (None, why none) when no table applies. StepTableError on a bad table."""
    if path:
        try:
            rows = load_step_rows(path)
        except OSError as exc:
            raise StepTableError(f"{path}: cannot read the step table ({exc.strerror or exc})") from None
        return select(rows, device_kind, model, path), path
    if device_kind != "cpu":
        return None, f"no NITSUM_DEVICE_TABLE: the {device_kind} roofline table prices steps"
    rows = committed_cpu_rows()
    if not any(r.model == model.name for r in rows):
        return (
            None,
            f"no NITSUM_DEVICE_TABLE and no committed CPU profile of {model.name!r}: the CPU roofline prices steps",
        )
    return select(rows, "cpu", model, f"nitsum/{COMMITTED_CPU_PROFILE}"), f"nitsum/{COMMITTED_CPU_PROFILE}"


__all__ = ["COMMITTED_CPU_PROFILE", "StepTableError", "committed_cpu_rows", "step_table_for"]
