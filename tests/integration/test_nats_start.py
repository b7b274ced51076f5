"""A nats-server is started only when *it* listens. An open port is no proof: a port taken between the probe and
the bind is open too, held by someone else's server, while ours exits at once. Seen on this machine: two
`nitsum up` runs starting together both probed 4222 free, one server lost the bind, and that mesh's services
waited 150 s on a stranger's NATS. Real nats-servers and real sockets."""

from __future__ import annotations

import socket

import pytest

from nitsum.natsserver import NatsExited, NatsServer, free_port, new_passwords
from nitsum.up import start_nats


def squat() -> socket.socket:
    """A listener on a free loopback port: what another program's server looks like from outside."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", free_port()))
    s.listen(1)
    return s


def test_a_server_that_loses_its_port_is_an_error_not_a_start(tmp_path):
    holder = squat()
    taken = holder.getsockname()[1]
    try:
        server = NatsServer(port=taken, config_path=None)
        with pytest.raises(NatsExited, match=f"before listening on 127.0.0.1:{taken}"):
            server.start(log_path=tmp_path / "nats.log")
        assert server.process is not None and server.process.poll() is not None
        assert "address already in use" in (tmp_path / "nats.log").read_text()
    finally:
        holder.close()


def test_up_picks_another_port_when_its_pick_is_taken_at_the_bind(tmp_path, capsys):
    holder = squat()
    taken = holder.getsockname()[1]
    passwords = new_passwords(("node0-0",))
    try:
        server = start_nats(tmp_path, taken, passwords, ("node0-0",))
    finally:
        holder.close()
    try:
        assert server.port != taken and server.process.poll() is None
        assert f"port {taken} was taken" in capsys.readouterr().out
        config = (tmp_path / "nats.conf").read_text()
        assert f":{server.port}" in config and f":{taken}" not in config  # the config names the port it serves
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as conn:
            assert conn.recv(4).startswith(b"INFO")  # a NATS server, ours, answers there
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_a_server_that_refuses_its_config_is_an_error_at_once(tmp_path):
    # It exits before listening; the start does not sit out its timeout waiting for a port that will not open.
    bad = tmp_path / "nats.conf"
    bad.write_text("listen: 127.0.0.1:notaport\n")
    port = free_port()
    with pytest.raises(NatsExited, match="exited with"):
        NatsServer(port=port, config_path=bad).start(log_path=tmp_path / "nats.log", timeout_s=60.0)
