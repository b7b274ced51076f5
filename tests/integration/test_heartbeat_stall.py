"""A stall of the coordinator, of nats-server or of the whole machine is not taken for silent workers (real
nats-server, real coordinator process, frozen with SIGSTOP for longer than the heartbeat timeout).

The workers are heartbeat publishers in the test process (the coordinator knows a worker only by its WorkerStats
on NATS, so a worker whose heartbeats stop is, to it, a killed worker); in the "machine" case they pause too.
One of them dies during the stall: it must still be announced lost, and it must be the only one.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from nitsum.bus import Bus
from nitsum.config import CommonConfig
from nitsum.wire.messages import WorkerLost, WorkerStats
from tests.e2e.harness import ManualMesh

TIMEOUT_MS = 1000
INTERVAL_S = 0.2
STALL_S = 2.5  # well over the heartbeat timeout
WORKERS = ("node0-0", "node0-1", "node0-2")
VICTIM = "node0-2"


def _stats(worker_id: str, device: int) -> WorkerStats:
    return WorkerStats(
        worker_id,
        "node0",
        device,
        "cpu",
        "hybrid",
        "ready",
        worker_id,
        1,
        "tiny",
        2048,
        0,
        0,
        10,
        10,
        instance_id=f"{worker_id}-i",
    )


async def _heartbeats(bus: Bus, stats: WorkerStats, running: asyncio.Event) -> None:
    while True:
        await running.wait()
        await bus.publish(bus.subjects.worker_stats, stats)
        await asyncio.sleep(INTERVAL_S)


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _known_workers(bus: Bus) -> list[str]:
    try:
        status = await bus.request_json(bus.subjects.admin("status"), {}, 2.0)
    except Exception:  # the coordinator is still starting
        return []
    return sorted(w["worker_id"] for w in status.get("workers", []))


@pytest.mark.parametrize("frozen", ["coordinator", "nats-server", "machine"])
async def test_a_stall_is_not_taken_for_silent_workers(nats_server, tmp_path, tiny_model_dir, frozen):
    mesh = ManualMesh(
        tmp_path,
        tiny_model_dir,
        num_workers=0,
        env_extra={"NITSUM_HEARTBEAT_TIMEOUT_MS": str(TIMEOUT_MS), "NITSUM_POLICY": "static-hybrid"},
    )
    mesh.nats = nats_server
    coordinator = mesh.add("coordinator", "coordinator").start()
    bus = await Bus.connect(CommonConfig(nats_url=nats_server.url), "test-workers")
    lost: list[str] = []

    async def on_lost(msg: WorkerLost, _delivery) -> None:
        lost.append(msg.worker_id)

    running = asyncio.Event()
    running.set()
    beats = {w: asyncio.create_task(_heartbeats(bus, _stats(w, i), running)) for i, w in enumerate(WORKERS)}
    targets = {
        "coordinator": [coordinator.process],
        "nats-server": [nats_server.process],
        "machine": [coordinator.process, nats_server.process],
    }[frozen]

    def freeze(sig: int) -> None:
        for process in targets:
            process.send_signal(sig)
        if frozen == "machine" and sig == signal.SIGSTOP:
            running.clear()
        elif frozen == "machine":  # the workers' next beats come an interval after the coordinator is back
            asyncio.get_running_loop().call_later(INTERVAL_S, running.set)

    try:
        await bus.subscribe(bus.subjects.worker_lost, on_lost, expected=WorkerLost)
        known: list[str] = []

        async def poll() -> bool:
            known[:] = await _known_workers(bus)
            return known == sorted(WORKERS)

        deadline = asyncio.get_running_loop().time() + 60.0
        while not await poll():
            assert coordinator.process.poll() is None, coordinator.log_path.read_text()[-3000:]
            assert asyncio.get_running_loop().time() < deadline, f"the coordinator knows {known}"
            await asyncio.sleep(0.2)
        await asyncio.sleep(2 * TIMEOUT_MS / 1000.0)  # settled: nobody is lost while all beat
        assert lost == []

        freeze(signal.SIGSTOP)
        try:
            await asyncio.sleep(0.3)
            beats.pop(VICTIM).cancel()  # dies during the stall
            await asyncio.sleep(STALL_S - 0.3)
        finally:
            freeze(signal.SIGCONT)

        await _until(lambda: VICTIM in lost, f"{VICTIM} to be announced lost")
        # The others keep beating; a loss caused by the stall would have been announced by now, or shortly.
        await asyncio.sleep(2 * TIMEOUT_MS / 1000.0)
        log = coordinator.log_path.read_text()
        assert lost == [VICTIM], log[-3000:]
        assert await _known_workers(bus) == sorted(set(WORKERS) - {VICTIM})
    finally:
        freeze(signal.SIGCONT)
        for task in beats.values():
            task.cancel()
        await bus.drain()
        mesh.stop()
