"""A two-host testbed in network namespaces: a veth pair, a rate limit and a DSCP-aware priority qdisc.

Used by tests/net and `nitsum bench flows`. Needs root and iproute2 (`apt-get install -y iproute2`).
Addresses come from 10.231.0.0/24 and exist only inside the namespaces this module creates; the
namespaces (and with them the veth pair) are deleted on exit, also when the body fails.

Shaping on A's egress (A → B carries the KV bytes): an `htb` root class at `rate_mbit` with three leaf
classes of priority 0, 1, 2, each guaranteed only 1 % of the rate and allowed to borrow all of it; HTB
lends spare rate to the lowest priority number first, so a higher class is served (almost) strictly
first. u32 filters on the DSCP: EF (46) → prio 0; AF41/AF31/AF21/AF11 (34/26/18/10) → prio 1; all else
→ prio 2. (htb, not prio/ets: many CI kernels ship only htb, tbf and pfifo_fast.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

ADDR_A = "10.231.0.1"
ADDR_B = "10.231.0.2"
CLASS_OF_DSCP = {46: "1:10", 34: "1:20", 26: "1:20", 18: "1:20", 10: "1:20"}  # others: 1:30


@dataclass(frozen=True)
class Testbed:
    ns_a: str
    ns_b: str
    dev_a: str
    addr_a: str = ADDR_A
    addr_b: str = ADDR_B

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]


def unavailable_reason() -> str | None:
    """Why the testbed cannot run here, or None."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y iproute2)"
    probe = f"nsm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def veth_testbed(rate_mbit: float = 20.0, tag: str | None = None) -> Iterator[Testbed]:
    """Create namespaces nsm-<tag>-a/b joined by a shaped veth pair; always deletes them afterwards."""
    tag = tag or str(os.getpid())
    ns_a, ns_b = f"nsm-{tag}-a", f"nsm-{tag}-b"
    dev_a, dev_b = f"vnsm{tag}a"[:15], f"vnsm{tag}b"[:15]
    bed = Testbed(ns_a, ns_b, dev_a)
    try:
        _sh("ip", "netns", "add", ns_a)
        _sh("ip", "netns", "add", ns_b)
        _sh("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, dev_a, ADDR_A), (ns_b, dev_b, ADDR_B)):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        tc = ["ip", "netns", "exec", ns_a, "tc"]
        rate = f"{rate_mbit}mbit"
        floor = f"{max(rate_mbit / 100.0, 0.1)}mbit"
        _sh(*tc, "qdisc", "add", "dev", dev_a, "root", "handle", "1:", "htb", "default", "30", "r2q", "100")
        _sh(*tc, "class", "add", "dev", dev_a, "parent", "1:", "classid", "1:1", "htb", "rate", rate)
        for classid, prio in (("1:10", "0"), ("1:20", "1"), ("1:30", "2")):
            _sh(
                *tc,
                "class",
                "add",
                "dev",
                dev_a,
                "parent",
                "1:1",
                "classid",
                classid,
                "htb",
                "rate",
                floor,
                "ceil",
                rate,
                "prio",
                prio,
                "quantum",
                "1514",
            )
        for dscp, classid in sorted(CLASS_OF_DSCP.items()):
            _sh(
                *tc,
                "filter",
                "add",
                "dev",
                dev_a,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "dsfield",
                hex(dscp << 2),
                "0xfc",
                "flowid",
                classid,
            )
        yield bed
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_plan(
    bed: Testbed,
    plan: list[dict[str, object]] | dict[str, object],
    port: int = 47000,
    timeout_s: float = 60.0,
    python: str | None = None,
    mode: str = "send",
) -> dict[str, dict[str, object]]:
    """Run one sender (`send` plan or `replay` load) A → B on the testbed; returns its JSON result."""
    import json
    import sys

    py = python or sys.executable
    mod = ["-m", "nitsum.bench.testbed"]
    rx = subprocess.Popen(
        [*bed.exec_prefix(bed.ns_b), py, *mod, "receive", "--host", bed.addr_b, "--port", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert rx.stdout is not None and rx.stdin is not None
        line = rx.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"receiver did not start: {line!r} {rx.stderr.read() if rx.stderr else ''}")
        tx = subprocess.run(
            [
                *bed.exec_prefix(bed.ns_a),
                py,
                *mod,
                mode,
                "--host",
                bed.addr_b,
                "--port",
                str(port),
                "--source",
                bed.addr_a,
            ],
            input=json.dumps(plan),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if not tx.stdout.strip():
            raise RuntimeError(f"sender failed (rc {tx.returncode}): {tx.stderr[-2000:]}")
        return json.loads(tx.stdout.strip().splitlines()[-1])
    finally:
        if rx.stdin is not None:
            rx.stdin.close()  # the receiver exits at stdin EOF
        try:
            rx.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rx.kill()
            rx.wait()
