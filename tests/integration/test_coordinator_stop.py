"""A coordinator stops when told, whatever its policy period: every loop watches the stop (a long
NITSUM_RECONFIG_INTERVAL_MS held the shutdown for the loops' 2 s grace, then they were cut off)."""

from __future__ import annotations

import os
import signal
import time

from nitsum.natsserver import free_port
from nitsum.up import Child


def test_a_coordinator_with_a_long_policy_period_stops_its_loops_on_sigterm(nats_server, tmp_path):
    env = {
        **os.environ,
        "NITSUM_NATS_URL": nats_server.url,
        "NITSUM_METRICS_PORT": str(free_port()),
        "NITSUM_RECONFIG_INTERVAL_MS": "600000",
        "PYTHONUNBUFFERED": "1",
    }
    child = Child("coordinator", "coordinator", env, tmp_path / "coordinator.log")
    child.start()
    try:
        deadline = time.monotonic() + 60  # a hang guard, not a performance bound
        while "coordinator running" not in child.log_path.read_text():
            assert child.process.poll() is None, child.log_path.read_text()
            assert time.monotonic() < deadline, child.log_path.read_text()
            time.sleep(0.1)
        child.process.send_signal(signal.SIGTERM)
        assert child.process.wait(timeout=60) == 0
    finally:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()
    log = child.log_path.read_text()
    assert "coordinator stopped" in log, log
    assert "did not stop" not in log, log
