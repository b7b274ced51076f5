"""Start and stop a local `nitsum up` for benchmarks that measure the live mesh.

The mesh runs as a subprocess in its own session (process group) on a free port, exactly as a user starts it;
`LocalMesh.stop()` sends Ctrl-C (SIGINT) and, if it does not exit in time, kills that process group only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalMesh:
    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self, timeout_s: float = 30.0) -> int:
        return stop_process(self.process, timeout_s)


def stop_process(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """Ctrl-C, as a user stops `nitsum up`; kills its process group only if it does not exit in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return int(process.returncode)


def start_mesh(
    run_dir: Path, *, devices: int = 1, extra_args: tuple[str, ...] = (), ready_timeout_s: float = 150.0
) -> LocalMesh:
    """`nitsum up --devices N` on a free port; returns once it prints that it is ready (raises otherwise)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = run_dir / "up.log"
    with log_path.open("wb") as log:
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
                str(run_dir / "run"),
                "--ready-timeout",
                str(ready_timeout_s),
                *extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    mesh = LocalMesh(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + ready_timeout_s + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nitsum up exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        if b"ready in" in log_path.read_bytes():
            return mesh
        time.sleep(0.3)
    mesh.stop()
    raise RuntimeError(f"nitsum up was not ready within {ready_timeout_s} s:\n{log_path.read_text()[-3000:]}")


def run_all(argvs, timeout_s: float) -> tuple[list[int], list[str]]:
    """Run one process per argv together (a TP group or a node world: gloo on loopback, one torch thread each)
    until all exit; whatever is left at a timeout or an error is killed. Returns (exit codes, logs), argv order."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for argv in argvs]
    logs: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            logs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [int(p.returncode) for p in procs], logs
