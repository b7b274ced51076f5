"""Moving requests and their KV between engines: the executor under a TP change (and, later, P/D import).

Three pieces, all driven by a `nitsum.kv.reshard` plan that every worker computed identically:
- `snapshot_kv` / `export_states`: what an old group's leader knows about its requests (block tables,
  computed tokens; then the full request state: tokens, sampling params, generator, detokenizer, text).
- `execute_transfers`: this worker's part of the plan's KV moves, all pairs at once (every send and
  receive is posted before any is waited on). A move within one worker is a local copy; between workers
  it is a point-to-point message over the node's world (gloo on CPU, NCCL peer copies on CUDA).
- `install_states`: the new group's leader adopts the moved requests into its fresh engine, in order,
  with the tables the plan chose, so decoding continues with the next token -- none repeated, none lost.

States travel as msgpack-ready dicts (no pickle): a torch generator's state as bytes.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import torch

from nitsum.engine.params import SamplingParams
from nitsum.engine.sequence import Sequence, Status
from nitsum.engine.slo import RequestSlo
from nitsum.kv.reshard import Group, Placement, RequestKV, Transfer, kv_head_range
from nitsum.model.tokenizer import IncrementalDetokenizer


def sequences_in_order(engine: Any) -> list[Sequence]:
    """Running (in scheduling order), then waiting (queue order), then pinned."""
    sched = engine.scheduler
    return [*sched.running, *sched.waiting, *sched.pinned.values()]


def snapshot_kv(engine: Any, group: Group) -> list[RequestKV]:
    kv = engine.kv
    return [
        RequestKV(
            s.request_id,
            group,
            s.num_computed_tokens if kv.has(s.request_id) else 0,
            tuple(kv.block_table(s.request_id)) if kv.has(s.request_id) else (),
        )
        for s in sequences_in_order(engine)
    ]


def export_state(engine: Any, seq: Sequence) -> dict[str, Any]:
    detok = seq.detokenizer
    return {
        "id": seq.request_id,
        "prompt": list(seq.prompt_token_ids),
        "tokens": list(seq.token_ids),
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(seq.params).items()},
        "computed": seq.num_computed_tokens,
        "cached_prompt": seq.num_cached_prompt_tokens,
        "status": seq.status.value,
        "preemptions": seq.num_preemptions,
        "generator": bytes(seq.generator.get_state().numpy().tobytes()) if seq.generator is not None else None,
        "detok": detok.export() if detok is not None else None,
        "text": seq.text,
        "emitted": seq.num_text_emitted,
        "prefill_target": engine.scheduler.prefill_target(seq.request_id),
        # The SLO travels with its age, not the arrival stamp: engines on other hosts have other clocks.
        "slo": None
        if seq.slo is None
        else {
            "tier": seq.slo.tier,
            "ttft_ms": seq.slo.ttft_ms,
            "tpot_ms": seq.slo.tpot_ms,
            "age_ms": engine.now_ms() - seq.slo.arrival_ms,
        },
    }


def export_states(engine: Any) -> list[dict[str, Any]]:
    return [export_state(engine, s) for s in sequences_in_order(engine)]


def install_states(engine: Any, states: SequenceABC[dict[str, Any]], placements: dict[str, Placement]) -> None:
    """Adopt moved requests, in order. A request placed with `recompute` re-queues like a preempted one."""
    for state in states:
        placement = placements.get(state["id"])
        install_state(engine, state, placement)


def install_state(
    engine: Any, state: dict[str, Any], placement: Placement | None, kv_adopted: bool = False
) -> Sequence:
    """Adopt one request; `kv_adopted`: the caller already allocated its table in `engine.kv`."""
    rid = state["id"]
    if rid in engine._seqs:
        raise ValueError(f"duplicate request id {rid!r}")
    params = SamplingParams(**state["params"])
    seq = Sequence(rid, list(state["prompt"]), params, arrival_index=engine._arrivals)
    engine._arrivals += 1
    seq.token_ids = list(state["tokens"])
    seq.num_cached_prompt_tokens = state["cached_prompt"]
    seq.num_preemptions = state["preemptions"]
    seq.text = state["text"]
    seq.num_text_emitted = state["emitted"]
    slo = state.get("slo")
    if slo is not None:
        seq.slo = RequestSlo(slo["tier"], slo["ttft_ms"], slo["tpot_ms"], arrival_ms=engine.now_ms() - slo["age_ms"])
    if state["generator"] is not None:
        generator = torch.Generator(device="cpu")
        generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))
        seq.generator = generator
    detok = IncrementalDetokenizer(engine.tokenizer)
    if state["detok"] is not None:
        detok.restore(state["detok"])
    seq.detokenizer = detok
    if params.guide:  # a guided request's matcher replays the output so far
        seq.matcher = engine.guides.matcher(params.guide, seq.output_token_ids)
    status = Status(state["status"])
    has_kv = placement is not None and not placement.recompute and bool(placement.dst_block_ids)
    if status in (Status.RUNNING, Status.PINNED) and has_kv:
        assert placement is not None
        assert placement.num_moved_tokens == state["computed"], (
            f"{rid}: {placement.num_moved_tokens} KV tokens moved but {state['computed']} computed"
        )
        if not kv_adopted:
            engine.kv.adopt(rid, placement.dst_block_ids)
        seq.num_computed_tokens = state["computed"]
        engine.kv.commit(rid, seq.token_ids, seq.num_computed_tokens)
        seq.status = status
    elif status is Status.WAITING:
        seq.status = Status.WAITING
    else:
        # No KV came along (no room in the new pool): recompute, as after a preemption.
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
    engine._seqs[rid] = seq
    engine.scheduler.adopt(seq, state["prefill_target"])
    return seq


def execute_transfers(
    world: Any,
    transfers: SequenceABC[Transfer],
    me: int,
    old_kv: torch.Tensor | None,
    old_heads: tuple[int, int] | None,
    new_kv: torch.Tensor | None,
    new_heads: tuple[int, int] | None,
) -> int:
    """Run this worker's part of `transfers`; returns the bytes it sent to other workers.

    `old_kv`/`new_kv`: [layers, K/V, blocks, block_size, local_kv_heads, head_dim]; `*_heads` the global KV
    heads [start, end) each holds. A transfer's index in the plan is its message tag, so every pair of
    workers matches its sends and receives without further coordination.
    """
    sends: list[tuple[Any, torch.Tensor]] = []
    recvs: list[tuple[Transfer, torch.Tensor, Any]] = []
    bytes_sent = 0
    for tag, t in enumerate(transfers):
        if t.src_worker == me:
            assert old_kv is not None and old_heads is not None, f"worker {me} sends KV it does not hold"
            src_index = torch.tensor(t.src_block_ids, dtype=torch.long, device=old_kv.device)
            h0, h1 = t.head_start - old_heads[0], t.head_end - old_heads[0]
            # [layers', 2, n, block_size, heads', head_dim]
            buf = old_kv[t.layer_start : t.layer_end, :, src_index, :, h0:h1].contiguous()
            if t.dst_worker == me:
                _write(new_kv, new_heads, t, buf)
            else:
                sends.append((world.isend(buf, t.dst_worker, tag), buf))
                bytes_sent += buf.numel() * buf.element_size()
        elif t.dst_worker == me:
            assert new_kv is not None, f"worker {me} receives KV but has no new cache"
            shape = (
                t.layer_end - t.layer_start,
                2,
                t.num_blocks,
                new_kv.shape[3],
                t.head_end - t.head_start,
                new_kv.shape[5],
            )
            buf = torch.empty(shape, dtype=new_kv.dtype, device=new_kv.device)
            recvs.append((t, buf, world.irecv(buf, t.src_worker, tag)))
    for t, buf, handle in recvs:
        handle.wait()
        _write(new_kv, new_heads, t, buf)
    for handle, _ in sends:
        handle.wait()
    return bytes_sent


def _write(new_kv: torch.Tensor | None, new_heads: tuple[int, int] | None, t: Transfer, buf: torch.Tensor) -> None:
    assert new_kv is not None and new_heads is not None, "a KV write needs the new cache"
    dst_index = torch.tensor(t.dst_block_ids, dtype=torch.long, device=new_kv.device)
    h0, h1 = t.head_start - new_heads[0], t.head_end - new_heads[0]
    new_kv[t.layer_start : t.layer_end, :, dst_index, :, h0:h1] = buf


def heads_of(num_kv_heads: int, group: Group, worker: int) -> tuple[int, int]:
    return kv_head_range(num_kv_heads, group.tp, worker - group.start)


# -- P/D disaggregation: one request's KV out of one engine and into another ---------------------------
@dataclass(frozen=True)
class KVExport:
    """A request's full state and the KV of its computed tokens, as one rank holds it.

    `kv`: [layers, K/V, num_blocks, block_size, heads, head_dim] for global KV heads `heads`; a TP=1
    engine holds them all. `to_bytes`/`from_bytes` give a msgpack form for the transfer data plane.
    """

    state: dict[str, Any]
    num_tokens: int
    heads: tuple[int, int]
    kv: torch.Tensor

    def to_bytes(self) -> bytes:
        dtype = str(self.kv.dtype).removeprefix("torch.")
        raw = self.kv.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        return msgpack.packb(
            [self.state, self.num_tokens, list(self.heads), dtype, list(self.kv.shape), raw], use_bin_type=True
        )

    @staticmethod
    def from_bytes(payload: bytes) -> KVExport:
        state, num_tokens, heads, dtype, shape, raw = msgpack.unpackb(payload, raw=False)
        torch_dtype = getattr(torch, dtype)
        kv = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype).view(shape)
        return KVExport(state, int(num_tokens), (int(heads[0]), int(heads[1])), kv)


def export_kv(engine: Any, request_id: str) -> KVExport:
    """Copy out a request's state and KV (e.g. a prefill worker's pinned request, for its decode worker)."""
    assert engine.group.size == 1, "export_kv reads one rank's cache: TP=1 engines only for now"
    seq = engine._seqs.get(request_id)
    if seq is None or not engine.kv.has(request_id):
        raise KeyError(f"request {request_id!r} holds no KV here")
    state = export_state(engine, seq)
    blocks = engine.kv.block_table(request_id)[: engine.kv.blocks_for(seq.num_computed_tokens)]
    cache = engine.runner.kv_cache
    index = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    kv = cache[:, :, index].cpu()
    return KVExport(state, seq.num_computed_tokens, (0, engine.runner.config.num_kv_heads), kv)


def import_request(engine: Any, export: KVExport) -> bool:
    """Adopt an exported request with its KV and continue decoding it here. False: no room now."""
    assert engine.group.size == 1, "import_request writes one rank's cache: TP=1 engines only for now"
    state = dict(export.state)
    rid = state["id"]
    if rid in engine._seqs:
        raise ValueError(f"duplicate request id {rid!r}")
    assert export.heads == (0, engine.runner.config.num_kv_heads), "the export must hold every KV head"
    block_ids = engine.kv.allocate(rid, export.num_tokens)
    if block_ids is None:
        return False
    cache = engine.runner.kv_cache
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    cache[:, :, index] = export.kv.to(device=cache.device, dtype=cache.dtype)
    # Whatever the source did with it (a prefill worker pins it), it now decodes from its first token.
    state["status"] = Status.RUNNING.value
    state["computed"] = export.num_tokens
    state["prefill_target"] = export.num_tokens
    group = Group(0, 1)
    install_state(engine, state, Placement(rid, group, group, tuple(block_ids), export.num_tokens), kv_adopted=True)
    return True


# -- P/D between two groups of one node world: the KV moves cache to cache (nitsum.node.handoff) -------------
def handoff_source(engine: Any, request_id: str) -> tuple[dict[str, Any], int, list[int]]:
    """A pinned (prefilled) request's state, its KV tokens and the blocks holding them, any TP."""
    seq = engine._seqs.get(request_id)
    if seq is None or not engine.kv.has(request_id):
        raise KeyError(f"request {request_id!r} holds no KV here")
    blocks = engine.kv.block_table(request_id)[: engine.kv.blocks_for(seq.num_computed_tokens)]
    return export_state(engine, seq), seq.num_computed_tokens, list(blocks)


def reserve_handoff(engine: Any, request_id: str, num_tokens: int) -> list[int] | None:
    """Blocks for a request about to be handed here (its KV is written into them from outside); None: no room."""
    if request_id in engine._seqs or engine.kv.has(request_id):
        raise ValueError(f"duplicate request id {request_id!r}")
    return engine.kv.allocate(request_id, num_tokens)


def drop_handoff(engine: Any, request_id: str) -> bool:
    """A reservation whose hand-off never completed: its blocks go back. False when there is none."""
    if request_id in engine._seqs:
        return False
    return engine.kv.free(request_id)


def adopt_handoff(engine: Any, state: dict[str, Any], num_tokens: int) -> None:
    """The request whose KV landed in its reserved blocks decodes here from its first token on."""
    rid = state["id"]
    if rid in engine._seqs or not engine.kv.has(rid):
        raise ValueError(f"request {rid!r} has no reservation here")
    state = dict(state)
    state["status"] = Status.RUNNING.value
    state["computed"] = num_tokens
    state["prefill_target"] = num_tokens
    blocks = tuple(engine.kv.block_table(rid))
    group = Group(0, 1)
    install_state(engine, state, Placement(rid, group, group, blocks, num_tokens), kv_adopted=True)
