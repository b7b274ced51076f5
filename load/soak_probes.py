"""The soak benchmark's shell towards the mesh: the children's pids, RSS and asyncio task counts (sampled while
the soak runs), the coordinator's admin status, waiting for the mesh to be whole again, and the fault injector
(worker SIGKILL, NATS stop and restart)."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nitsum.natsserver import NatsServer
from nitsum_load.soak_core import WORKER_KILL, FaultRecord, PlannedFault, Sample

# How long to wait for a fault to heal before the window is closed at the end of the run (recovery "never").
RECOVERY_TIMEOUT_S = 90.0
ADMIN_STATUS_SUBJECT = "nitsum.admin.status"


def read_pids(run_dir: Path) -> dict[str, int]:
    """processes.json of `nitsum up` (child name -> pid); {} while it is being rewritten or absent."""
    try:
        return {str(k): int(v) for k, v in json.loads((run_dir / "processes.json").read_text()).items()}
    except (OSError, ValueError):
        return {}


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def metrics_port(pid: int) -> int | None:
    """The NITSUM_METRICS_PORT `nitsum up` gave this child (from its environment; same user, so readable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"NITSUM_METRICS_PORT="):
            port = int(item.split(b"=", 1)[1] or 0)
            return port if port > 0 else None
    return None


def parse_gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def sample_once(t_s: float, run_dir: Path, gateway_url: str, nats: NatsServer) -> list[Sample]:
    """RSS of every child and of nats-server; asyncio tasks of every service that serves /metrics."""
    out = []
    for name, pid in sorted(read_pids(run_dir).items()):
        if name == "gateway":
            url = gateway_url + "/metrics"  # the gateway serves /metrics on its API port
        else:
            port = metrics_port(pid)
            url = None if port is None else f"http://127.0.0.1:{port}/metrics"
        tasks = None
        if url is not None:
            status, text = http_get(url)
            tasks = parse_gauge(text, "nitsum_asyncio_tasks") if status == 200 else None
        out.append(Sample(t_s, name, pid, rss_mib(pid), tasks))
    if nats.process is not None and nats.process.poll() is None:
        out.append(Sample(t_s, "nats-server", nats.process.pid, rss_mib(nats.process.pid), None))
    return out


async def admin_status(nats_url: str) -> dict | None:
    """The coordinator's admin status over our (unauthenticated) NATS; None when it does not answer."""
    import nats as nats_py

    try:
        nc = await nats_py.connect(
            servers=[nats_url], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=1
        )
    except Exception:  # nats-py raises several unrelated types when the server is down  # noqa: BLE001
        return None
    try:
        msg = await nc.request(ADMIN_STATUS_SUBJECT, b"{}", timeout=1.0)
        return json.loads(msg.data)
    except Exception:  # no responders / timeout while the coordinator reconnects  # noqa: BLE001
        return None
    finally:
        await nc.close()


def ready_workers(status: dict | None) -> set[str]:
    return {w["worker_id"] for w in (status or {}).get("workers", []) if w.get("state") == "ready"}


async def wait_whole(
    nats_url: str, gateway_url: str, num_workers: int, deadline: float, gone_worker: str | None = None
) -> bool:
    """Until the mesh is whole: every worker ready and /ready 200. After a kill, first wait (a few heartbeat
    timeouts at most) for the coordinator to see the victim not ready, so a stale 'ready' entry is not taken
    for recovery."""
    loop = asyncio.get_running_loop()
    if gone_worker is not None:
        seen_gone_by = min(deadline, loop.time() + 10.0)
        while loop.time() < seen_gone_by:
            if gone_worker not in ready_workers(await admin_status(nats_url)):
                break
            await asyncio.sleep(0.2)
    while loop.time() < deadline:
        if len(ready_workers(await admin_status(nats_url))) >= num_workers:
            status, _ = await asyncio.to_thread(http_get, gateway_url + "/ready")
            if status == 200:
                return True
        await asyncio.sleep(0.25)
    return False


@dataclass
class FaultInjector:
    nats: NatsServer
    nats_url: str
    run_dir: Path
    gateway_url: str
    num_workers: int
    nats_down_s: float
    t0: float
    log_dir: Path
    records: list[FaultRecord] = field(default_factory=list)

    async def run(self, plan: Sequence[PlannedFault]) -> None:
        loop = asyncio.get_running_loop()
        for fault in plan:
            delay_s = fault.at_s - (loop.time() - self.t0)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            at_s = loop.time() - self.t0
            detail = ""
            gone = None
            if fault.kind == WORKER_KILL:
                pid = read_pids(self.run_dir).get(fault.target)
                if pid is None:
                    self.records.append(FaultRecord(fault.kind, fault.target, at_s, None, "no such child"))
                    continue
                os.kill(pid, 9)  # SIGKILL: no drain, no goodbye; `nitsum up` restarts it
                detail = f"pid {pid}"
                gone = "node0-" + fault.target.split("-", 1)[1]  # nitsum up names worker-i's id node0-i
            else:
                await asyncio.to_thread(self.nats.stop)
                await asyncio.sleep(self.nats_down_s)
                await asyncio.to_thread(self.nats.start, self.log_dir / "nats-server.log")
                detail = f"down {self.nats_down_s:g} s"
            whole = await wait_whole(
                self.nats_url, self.gateway_url, self.num_workers, loop.time() + RECOVERY_TIMEOUT_S, gone_worker=gone
            )
            rec_s = loop.time() - self.t0 if whole else None
            self.records.append(FaultRecord(fault.kind, fault.target, at_s, rec_s, detail))
            print(
                f"  fault {fault.kind} {fault.target} at {at_s:.1f} s ({detail}); "
                f"{'whole again at ' + format(rec_s, '.1f') + ' s' if whole else 'NOT recovered'}",
                flush=True,
            )


async def sampler(
    stop: asyncio.Event,
    period_s: float,
    t0: float,
    run_dir: Path,
    gateway_url: str,
    nats: NatsServer,
    out: list[Sample],
) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        out.extend(await asyncio.to_thread(sample_once, loop.time() - t0, run_dir, gateway_url, nats))
        try:
            await asyncio.wait_for(stop.wait(), timeout=period_s)
        except TimeoutError:
            pass
