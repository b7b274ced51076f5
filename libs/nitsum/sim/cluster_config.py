"""What one cluster simulation runs on (`ClusterConfig`): the model and device (a preset, a measured step table
or a cost model), the nodes and their TP bounds, the engines' batching, the policy epochs and reconfiguration
cost, the tiers, and what the live mesh adds to the engine steps (a service model)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nitsum.policy.base import PolicyConfig
from nitsum.policy.costmodel import CostModel, DeviceSpec, cost_model, resolve_device
from nitsum.policy.estimate import MIN_CHUNK_TOKENS
from nitsum.policy.steptable import DeviceStepTable, StepRow, load_step_rows, select
from nitsum.policy.tiers import DEFAULT_TIERS, Tier
from nitsum.sim.service import ServiceModel


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "llama-3-70b"
    # A preset ("cpu" is the shipped CPU table; "h100" | "h200" | "a100"), a device table JSON path (what
    # `nitsum bench profile --out` writes), a loaded DeviceSpec or a CostModel. The policy gets the same table.
    device_kind: str | Path | DeviceSpec | CostModel = "h100"
    # A measured step-time table (CSV path or parsed rows; policy/steptable.py): steps of every group are priced
    # from its rows for (this device's name, this model), and the policy's estimator reads the same table.
    device_table: str | Path | tuple[StepRow, ...] | None = None
    num_nodes: int = 1
    devices_per_node: int = 8
    min_tp: int = 1
    max_tp: int = 8
    chunk_tokens: int = 512  # largest prefill chunk per step on a hybrid group (chunked prefill)
    # Sarathi-style SLO-aware token budget: a hybrid step's prefill chunk is halved (down to
    # min_chunk_tokens) until the step fits the tightest TPOT among the group's running requests. With a
    # fixed 512-token chunk a Llama-3-70B TP8 step takes 26 ms, so every interactive request (25 ms TPOT)
    # decoding beside a prefill missed its TPOT whatever the topology. False: always chunk_tokens.
    tpot_aware_chunks: bool = True
    min_chunk_tokens: int = MIN_CHUNK_TOKENS  # prefill never stalls completely behind a decode batch
    # True: a hybrid step's chunk_tokens budget also pays for its decode tokens, as nitsum's own engine
    # schedules (engine/scheduler.py: running sequences take one token each first, prefill gets the rest);
    # False: the budget is for prefill tokens only (decodes ride along, as in the Sarathi-style model).
    decode_tokens_in_budget: bool = False
    prefill_batch_tokens: int = 8192  # prefill tokens per step on a prefill group
    max_batch: int = 256  # sequences in one decode batch
    block_size_tokens: int = 16
    epoch_ms: float = 1000.0  # NITSUM_RECONFIG_INTERVAL_MS
    reconfig_cost_ms: float | None = None  # None: cost model; else this fixed pause per reconfiguration
    inter_node_bandwidth_bps: float = 8 * 400e9  # P/D hand-off between nodes (8 x 400 Gb/s NICs)
    # Arrivals per tier over this sliding window go into each epoch's snapshot (ClusterSnapshot.arrivals),
    # as a coordinator would measure them; 0 leaves them out (the policy then scores the backlog only).
    arrival_window_ms: float = 5000.0
    # ... and over the whole steady stretch since the stream last shifted, up to this long (ArrivalWindow.regime_ms).
    arrival_regime_ms: float = 60_000.0
    drain_ms: float = 30_000.0  # after the last arrival, how long in-flight requests may still finish
    tiers: tuple[tuple[str, Tier], ...] = tuple(DEFAULT_TIERS.items())
    # What the live mesh adds to the table's engine steps (request path, step noise); None: engine steps only.
    service: ServiceModel | None = None

    def __post_init__(self) -> None:
        _ = self.device  # an unknown kind or a missing table file fails here, with the accepted forms named
        self.step_table()  # a malformed step table fails here, naming its line and column
        if isinstance(self.device_kind, CostModel) and self.device_kind.model.name != self.model:
            raise ValueError(
                f"device_kind is a cost model of {self.device_kind.model.name!r}, the cluster runs {self.model!r}"
            )

    @property
    def device(self) -> DeviceSpec:
        return resolve_device(self.device_kind)

    @property
    def device_name(self) -> str:
        """The kind the nodes report (NodeView.device_kind): the preset's name, or the given table's name."""
        return (
            self.device_kind
            if isinstance(self.device_kind, str) and not self.device_kind.endswith(".json")
            else self.device.name
        )

    def step_table(self) -> DeviceStepTable | None:
        if self.device_table is None:
            return None
        from nitsum.policy.costmodel import model_spec

        rows = self.device_table if isinstance(self.device_table, tuple) else load_step_rows(self.device_table)
        source = "device table" if isinstance(self.device_table, tuple) else str(self.device_table)
        return select(rows, self.device_name, model_spec(self.model), source)

    def cost_model(self) -> CostModel:
        if isinstance(self.device_kind, CostModel):
            return self.device_kind
        base = cost_model(self.model, self.device)
        steps = self.step_table()
        return base if steps is None else CostModel(base.model, base.device, steps=steps)

    def policy_config(self) -> PolicyConfig:
        from nitsum.policy.costmodel import model_spec

        return PolicyConfig(
            model=model_spec(self.model),
            epoch_ms=self.epoch_ms,
            block_size_tokens=self.block_size_tokens,
            chunk_tokens=self.chunk_tokens,
            prefill_batch_tokens=self.prefill_batch_tokens,
            devices=((self.device_name, self.device),),
            step_tables=() if self.device_table is None else ((self.device_name, self.step_table()),),
        )
