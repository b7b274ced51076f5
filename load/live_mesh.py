"""A live `nitsum up` for the mesh-level benchmarks (bench reconfigure, bench policy --live / --phased): start it,
wait for its workers, call its admin subjects, read its metrics, make its model, remove its weight store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from nitsum.natsserver import free_port
from nitsum.wire.subjects import Subjects
from nitsum_load.mesh import stop_process

# The ~27M-parameter random Llama of the live policy test: big enough that a weight reload costs something.
MID_OVERRIDES = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
ADMIN_TIMEOUT_S = 120.0


def _http_status(url: str, timeout_s: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


@dataclass
class LiveMesh:
    """One `nitsum up` in its own session (process group) with its own NITSUM_HOME, on our nats-server."""

    url: str
    nats_url: str
    process: subprocess.Popen
    log_path: Path
    run_dir: Path
    started_monotonic: float
    ready_ms: float = 0.0  # process start -> /ready 200
    workers_ready_ms: float = 0.0  # process start -> the coordinator lists every worker ready
    extra: dict = field(default_factory=dict)

    def stop(self, timeout_s: float = 30.0) -> float:
        """Ctrl-C, as a user stops it; kills the process group only if it does not exit. Returns ms taken."""
        t0 = time.monotonic()
        stop_process(self.process, timeout_s)
        return (time.monotonic() - t0) * 1000.0

    def coordinator_metrics_url(self) -> str | None:
        """The coordinator's /metrics: its pid from processes.json, its port from its environment (Linux)."""
        try:
            pid = json.loads((self.run_dir / "processes.json").read_text())["coordinator"]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, KeyError, ValueError):
            return None
        for item in environ:
            if item.startswith(b"NITSUM_METRICS_PORT="):
                return f"http://127.0.0.1:{int(item.split(b'=', 1)[1])}/metrics"
        return None


async def admin_call(nats_url: str, command: str, body: dict, timeout_s: float = ADMIN_TIMEOUT_S, nc=None) -> dict:
    """One admin-plane request (JSON) on our unauthenticated nats-server; on `nc` when given (an open
    connection, so a timed call does not include connecting)."""
    import nats

    own = nc is None
    if own:
        nc = await nats.connect(servers=[nats_url], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
    try:
        msg = await nc.request(Subjects().admin(command), json.dumps(body).encode(), timeout=timeout_s)
        return json.loads(msg.data)
    finally:
        if own:
            await nc.close()


def _ready_workers(nats_url: str) -> int:
    try:
        status = asyncio.run(admin_call(nats_url, "status", {}, timeout_s=2.0))
    except Exception:  # nats-py raises several unrelated types while the coordinator starts  # noqa: BLE001
        return 0
    return sum(1 for w in status.get("workers", []) if w.get("state") == "ready")


def start_live_mesh(
    work: Path,
    *,
    model_dir: Path,
    nats_url: str,
    devices: int = 4,
    policy: str = "adaptive",
    env_extra: dict[str, str] | None = None,
    ready_timeout_s: float = 180.0,
) -> LiveMesh:
    """`nitsum up --devices N --nats URL --model DIR --policy P` on a free port; returns once /ready answers
    200 and the coordinator lists every worker ready (raises RuntimeError with the log tail otherwise)."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = work / "up.log"
    env = dict(os.environ)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    env["NITSUM_HOME"] = str(work / "home")  # current.json and the like stay inside the benchmark's folder
    env.update(env_extra or {})
    cmd = [
        sys.executable,
        "-m",
        "nitsum.cli",
        "up",
        "--devices",
        str(devices),
        "--port",
        str(port),
        "--nats",
        nats_url,
        "--model",
        str(model_dir),
        "--policy",
        policy,
        "--run-dir",
        str(work / "run"),
        "--ready-timeout",
        str(ready_timeout_s),
    ]
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    mesh = LiveMesh(f"http://127.0.0.1:{port}", nats_url, process, log_path, work / "run", t0)
    deadline = t0 + ready_timeout_s + 10
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"nitsum up exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nitsum up not ready within {ready_timeout_s} s:\n{log_path.read_text()[-3000:]}")
            if not mesh.ready_ms and _http_status(mesh.url + "/ready", 10.0) == 200:
                mesh.ready_ms = (time.monotonic() - t0) * 1000.0
            if mesh.ready_ms and _ready_workers(nats_url) >= devices:
                mesh.workers_ready_ms = (time.monotonic() - t0) * 1000.0
                return mesh
            time.sleep(0.1)  # each /ready probe is a real 1-token generation: do not flood the mesh
    except BaseException:
        mesh.stop()
        raise


def remove_weight_store(model_dir: Path, dtype: str = "float32") -> list[str]:
    """Delete the model's shared-memory weight store (the next worker boot reads the checkpoint again)."""
    from nitsum.parallel.weights import DEFAULT_SHM_DIR, store_key

    key = store_key(model_dir, dtype)
    removed = []
    for suffix in (".json", ".bin", ".lock"):
        path = Path(DEFAULT_SHM_DIR) / f"{key}{suffix}"
        if path.exists():
            path.unlink()
            removed.append(path.name)
    return removed


def weight_store_bytes(model_dir: Path, dtype: str = "float32") -> int:
    from nitsum.parallel.weights import DEFAULT_SHM_DIR, store_key

    path = Path(DEFAULT_SHM_DIR) / f"{store_key(model_dir, dtype)}.bin"
    return path.stat().st_size if path.exists() else 0


def histogram_sums(metrics_text: str, name: str) -> dict[str, dict[str, float]]:
    """{phase: {"sum": ms, "count": n}} of a Prometheus histogram labelled by phase."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        for kind in ("sum", "count"):
            prefix = f"{name}_{kind}{{"
            if line.startswith(prefix) and 'phase="' in line:
                phase = line.split('phase="', 1)[1].split('"', 1)[0]
                out.setdefault(phase, {})[kind] = float(line.rsplit(" ", 1)[1])
    return out


def make_model(kind: str, work: Path) -> Path:
    """'tiny' / 'mid': a fresh deterministic random Llama in `work`; anything else: an existing directory."""
    from nitsum.model.tiny import make_tiny

    if kind == "tiny":
        return Path(make_tiny(work / "tiny"))
    if kind == "mid":
        return Path(make_tiny(work / "mid", config_overrides=MID_OVERRIDES))
    path = Path(kind)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model: {kind!r} is neither tiny, mid nor a model directory")
    return path
