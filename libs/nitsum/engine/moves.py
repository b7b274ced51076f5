"""The half of `Engine` (engine.py) that moves requests between engines: a request's KV exported and
imported (P/D at TP=1), handed off between groups of one node world, every request's state read and
installed across a TP change, and stage-1 cached prefix blocks. A mixin of `Engine`, which owns the state
it works on (`_seqs`, `kv`, `runner`, `scheduler`, `tokenizer`, `guides`)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from nitsum.engine import migration, request_state
from nitsum.engine.migration import KVExport
from nitsum.engine.sequence import Sequence, Status
from nitsum.kv.reshard import Placement, RequestKV
from nitsum.topology import Group


class RequestMoves:
    # -- moving a request between engines (P/D; TP changes use the same code, see nitsum.node.runtime) -----
    def export_kv(self, request_id: str) -> KVExport:
        """The request's state and its computed KV; the request stays here until `release`/`abort`. TP=1."""
        assert self.group.size == 1, "export_kv reads one rank's cache: TP=1 engines only for now"
        seq = self._seqs.get(request_id)
        if seq is None or not self.kv.has(request_id):
            raise KeyError(f"request {request_id!r} holds no KV here")
        blocks = self.kv.block_table(request_id)[: self.kv.blocks_for(seq.num_computed_tokens)]
        kv = migration.gather_blocks(self.runner.kv_cache, blocks)
        return KVExport(self._state_of(seq), seq.num_computed_tokens, (0, self.runner.config.num_kv_heads), kv)

    def import_request(self, export: KVExport) -> bool:
        """Adopt a request exported by another engine (prompt + first token, KV of the prompt) and decode
        it from there. False when the KV pool has no room now. TP=1 engines."""
        assert self.group.size == 1, "import_request writes one rank's cache: TP=1 engines only for now"
        state = dict(export.state)
        rid = state["id"]
        if rid in self._seqs:
            raise ValueError(f"duplicate request id {rid!r}")
        assert export.heads == (0, self.runner.config.num_kv_heads), "the export must hold every KV head"
        block_ids = self.kv.allocate(rid, export.num_tokens)
        if block_ids is None:
            return False
        migration.scatter_blocks(self.runner.kv_cache, block_ids, export.kv)
        # Whatever the source did with it (a prefill worker pins it), it now decodes from its first token.
        state.update(status=Status.RUNNING.value, computed=export.num_tokens, prefill_target=export.num_tokens)
        group = Group(0, 1)
        placement = Placement(rid, group, group, tuple(block_ids), export.num_tokens)
        self.install_state(state, placement, kv_adopted=True)
        return True

    # -- P/D between groups of one node world (any TP: the KV moves cache to cache, nitsum.node.handoff) ---
    def handoff_source(self, request_id: str) -> tuple[dict, int, list[int]]:
        """(state, KV tokens, the blocks holding them) of a pinned request about to be handed off; any TP."""
        seq = self._seqs.get(request_id)
        if seq is None or not self.kv.has(request_id):
            raise KeyError(f"request {request_id!r} holds no KV here")
        blocks = self.kv.block_table(request_id)[: self.kv.blocks_for(seq.num_computed_tokens)]
        return self._state_of(seq), seq.num_computed_tokens, list(blocks)

    def reserve_handoff(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for a request handed here (its KV is written into them from outside); None: no room now."""
        if request_id in self._seqs or self.kv.has(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        return self.kv.allocate(request_id, num_tokens)

    def drop_handoff(self, request_id: str) -> bool:
        """Free a reservation whose hand-off did not complete. False when there is none."""
        if request_id in self._seqs:
            return False
        return self.kv.free(request_id)

    def adopt_handoff(self, state: dict, num_tokens: int) -> None:
        """Decode a handed-off request whose KV was written into its reserved blocks, from its first token on."""
        rid = state["id"]
        if rid in self._seqs or not self.kv.has(rid):
            raise ValueError(f"request {rid!r} has no reservation here")
        state = {**state, "status": Status.RUNNING.value, "computed": num_tokens, "prefill_target": num_tokens}
        group = Group(0, 1)
        placement = Placement(rid, group, group, tuple(self.kv.block_table(rid)), num_tokens)
        self.install_state(state, placement, kv_adopted=True)

    # -- request state: what a TP change reads and installs (nothing outside engine/ reads its fields) --------
    def _in_order(self) -> list[Sequence]:
        """Running (in scheduling order), then waiting (queue order), then pinned."""
        sched = self.scheduler
        return [*sched.running, *sched.waiting, *sched.pinned.values()]

    def _state_of(self, seq: Sequence) -> dict:
        return request_state.state_of(seq, self.scheduler.prefill_target(seq.request_id), self.now_ms())

    def request_ids(self) -> list[str]:
        """Every request this engine holds (running, waiting or pinned)."""
        return list(self._seqs)

    def num_output_tokens(self) -> dict[str, int]:
        """request id -> tokens it has generated so far."""
        return {rid: seq.num_output_tokens for rid, seq in self._seqs.items()}

    def request_limits(self) -> dict[str, tuple[int, int, float]]:
        """request id -> (prompt tokens, max_tokens, TPOT target ms or 0.0) as this engine runs it (a re-submitted
        request's prompt holds the tokens it had streamed before; its max_tokens is what was left then)."""
        return {
            rid: (len(seq.prompt_token_ids), seq.params.max_tokens, seq.slo.tpot_ms if seq.slo is not None else 0.0)
            for rid, seq in self._seqs.items()
        }

    def num_preemptions(self, request_id: str) -> int | None:
        """How often the request was preempted; None when this engine does not hold it."""
        seq = self._seqs.get(request_id)
        return seq.num_preemptions if seq is not None else None

    def preemption_counts(self) -> dict[str, int]:
        """request id -> preemptions, for every request in scheduling order."""
        return {s.request_id: s.num_preemptions for s in self._in_order()}

    def export_state(self, request_id: str) -> dict:
        """One request's full state (a msgpack-ready dict: `request_state.state_of`). KeyError if not here."""
        return self._state_of(self._seqs[request_id])

    def export_states(self) -> list[dict]:
        """Every request's full state, in scheduling order."""
        return [self._state_of(s) for s in self._in_order()]

    def snapshot_kv(self, group: Group) -> list[RequestKV]:
        """Every request's block table and computed tokens, as `group` holds them, in scheduling order."""
        kv = self.kv
        return [
            RequestKV(
                s.request_id,
                group,
                s.num_computed_tokens if kv.has(s.request_id) else 0,
                tuple(kv.block_table(s.request_id)) if kv.has(s.request_id) else (),
            )
            for s in self._in_order()
        ]

    def install_states(self, states: SequenceABC[dict], placements: dict[str, Placement]) -> None:
        """Adopt moved requests (`export_states` of the old engines), in order, with the tables the plan chose.
        A request placed with `recompute` re-queues like a preempted one."""
        for state in states:
            self.install_state(state, placements.get(state["id"]))

    def install_state(self, state: dict, placement: Placement | None, kv_adopted: bool = False) -> None:
        """Adopt one request; `kv_adopted`: its table is already allocated in `self.kv`."""
        rid = state["id"]
        if rid in self._seqs:
            raise ValueError(f"duplicate request id {rid!r}")
        seq = request_state.sequence_of(state, self._arrivals, self.tokenizer, self.guides, self.now_ms())
        self._arrivals += 1
        status = Status(state["status"])
        has_kv = placement is not None and not placement.recompute and bool(placement.dst_block_ids)
        if status in (Status.RUNNING, Status.PINNED) and has_kv:
            assert placement is not None
            assert placement.num_moved_tokens == state["computed"], (
                f"{rid}: {placement.num_moved_tokens} KV tokens moved but {state['computed']} computed"
            )
            if not kv_adopted:
                self.kv.adopt(rid, placement.dst_block_ids)
            seq.num_computed_tokens = state["computed"]
            self.kv.commit(rid, seq.token_ids, seq.num_computed_tokens)
            seq.status = status
        elif status is Status.WAITING:
            seq.status = Status.WAITING
        else:
            # No KV came along (no room in the new pool): recompute, as after a preemption.
            seq.num_computed_tokens = 0
            seq.num_preemptions += 1
            seq.status = Status.WAITING
        self._seqs[rid] = seq
        self.scheduler.adopt(seq, state["prefill_target"])

    # -- stage-1 KV reuse: cached prefix blocks between engines ------------------------------------------
    def export_cached_blocks(self, block_hashes: list[int]):
        """(hashes found, KV [layers, K/V, n, block_size, kv_heads, head_dim] on CPU) for the longest leading
        run of `block_hashes` this engine has cached. TP=1 engines."""
        assert self.group.size == 1, "export_cached_blocks reads one rank's cache: TP=1 engines only"
        block_ids = self.kv.cached_prefix(block_hashes)
        return list(block_hashes[: len(block_ids)]), migration.gather_blocks(self.runner.kv_cache, block_ids)

    def import_cached_blocks(self, block_hashes: list[int], kv) -> int:
        """Adopt another engine's cached prefix blocks (`kv` as `export_cached_blocks` returns it) into this
        engine's prefix cache, so a later request with that prefix computes only the rest. Blocks already
        cached here are skipped; stops when the pool is full. Returns the number of blocks written."""
        assert self.group.size == 1, "import_cached_blocks writes one rank's cache: TP=1 engines only"
        assert kv.shape[2] == len(block_hashes), f"{kv.shape[2]} blocks of KV for {len(block_hashes)} hashes"
        reserved = self.kv.reserve_import(block_hashes)
        if not reserved:
            return 0
        migration.scatter_blocks(self.runner.kv_cache, [b for _, b in reserved], kv, [p for p, _ in reserved])
        self.kv.finish_import([b for _, b in reserved])
        return len(reserved)
