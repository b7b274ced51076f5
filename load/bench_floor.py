"""`nitsum bench gateway --floor`: the floor of the hops -- what the mesh's processes and NATS hops cost with no
nitsum code on them, measured with the same client as the mesh.

Two floors, each a set of bare relay processes (`python -m nitsum_load.floor_relays ROLE ...`, load/floor_relays.py,
uvloop like the services, aiohttp and nats-py like the gateway):

- `http`: one aiohttp server; POST /v1/completions reads and parses the JSON body and answers a fixed,
  completion-shaped JSON body (client -> HTTP only).
- `relay`: the real request path's processes and hops, without their logic: a `front` (aiohttp) sends a NATS
  request of a SubmitRequest's size to `<ns>.req.submit` (queue group) where a `coord` process takes it and
  NATS-requests a `worker` process with a RunRequest-sized body; the worker answers a RunAck-sized reply and
  publishes one frame of the size of a TokenBatch with one chunk to the front's frame subject
  (`<ns>.stream.<worker>.gw.<front>`); the coord answers the front with a SubmitReply-sized reply; the front
  answers HTTP once it has both the reply and the frame. The sizes are those of nitsum's codec for the bench's
  request of `--prompt-tokens` tokens (`message_sizes`); every hop unpacks and packs msgpack, nothing else.
- `engine relay` (given a model): the relay floor with the real engine in its worker (`engine-worker`: the
  requests join the engine's next step on a step thread, one frame per request and step). The least any mesh
  with these hops and this engine spends: the engine now sees the requests the hops deliver (fewer at once than
  the in-process baseline's batches of `--concurrency`), and every process shares the cores with it.

The bench starts its own nats-server (plain, no accounts) for the relay floor. Each relay prints
`ready <port>` once it listens; one that exits or is not ready in time raises RelayError with its name and
the tail of its stderr. Every relay is stopped when the floor ends, also on an error or Ctrl-C.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nitsum_load.floor_relays import READY_TIMEOUT_S, RelayError, message_sizes

__all__ = ["RelayError", "Relays", "format_floor", "floor_result", "message_sizes", "run_floors", "tree_cpu_s"]


class Relays:
    """The relay processes of one floor; `with Relays(dir) as r:` stops every one of them on the way out."""

    def __init__(self, run_dir: Path, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.run_dir = run_dir
        self.ready_timeout_s = ready_timeout_s
        self.procs: list[tuple[str, subprocess.Popen]] = []
        run_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Relays:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, role: str, *extra: str) -> int:
        """Start one relay; returns its HTTP port (0 for a relay without one) once it is ready."""
        out, err = self.run_dir / f"{role}.out", self.run_dir / f"{role}.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nitsum_load.floor_relays", role, *extra],
                stdout=o,
                stderr=e,
                start_new_session=True,  # a terminal's Ctrl-C reaches the bench, which stops it
            )
        self.procs.append((role, proc))
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            for line in out.read_text(errors="replace").splitlines():
                if line.startswith("ready "):
                    return int(line.split()[1])
            if proc.poll() is not None:
                raise RelayError(
                    f"floor relay {role!r} exited with {proc.returncode} before it was ready:\n{_tail(err)}"
                )
            if time.monotonic() > deadline:
                raise RelayError(f"floor relay {role!r} was not ready within {self.ready_timeout_s:g} s:\n{_tail(err)}")
            time.sleep(0.05)

    def stop(self) -> None:
        from nitsum_load.mesh import stop_process

        while self.procs:
            stop_process(self.procs.pop()[1], timeout_s=5.0)


def _tail(path: Path, chars: int = 2000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:] if text.strip() else "(its stderr is empty)"


def tree_cpu_s(root: int | None = None) -> float | None:
    """CPU seconds (user + system) used so far by process `root` (this one by default) and every live descendant
    (Linux /proc; None elsewhere). A phase's CPU is the difference of two readings: the bench's client, and the
    relays, nats-server or the mesh it started."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ... utime stime
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    if root not in cpu:
        return None
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu[pid] for pid in tree)


def size_args(sizes: dict[str, int]) -> list[str]:
    return [a for name, n in sizes.items() for a in (f"--{name.replace('_', '-')}-bytes", str(n))]


def run_floors(
    measure: Callable[[str], dict],
    run_dir: Path,
    sizes: dict[str, int],
    timeout_s: float,
    per_token: Callable[[str], Any] | None = None,
    model: str = "",
) -> dict:
    """Measure the http floor, then the relay floor (on a nats-server of its own), one after the other; then, with
    `per_token`, its streams through the same relays (under "per_token"); then, given `model`, the engine relay
    floor (the same relays, the worker running that model's engine)."""
    from nitsum.natsserver import NatsServer, free_port

    floors: dict[str, dict] = {}
    with Relays(run_dir / "http") as relays:
        port = relays.start("http")
        print(f"http floor on port {port}: the same requests ...", flush=True)
        floors["http"] = measure(f"http://127.0.0.1:{port}")
    nats = NatsServer(port=free_port(), config_path=None).start(log_path=run_dir / "nats.log")
    try:
        with Relays(run_dir / "relay") as relays:
            common = ["--nats", nats.url, "--timeout", str(timeout_s), *size_args(sizes)]
            relays.start("worker", *common)
            relays.start("coord", *common)
            port = relays.start("front", *common)
            print(f"relay floor on port {port} (front -> coord -> worker over NATS): the same requests ...", flush=True)
            floors["relay"] = measure(f"http://127.0.0.1:{port}")
            if per_token is not None:
                print("per-token floor: streams through the same relays ...", flush=True)
                floors["per_token"] = per_token(f"http://127.0.0.1:{port}")
        for name, inline in (("engine_relay", ()), ("engine_relay_inline", ("--step-inline",))) if model else ():
            with Relays(run_dir / name, ready_timeout_s=max(READY_TIMEOUT_S, timeout_s)) as relays:
                relays.start("engine-worker", *common, "--model", model, *inline)
                relays.start("coord", *common)
                port = relays.start("front", *common)
                where = "on the event loop" if inline else "on a step thread"
                print(f"engine relay floor on port {port} (its worker steps the engine {where}) ...", flush=True)
                floors[name] = measure(f"http://127.0.0.1:{port}")
                floors[name]["engine_steps"] = engine_steps(nats.url)
    finally:
        nats.stop()
    return floors


def engine_steps(nats_url: str) -> dict:
    """The engine relay worker's counters: steps, requests that joined them, outputs (one per request stepped)."""
    import asyncio

    import msgpack
    import nats as nats_py

    from nitsum_load.floor_relays import STATS_SUBJECT

    async def ask() -> dict:
        nc = await nats_py.connect(servers=[nats_url])
        try:
            return msgpack.unpackb((await nc.request(STATS_SUBJECT, b"", timeout=10)).data)
        finally:
            await nc.close()

    return asyncio.run(ask())


def throughput_batch(steps: dict, sequential: int) -> float | None:
    """Mean outputs per step of the throughput phase: the latency phase before it sent `sequential` 1-token
    requests one at a time, each a step of one output of its own, so they come off both counters."""
    n = steps["steps"] - sequential
    return (steps["outputs"] - sequential) / n if n > 0 else None


def floor_result(
    compare, engine: dict, floors: dict, gateway: dict | None, sizes: dict[str, int], warmup: int = 0
) -> dict:
    """The floor rows beside the mesh's (when it ran); `compare` is bench_gateway.compare.

    The http and relay floors run no engine, so all of their latency is added latency: their `added_latency_*` is
    their own latency (what the hops alone cost), where the engine relay's and the mesh's is their latency minus
    the in-process engine's, as the bench reports it. Throughput ratios are all to the in-process engine."""
    rows: dict[str, dict] = {}
    for name, measured in (*floors.items(), *((("mesh", gateway),) if gateway is not None else ())):
        c = compare(engine, measured)
        lat = c["gateway_latency_ms"]
        has_engine = name in ("mesh", "engine_relay", "engine_relay_inline")
        rows[name] = {
            "latency_ms": lat,
            "added_latency_p50_ms": c["added_latency_p50_ms"] if has_engine else lat["p50"],
            "added_latency_p90_ms": c["added_latency_p90_ms"] if has_engine else lat["p90"],
            "requests_per_s": c["gateway_requests_per_s"],
            "throughput_ratio": c["throughput_ratio"],
            "throughput_cpu_ms_per_request": measured.get("throughput_cpu_ms_per_request"),
        }
        if "engine_steps" in measured:
            sequential = len(measured["latency_ms"]) + warmup
            rows[name]["engine_steps"] = measured["engine_steps"]
            rows[name]["throughput_batch"] = throughput_batch(measured["engine_steps"], sequential)
    out: dict[str, Any] = {
        "rows": rows,
        "engine_throughput_cpu_ms_per_request": engine.get("throughput_cpu_ms_per_request"),
        "message_bytes": sizes,
    }
    e_cpu, r_cpu = out["engine_throughput_cpu_ms_per_request"], rows["relay"]["throughput_cpu_ms_per_request"]
    if e_cpu and r_cpu:
        # Every core busy, nothing else running: the engine's CPU per request plus the relay floor's (hops,
        # nats-server and this client) is the least any mesh with these hops spends per request here.
        bound = (os.cpu_count() or 1) * 1000.0 / (e_cpu + r_cpu)
        out["cpu_bound"] = {
            "cpus": os.cpu_count(),
            "requests_per_s": bound,
            "ratio": bound / engine["requests_per_s"],
        }
    if "mesh" in rows:
        out["own_code_added_p50_ms"] = rows["mesh"]["added_latency_p50_ms"] - rows["relay"]["added_latency_p50_ms"]
        out["own_code_added_p90_ms"] = rows["mesh"]["added_latency_p90_ms"] - rows["relay"]["added_latency_p90_ms"]
    return out


def format_floor(engine_latency: dict, engine_rps: float, floor: dict) -> str:
    labels = {
        "http": "http floor (aiohttp only)",
        "relay": "relay floor (3 procs, NATS)",
        "engine_relay": "relay floor + engine (thread)",
        "engine_relay_inline": "relay floor + engine (inline)",
        "mesh": "mesh (nitsum up)",
    }
    lines = [
        "floor of the hops              p50 (ms)   p90 (ms)   added p50   requests/s   / engine",
        f"{'in-process engine':29s} {engine_latency['p50']:9.2f}  {engine_latency['p90']:9.2f}  {'':>10s}"
        f"  {engine_rps:11.1f}   {1.0:7.2f}x",
    ]
    for name, row in floor["rows"].items():
        lines.append(
            f"{labels[name]:29s} {row['latency_ms']['p50']:9.2f}  {row['latency_ms']['p90']:9.2f}"
            f"  {row['added_latency_p50_ms']:+10.2f}  {row['requests_per_s']:11.1f}   {row['throughput_ratio']:7.2f}x"
        )
    if "cpu_bound" in floor:
        b = floor["cpu_bound"]
        lines.append(
            f"CPU per request at concurrency: engine {floor['engine_throughput_cpu_ms_per_request']:.2f} ms, "
            + ", ".join(
                f"{name} {row['throughput_cpu_ms_per_request']:.2f} ms"
                for name, row in floor["rows"].items()
                if row["throughput_cpu_ms_per_request"] is not None
            )
            + f"; engine + relay floor on all {b['cpus']} cores: at most {b['requests_per_s']:.0f} requests/s"
            f" ({b['ratio']:.2f}x the engine)"
        )
    batches = [
        f"{labels[name]} {row['throughput_batch']:.1f}"
        for name, row in floor["rows"].items()
        if row.get("throughput_batch") is not None
    ]
    if batches:
        lines.append(
            f"requests per engine step at concurrency: in-process {floor.get('concurrency', '?')}, "
            + ", ".join(batches)
        )
    if "own_code_added_p50_ms" in floor:
        lines.append(
            f"nitsum's own code adds (mesh - relay floor): p50 {floor['own_code_added_p50_ms']:+.2f} ms, "
            f"p90 {floor['own_code_added_p90_ms']:+.2f} ms"
        )
    return "\n".join(lines)
