"""The NIC behind an address and its link speed, read from the kernel at boot (Linux sysfs).

A worker's KV receiver listens on an address; the interface that holds it carries the worker's cross-host KV
traffic, and its negotiated speed (`/sys/class/net/<iface>/speed`, Mb/s) is the capacity the flow-scheduler
should plan that host's uplink and downlink with where the operator gave none (NITSUM_FLOW_LINK_GBPS wins).
Loopback, an address no interface holds, and an interface whose speed the kernel does not know (-1, or
EINVAL for a virtual device that is down) give None: the caller then keeps its default.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915
SYS_NET = Path("/sys/class/net")


def _ipv4_of(iface: str) -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", iface.encode()[:15]))
    except OSError:
        return None  # no IPv4 address
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])


def interface_of(addr: str) -> str | None:
    """The interface holding IPv4 address `addr` in this network namespace (None: none, or not IPv4)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.version != 4:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def link_speed_gbps(addr: str, sys_net: Path = SYS_NET) -> tuple[float, str] | None:
    """(Gb/s, interface) of the NIC holding `addr`, as the kernel reports its link speed; None where no NIC
    applies (loopback) or the speed is unknown."""
    try:
        if ipaddress.ip_address(addr).is_loopback:
            return None
    except ValueError:
        return None
    iface = interface_of(addr)
    if iface is None:
        return None
    try:
        mbps = int((sys_net / iface / "speed").read_text().strip())
    except (OSError, ValueError):
        return None
    if mbps <= 0:
        return None
    return mbps / 1000.0, iface
