"""One worker's runners, one per TP level it may join: built once, ahead, and shelved between changes.

Weights are views of the boot store, so a runner is modules and rope tables; on a loaded 2-core host building
one took 100-400 ms of CPU and GIL, in a thread racing the old group's decode steps and the prepare step's
exchanges. So every level's runner is built once, ahead (`build_ahead`, a thread at boot), and a runner a
change leaves goes back to the pool (`shelve`); building in a change is the fallback. A worker sits at one
aligned group per level, so (start, tp) names its runner for that level.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import torch

from nitsum.engine.params import EngineConfig
from nitsum.engine.runner import ModelRunner
from nitsum.model.model import Workspace
from nitsum.topology import Group

log = logging.getLogger("nitsum.node.runners")


class RunnerPool:
    """Builds this worker's runners and keeps the ones not in use (without a KV cache)."""

    def __init__(
        self,
        rank: int,
        cfg: EngineConfig,
        weights: dict[str, torch.Tensor],
        model_config,
        num_blocks_of: dict[int, int],
        tp_group: Callable[[Group], object],
        workspace: Workspace,
    ) -> None:
        self.rank = rank
        self.cfg = cfg
        self.weights = weights
        self.model_config = model_config
        self.num_blocks_of = num_blocks_of
        self.tp_group = tp_group
        self.workspace = workspace  # one per worker (one runner computes at a time): its pages stay warm
        self.builds = 0  # runners constructed (one per level unless a change outran `build_ahead`)
        self._idle: dict[tuple[int, int], ModelRunner] = {}
        self._lock = threading.Lock()
        self._ahead: threading.Thread | None = None

    def runner(self, group: Group, with_cache: bool = True) -> ModelRunner:
        """This worker's runner for `group`: the pooled one, else built now. `with_cache`: allocate its KV cache
        (zeros) here; else the caller attaches the one prepare made."""
        runner = self.pooled(group)
        if runner is None:
            runner = self.build(group)
            runner.workspace = self.workspace
        if with_cache and runner.kv_cache is None:
            runner.kv_cache = torch.zeros(runner.kv_cache_shape, dtype=runner.dtype, device=runner.device)
        return runner

    def pooled(self, group: Group) -> ModelRunner | None:
        """The pooled runner for `group` (without a KV cache), or None when the pool has none."""
        with self._lock:
            runner = self._idle.pop((group.start, group.tp), None)
        if runner is not None:
            runner.workspace = self.workspace
        return runner

    def build(self, group: Group) -> ModelRunner:
        cfg = self.cfg
        with self._lock:
            self.builds += 1
        runner = ModelRunner(
            cfg.model_dir,
            self.tp_group(group),
            device=cfg.device,
            dtype=cfg.dtype,
            block_size=cfg.block_size,
            num_kv_blocks=self.num_blocks_of[group.tp],
            weights=self.weights,
            config=self.model_config,
            allocate_kv_cache=False,
            decode_attention=cfg.decode_attention,
        )
        runner.node_group = (group.start, group.tp)
        return runner

    def shelve(self, runner: ModelRunner) -> None:
        """A runner no longer in use goes back to the pool, without its KV cache (the caller frees that)."""
        runner.kv_cache = None
        with self._lock:
            self._idle.setdefault(runner.node_group, runner)

    def start_ahead(self, levels: Iterable[int], current: Callable[[], Group]) -> None:
        """Boot: build the runner of every other allowed level in a thread (`current`: the group in use)."""
        self._ahead = threading.Thread(
            target=self._build_ahead, args=(sorted(levels), current), name="nitsum-runner-prebuild", daemon=True
        )
        self._ahead.start()

    def wait_ahead(self, timeout_s: float | None = None) -> None:
        """Until every level's runner is built (tests and benchmarks that want the steady state)."""
        if self._ahead is not None:
            self._ahead.join(timeout_s)

    def _build_ahead(self, levels: list[int], current: Callable[[], Group]) -> None:
        """A failure only costs the later change the build it would have done anyway."""
        for tp in levels:
            group = Group(self.rank - self.rank % tp, tp)
            with self._lock:
                if group.span == current().span or group.span in self._idle:
                    continue
            try:
                runner = self.build(group)
            except Exception:
                log.exception(
                    "worker %d: building the TP=%d runner ahead failed (a change to it builds one)", self.rank, tp
                )
                return
            with self._lock:
                self._idle.setdefault(group.span, runner)

    def forget(self, keys: Iterable[tuple[int, int]]) -> None:
        """Drop the pooled runners of these groups (their process groups are being torn down)."""
        self.wait_ahead()
        with self._lock:
            for key in keys:
                self._idle.pop(key, None)
