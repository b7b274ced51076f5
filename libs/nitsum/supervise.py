"""The child processes of `nitsum up` (up.py): each service started as `nitsum serve NAME` with its log, dying
with its parent; readiness awaited at the gateway's /ready (a child whose probed metrics port was taken
meanwhile starts again on another); a child that dies restarted at most 3 times a minute; all stopped at
the end, the gateway first. The pids go to run_dir/processes.json."""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from nitsum.natsserver import free_port

MAX_RESTARTS_PER_MINUTE = 3


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    service: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)
    port_retries: int = 0  # restarts because another process took the port `nitsum up` probed for it

    def start(self) -> None:
        log = open(self.log_path, "ab")
        log.write(f"\n--- nitsum up: starting {self.name} ({time.strftime('%H:%M:%S')}) ---\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nitsum.cli", "serve", self.service],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        log.close()

    def tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])


def _ready(url: str, api_key: str) -> tuple[bool, str]:
    req = urllib.request.Request(url + "/ready")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status == 200, ""
    except urllib.error.HTTPError as exc:
        return False, exc.read().decode(errors="replace")[:200]
    except (urllib.error.URLError, OSError) as exc:
        return False, str(exc)


MAX_PORT_RETRIES = 3


def metrics_port_taken(child: Child) -> bool:
    """The child could not start because the metrics port `nitsum up` probed for it was taken meanwhile (a
    probe cannot reserve a port: another program can bind it between the probe and the child's bind)."""
    port = child.env.get("NITSUM_METRICS_PORT", "0")
    tail = child.tail(20)
    return port != "0" and "address already in use" in tail and f", {port})" in tail


def _wait_ready(
    children: list[Child], url: str, api_key: str, timeout_s: float, stopping: dict, run_dir: Path | None = None
) -> int:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline and not stopping["flag"]:
        for child in children:
            if child.process.poll() is not None and metrics_port_taken(child) and child.port_retries < MAX_PORT_RETRIES:
                child.port_retries += 1
                old, new = child.env["NITSUM_METRICS_PORT"], str(free_port())
                child.env = {**child.env, "NITSUM_METRICS_PORT": new}
                print(
                    f"nitsum up: {child.name}: another process took its metrics port {old}; starting it again on {new}",
                    file=sys.stderr,
                    flush=True,
                )
                child.start()
                if run_dir is not None:
                    write_pids(children, run_dir)
            if child.process.poll() is not None:
                print(
                    f"nitsum up: {child.name} exited with code {child.process.returncode} while starting; its log ({child.log_path}):\n{child.tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        ok, last = _ready(url, api_key)
        if ok:
            return 0
        time.sleep(0.5)
    if stopping["flag"]:
        return 130
    print(
        f"nitsum up: not ready after {timeout_s:.0f} s ({last}); logs in {children[0].log_path.parent}",
        file=sys.stderr,
        flush=True,
    )
    return 1


def write_pids(children: list[Child], run_dir: Path) -> None:
    """run_dir/processes.json: child name -> pid (operators and the fault tests use it)."""
    pids = {c.name: c.process.pid for c in children if c.process is not None}
    tmp = run_dir / "processes.json.tmp"
    tmp.write_text(json.dumps(pids))
    tmp.replace(run_dir / "processes.json")


def _supervise(children: list[Child], stopping: dict, run_dir: Path) -> int:
    while not stopping["flag"]:
        for child in children:
            status = child.process.poll()
            if status is None:
                continue
            why = f"signal {-status}" if status < 0 else f"exit code {status}"
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < 60.0]
            if len(child.restarts) >= MAX_RESTARTS_PER_MINUTE:
                print(
                    f"nitsum up: {child.name} died again ({why}); {MAX_RESTARTS_PER_MINUTE} restarts in a minute — stopping everything. Its log:\n{child.tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            print(
                f"nitsum up: {child.name} died ({why}); restarting it. Last lines of {child.log_path}:\n{child.tail()}",
                file=sys.stderr,
                flush=True,
            )
            child.restarts.append(now)
            if child.env.get("NITSUM_NODE_SIZE", "0") != "0":
                # A process world cannot take a member back: the restarted worker boots in standby (TP=1 on the
                # node's shared weights) and the coordinator re-forms the node's world (a new generation)
                # once every worker of the node is back at TP=1; TP changes on the node resume then.
                child.env = {**child.env, "NITSUM_NODE_STANDBY": "1"}
                print(
                    f"nitsum up: {child.name} rejoins standalone (TP=1); run-time TP changes on this node resume once the coordinator has re-formed its node world",
                    file=sys.stderr,
                    flush=True,
                )
            child.start()
            write_pids(children, run_dir)
        time.sleep(0.5)
    return 0


def _stop_all(children: list[Child], timeout_s: float = 15.0) -> None:
    for child in reversed(children):  # gateway first: it stops taking requests before workers go
        if child.process is not None and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"nitsum up: {child.name} did not stop in time; killing it", file=sys.stderr, flush=True)
            child.process.kill()
            child.process.wait()
