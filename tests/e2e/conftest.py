"""`nitsum up` as a user runs it: a subprocess with its own NITSUM_HOME and free ports.

`live_mesh` (module scope) yields the gateway's base URL; `mesh_process` yields the details (run dir,
process) for tests that read logs and spans.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from nitsum.natsserver import free_port
from nitsum_load.mesh import stop_process


@dataclass
class Mesh:
    url: str
    run_dir: Path
    home: Path
    process: subprocess.Popen
    log_path: Path
    nats_port: int

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["NITSUM_HOME"] = str(self.home)
        return env


def start_mesh(
    tmp: Path,
    devices: int = 2,
    extra_args: tuple[str, ...] = (),
    env_extra: dict | None = None,
    ready_timeout_s: float = 150.0,
) -> Mesh:
    home = tmp / "home"
    run_dir = tmp / "run"
    port = free_port()
    env = dict(os.environ)
    env["NITSUM_HOME"] = str(home)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    env.update(env_extra or {})
    log_path = tmp / "up.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nitsum.cli",
            "up",
            "--devices",
            str(devices),
            "--port",
            str(port),
            "--run-dir",
            str(run_dir),
            "--ready-timeout",
            str(ready_timeout_s),
            *extra_args,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nitsum up exited with {process.returncode}:\n{log_path.read_text()}")
        if b"ready in" in log_path.read_bytes():
            break
        time.sleep(0.3)
    else:
        stop_mesh(process)
        raise RuntimeError(f"nitsum up did not become ready:\n{log_path.read_text()}")
    nats_port = 0
    conf = run_dir / "nats.conf"
    if conf.exists():
        nats_port = int(conf.read_text().split("listen:")[1].split("\n")[0].rsplit(":", 1)[1])
    return Mesh(url, run_dir, home, process, log_path, nats_port)


def wait_registered(mesh: Mesh, workers: int, in_world: bool = True, timeout_s: float = 120.0) -> dict:
    """Admin `status` once `workers` workers have registered (each in the node world, given `in_world`): `nitsum up`
    is ready when one worker serves, and a topology asked for before the others registered is refused. Stops the
    mesh if they never do."""
    import json

    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(
            [sys.executable, "-m", "nitsum.cli", "admin", "--timeout", "10", "status"],
            env=mesh.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        status = json.loads(out.stdout) if out.returncode == 0 else {"workers": [], "error": out.stderr[-2000:]}
        found = status.get("workers", [])
        if len(found) == workers and (not in_world or all(w["in_world"] for w in found)):
            return status
        if time.monotonic() > deadline:
            stop_mesh(mesh.process)
            raise AssertionError(f"{workers} workers never registered: {json.dumps(status)[:3000]}")
        time.sleep(0.5)


stop_mesh = stop_process  # Ctrl-C `nitsum up` as a user does; kill its process group only if it hangs


@pytest.fixture(scope="module")
def mesh_process(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("mesh"))
    yield mesh
    stop_mesh(mesh.process)


@pytest.fixture(scope="module")
def live_mesh(mesh_process) -> str:
    return mesh_process.url


def get_json(url: str, timeout_s: float = 10.0):
    import json

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.status, json.loads(resp.read())
