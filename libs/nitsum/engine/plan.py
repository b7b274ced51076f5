"""The per-step message a TP group leader broadcasts to its peers (msgpack, no pickle).

It carries exactly what every rank's forward needs: for each scheduled chunk its token ids, start
position, block table and whether its logits are wanted. Peers run the same forward; only the leader
samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

PLAN_KIND_STEP = "step"
PLAN_KIND_SHUTDOWN = "shutdown"
# A topology command (msgpack in `control`) every member runs at this step boundary, see nitsum.node.runtime.
PLAN_KIND_CONTROL = "control"
# Nothing to run: an idle leader sends it now and then so that peers waiting in a broadcast never hit
# the process group's timeout.
PLAN_KIND_NOOP = "noop"
PLAN_SCHEMA_VERSION = 1
MAX_PLAN_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ChunkPlan:
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool


@dataclass(frozen=True)
class StepPlan:
    kind: str
    step_id: int
    chunks: tuple[ChunkPlan, ...] = ()
    version: int = PLAN_SCHEMA_VERSION
    control: bytes = b""

    def encode(self) -> bytes:
        body = [[list(c.token_ids), c.start_pos, list(c.block_table), c.sample] for c in self.chunks]
        fields = [self.kind, self.version, self.step_id, body]
        if self.kind == PLAN_KIND_CONTROL:
            fields.append(self.control)
        return msgpack.packb(fields, use_bin_type=True)

    @staticmethod
    def decode(payload: bytes) -> StepPlan:
        if len(payload) > MAX_PLAN_BYTES:
            raise ValueError(f"step plan of {len(payload)} bytes exceeds {MAX_PLAN_BYTES}")
        kind, version, step_id, body, *rest = msgpack.unpackb(payload, raw=False)
        if kind not in (PLAN_KIND_STEP, PLAN_KIND_SHUTDOWN, PLAN_KIND_CONTROL, PLAN_KIND_NOOP):
            raise ValueError(f"unknown step plan kind {kind!r}")
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(f"step plan schema {version} != {PLAN_SCHEMA_VERSION}")
        chunks = tuple(ChunkPlan(tuple(t), int(s), tuple(b), bool(x)) for t, s, b, x in body)
        control = bytes(rest[0]) if kind == PLAN_KIND_CONTROL and rest else b""
        return StepPlan(kind=kind, step_id=int(step_id), chunks=chunks, version=version, control=control)
