"""`nitsum up` supervises its children: a dead one is named and restarted; Ctrl-C leaves no orphan."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import start_mesh, stop_mesh
from tests.e2e.harness import http_get

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read().lower()
    except FileNotFoundError:
        return False


def test_dead_child_is_named_and_restarted_and_ctrl_c_stops_all(tmp_path):
    mesh = start_mesh(tmp_path, devices=2)
    try:
        pids = json.loads((mesh.run_dir / "processes.json").read_text())
        assert set(pids) == {"coordinator", "flow-scheduler", "worker-0", "worker-1", "gateway"}
        os.kill(pids["worker-1"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            log = mesh.log_path.read_text()
            new = json.loads((mesh.run_dir / "processes.json").read_text())
            if "worker-1 died (signal 9); restarting it" in log and new["worker-1"] != pids["worker-1"]:
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"no restart reported:\n{mesh.log_path.read_text()}")
        # The mesh serves again with both workers.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = http_get(mesh.url + "/ready")
            if status == 200:
                break
            time.sleep(0.3)
        assert status == 200
        children = json.loads((mesh.run_dir / "processes.json").read_text())
    finally:
        rc = stop_mesh(mesh.process)
    assert rc == 0
    assert "nitsum up: stopped" in mesh.log_path.read_text()
    assert not any(_alive(pid) for pid in children.values()), "children left running after Ctrl-C"
    # The shared-memory weight store went with the mesh.
    from nitsum.parallel.weights import DEFAULT_SHM_DIR, store_key

    model_dir = mesh.home / "models" / "tiny"
    assert not (Path(DEFAULT_SHM_DIR) / (store_key(model_dir, "float32") + ".bin")).exists()
    # and nats-server too
    assert mesh.nats_port and not any(_alive(int(p)) for p in _pids_listening(mesh.nats_port))


def _pids_listening(port: int) -> list[str]:
    """pids owning a LISTEN socket on `port` (from /proc, no extra tools)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            parts = line.split()
            if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":
                inodes.add(parts[9])
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    pids.append(pid)
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return pids


def test_bad_flags_fail_clearly(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, NITSUM_HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "nitsum.cli", "up", "--devices", "3", "--max-tp", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--max-tp" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "nitsum.cli", "up", "--model", str(tmp_path / "nope")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "does not exist" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "nitsum.cli", "serve", "gateway"],
        env={**env, "NITSUM_GATEWAY_PORT": "http"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "NITSUM_GATEWAY_PORT" in out.stderr


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def _thread_cpus(pid: int) -> set[tuple[int, ...]]:
    """The CPU sets of every thread of a process."""
    return {tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_auto_cpu_affinity_gives_the_worker_a_cpu_of_its_own(tmp_path):
    """`nitsum up --devices 1` (--cpu-affinity auto): every thread of the worker on the last CPU it may use, every
    other child (and nats-server) on the others; the mesh serves as usual."""
    from nitsum.cpus import allowed_cpus

    mesh = start_mesh(tmp_path, devices=1)
    try:
        pids = json.loads((mesh.run_dir / "processes.json").read_text())
        nats = [int(p) for p in os.listdir("/proc") if p.isdigit() and str(mesh.run_dir / "nats.conf") in _cmdline(p)]
        mine = allowed_cpus()[-1]
        rest = tuple(c for c in allowed_cpus() if c != mine)
        assert _thread_cpus(pids["worker-0"]) == {(mine,)}
        for name in ("coordinator", "flow-scheduler", "gateway"):
            assert _thread_cpus(pids[name]) == {rest}, name
        assert nats and _thread_cpus(nats[0]) == {rest}
        assert f"workers on CPU {mine}, one each" in mesh.log_path.read_text()
        status, _ = http_get(mesh.url + "/ready")
        assert status == 200
    finally:
        stop_mesh(mesh.process)
