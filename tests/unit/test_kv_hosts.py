"""Which workers share a host and which path each KV migration pair takes (pure), and the stage-M TCP data
plane's two ends on real sockets: a chunk lands in the destination's cache before its ack, the connection
carries the stage-M DSCP, and a hello the receiver refuses (wrong epoch, injected fault) fails the link."""

import socket
import threading
import time

import pytest
import torch

from nitsum.kv.reshard import Transfer
from nitsum.node import kv_hosts
from nitsum.node.kv_hosts import Member, hosts_of, pair_path, resolve_mode
from nitsum.policy.flows import tos_for_dscp
from nitsum.transfer import kv_tcp
from nitsum.transfer.framing import MAGIC, PREFIX, FrameHeader, FrameKind, TransferError
from nitsum.transfer.kv_link import KvLinks
from nitsum.transfer.kv_receiver import KvReceiver
from nitsum.transfer.kv_tcp import STAGE_M_DSCP, THREAD_PREFIX, read_frame, write_frame


def members(hosts, kv_path="auto", shm=True, device="cpu"):
    return tuple(Member(r, h, shm, device, kv_path, "127.0.0.1", 5000 + r) for r, h in enumerate(hosts))


def test_member_round_trips_through_msgpack():
    m = Member(3, "box/abc/shm42", True, "cpu", "auto", "10.0.0.7", 41234)
    assert Member.decode(m.encode()) == m


def test_host_id_override_and_default():
    assert kv_hosts.local_host_id("rack1-a") == "rack1-a"
    default = kv_hosts.local_host_id("")
    assert default == kv_hosts.local_host_id("")  # stable within a host
    hostname, boot, shm = default.split("/")
    assert hostname and boot and (shm.startswith("shm") or shm == "noshm")


def test_advertise_address():
    assert kv_hosts.advertise_addr("10.1.2.3", "127.0.0.1") == "10.1.2.3"
    assert kv_hosts.advertise_addr("", "127.0.0.1") == "127.0.0.1"
    assert kv_hosts.advertise_addr("", "localhost") == "127.0.0.1"
    assert kv_hosts.is_loopback("127.0.0.2") and not kv_hosts.is_loopback("10.0.0.1")


def test_workers_grouped_into_hosts_and_a_path_per_pair():
    world = members(["a", "a", "b", "b"])
    assert hosts_of(world) == {"a": (0, 1), "b": (2, 3)}
    assert resolve_mode(world) == "shm"
    paths = {(s, d): pair_path("shm", world, s, d) for s in range(4) for d in range(4)}
    assert {k for k, p in paths.items() if p == "local"} == {(i, i) for i in range(4)}
    assert {k for k, p in paths.items() if p == "shm"} == {(0, 1), (1, 0), (2, 3), (3, 2)}
    assert {k for k, p in paths.items() if p == "tcp"} == {(s, d) for s in (0, 1) for d in (2, 3)} | {
        (s, d) for s in (2, 3) for d in (0, 1)
    }


def test_mode_resolution():
    # every worker on its own host (containers): nothing can share memory
    assert resolve_mode(members(["a", "b", "c", "d"])) == "tcp"
    # one host without a usable /dev/shm: TCP too (no pair shares memory)
    assert resolve_mode(members(["a"] * 4, shm=False)) == "tcp"
    assert pair_path("tcp", members(["a"] * 4), 0, 1) == "tcp"  # forced: even on one host
    assert resolve_mode(members(["a"] * 4, kv_path="tcp")) == "tcp"
    assert resolve_mode(members(["a"] * 4, kv_path="p2p")) == "p2p"
    assert pair_path("p2p", members(["a"] * 4), 0, 1) == "p2p"
    assert resolve_mode(members(["a"] * 2, device="cuda:0")) == "p2p"  # GPU caches: the paired fallback
    with pytest.raises(ValueError, match="needs CPU caches"):
        resolve_mode(members(["a"] * 2, kv_path="shm", device="cuda:0"))
    with pytest.raises(ValueError, match=r"writable /dev/shm \(workers \[0, 1\]"):
        resolve_mode(members(["a"] * 2, kv_path="shm", shm=False))
    mixed = members(["a", "a"])[:1] + members(["a", "a"], kv_path="p2p")[1:]
    with pytest.raises(ValueError, match="disagree on the KV path"):
        resolve_mode(mixed)


# -- the data plane on real sockets ----------------------------------------------------------------------
LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 8, 4, 4, 8


def kv_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def test_chunk_is_written_before_its_ack_over_a_stage_m_connection():
    old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)  # source: all 4 heads
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM)  # destination: heads [2, 4)
    receiver = KvReceiver("127.0.0.1")
    receiver.open(7, 1, new, (2, 4), sources={0})
    links = KvLinks()
    try:
        links.connect(7, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        assert links.tos == [tos_for_dscp(STAGE_M_DSCP)]
        t = Transfer(0, 1, 0, LAYERS, 2, 4, (5, 1, 6), (0, 3, 7))
        link = links.link(1)
        sent = link.send(t, 0, 2, old, (0, 4)) + link.send(t, 2, 3, old, (0, 4))
        assert sent == 3 * LAYERS * 2 * BLOCK * 2 * DIM * 4
        assert link.wait() == sent  # both acked: written
        assert torch.equal(new[:, :, [0, 3, 7]], old[:, :, [5, 1, 6], :, 2:4])
        assert new[:, :, [1, 2, 4, 5, 6]].abs().sum() == 0
        assert receiver.bytes_written == sent and receiver.errors == []
        assert receiver.open_connections == 1 and len(kv_threads()) == 1
    finally:
        links.close()
        receiver.close()
    assert kv_threads() == [] and links.open_connections == 0


def test_receiver_refuses_a_wrong_epoch_a_chunk_outside_its_heads_and_an_injected_fault():
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM)
    receiver = KvReceiver("127.0.0.1", fault_epoch=9)
    try:
        receiver.open(8, 1, new, (2, 4), sources={0})
        with pytest.raises(TransferError, match="serves epoch 8"):
            KvLinks().connect(5, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        links = KvLinks()
        links.connect(8, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
        links.link(1).send(Transfer(0, 1, 0, LAYERS, 0, 2, (1,), (1,)), 0, 1, old, (0, 4))  # heads [0, 2)
        with pytest.raises(TransferError, match="outside this cache"):
            links.link(1).wait()
        links.close()
        assert new.abs().sum() == 0
        receiver.open(9, 1, new, (2, 4), sources={0})
        with pytest.raises(TransferError, match="closed"):
            KvLinks().connect(9, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        assert any("injected" in e for e in receiver.errors)
    finally:
        receiver.close()
    assert kv_threads() == []
    with pytest.raises(TransferError, match="connect to w1"):  # nobody listens any more
        KvLinks().connect(9, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})


def test_receiver_refuses_a_hello_without_its_token_and_writes_nothing():
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM)
    receiver, other = KvReceiver("127.0.0.1"), KvReceiver("127.0.0.1")
    assert receiver.token != other.token and receiver.token.bit_length() <= 63
    assert "token" not in repr(Member(0, "h", True, "cpu", "auto", "127.0.0.1", receiver.port, token=receiver.token))
    try:
        receiver.open(8, 1, new, (2, 4), sources={0})
        # Right epoch, pair and class, but not this receiver's token: someone who only reached the port.
        for token in (other.token, 0, receiver.token ^ 1):
            with pytest.raises(TransferError, match="token is not this receiver's"):
                KvLinks().connect(8, 0, {1: ("127.0.0.1", receiver.port, token)})
        # A bare socket speaking the old four-field hello gets the same refusal.
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0) as sock:
            write_frame(sock, FrameHeader(FrameKind.END, "kvmig-e8-w0-w1", block_ids=(8, 0, 1, STAGE_M_DSCP)))
            answer, _ = read_frame(sock)
            assert answer.kind is FrameKind.ERROR and "hello" in answer.message
        assert new.abs().sum() == 0 and len(receiver.errors) == 4
        links = KvLinks()  # the member that was told the token at boot gets through
        links.connect(8, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
        links.link(1).send(Transfer(0, 1, 0, LAYERS, 2, 4, (1,), (1,)), 0, 1, old, (0, 4))
        links.link(1).wait()
        links.close()
        assert torch.equal(new[:, :, 1], old[:, :, 1, :, 2:4])
    finally:
        receiver.close()
        other.close()
    assert kv_threads() == []


def test_before_its_hello_a_connection_gets_no_memory_no_time_and_no_extra_sockets(monkeypatch):
    """What someone who only reaches the port can make the receiver do: a frame with a payload before the
    hello is refused at its prefix (nothing buffered); a connection that sends nothing is refused after
    IO_TIMEOUT_S and, like every refused one, closed IO_TIMEOUT_S later even if it never closes; connections
    beyond MAX_CONNECTIONS are closed unanswered."""
    monkeypatch.setattr(kv_tcp, "IO_TIMEOUT_S", 1.0)  # (a loaded host must still read a hello in time)
    monkeypatch.setattr(kv_tcp, "MAX_CONNECTIONS", 3)
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM)
    receiver = KvReceiver("127.0.0.1")
    try:
        receiver.open(8, 1, new, (2, 4), sources={0})
        big = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
        big.sendall(PREFIX.pack(MAGIC, 40, 200 * 2**20, 0))  # "a 200 MiB frame follows"
        answer, _ = read_frame(big)
        assert answer.kind is FrameKind.ERROR and "payload of" in answer.message
        silent = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
        answer, _ = read_frame(silent)  # nothing sent: refused once its hello is overdue
        assert answer.kind is FrameKind.ERROR and "no whole frame" in answer.message
        assert silent.recv(1) == b""  # ... and closed, though this end never closed
        assert big.recv(1) == b""
        for _ in range(5):  # port scans: connect, close -- no place kept in the cap, no deadline left to fire
            socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0).close()
        time.sleep(2.5 * kv_tcp.IO_TIMEOUT_S)
        assert receiver._session is not None and receiver._session.thread.is_alive()
        links = KvLinks()  # a member still gets through
        links.connect(8, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        links.close()
        deadline = time.monotonic() + 10.0
        while receiver.open_connections and time.monotonic() < deadline:  # its end of the link has gone too
            time.sleep(0.01)
        assert receiver.open_connections == 0
        held = [socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
        assert extra.recv(1) == b""  # the fourth: closed unanswered
        for sock in held + [extra, big, silent]:
            sock.close()
        assert new.abs().sum() == 0
    finally:
        receiver.close()
    assert kv_threads() == []


def test_open_kv_sockets_sees_both_ends_of_a_link_until_closed():
    from nitsum.transfer.kv_tcp import open_kv_sockets

    receiver = KvReceiver("127.0.0.1")
    receiver.open(1, 1, torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM), (2, 4), sources={0})
    links = KvLinks()
    try:
        assert open_kv_sockets(receiver.port, [receiver.port]) == 0  # the listening socket is not counted
        links.connect(1, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        # this process holds both ends: the link (to the receiver's port) and the accepted connection
        assert open_kv_sockets(receiver.port, []) == 1
        assert open_kv_sockets(0, [receiver.port]) == 1
    finally:
        links.close()
        receiver.close()
    assert open_kv_sockets(receiver.port, [receiver.port]) == 0


def test_a_refused_round_reports_the_receivers_reason_not_a_broken_pipe():
    """The source writes a whole round before reading acks; the receiver refuses the first chunk. It must
    drain the rest instead of closing (a reset would discard its ERROR): 20 times out of 20 the source
    learns why (this failed 2 times in 4 before the receiver drained)."""
    old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM)
    receiver = KvReceiver("127.0.0.1", fault_chunk_epochs=range(1, 21))
    try:
        for epoch in range(1, 21):
            receiver.open(epoch, 1, new, (2, 4), sources={0})
            links = KvLinks()
            links.connect(epoch, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
            link = links.link(1)
            t = Transfer(0, 1, 0, LAYERS, 2, 4, tuple(range(BLOCKS)), tuple(range(BLOCKS)))
            with pytest.raises(TransferError, match="injected chunk failure"):
                for _ in range(64):  # ~1 MiB: more than the socket buffers once the receiver stops reading
                    link.send(t, 0, BLOCKS, old, (0, 4))
                link.wait()
            links.close()
        assert new.abs().sum() == 0
    finally:
        receiver.close()
    assert kv_threads() == []


def test_bfloat16_blocks_cross_the_wire_bit_exact():
    old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM).to(torch.bfloat16)
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM, dtype=torch.bfloat16)
    receiver = KvReceiver("127.0.0.1")
    receiver.open(3, 1, new, (2, 4), sources={0})
    links = KvLinks()
    try:
        links.connect(3, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        link = links.link(1)
        sent = link.send(Transfer(0, 1, 0, LAYERS, 2, 4, (2, 4), (6, 0)), 0, 2, old, (0, 4))
        assert link.wait() == sent == 2 * LAYERS * 2 * BLOCK * 2 * DIM * 2
        assert torch.equal(new[:, :, [6, 0]], old[:, :, [2, 4], :, 2:4])
    finally:
        links.close()
        receiver.close()


def test_a_source_stalled_mid_frame_fails_alone(monkeypatch):
    """One source sends half a frame and stops; another source's chunks are still written and acked at
    once, and the stalled connection is refused when its frame's deadline passes."""
    import socket
    import time

    from nitsum.transfer import kv_tcp
    from nitsum.transfer.framing import FrameHeader, FrameKind, encode_frame

    monkeypatch.setattr(kv_tcp, "IO_TIMEOUT_S", 1.0)
    old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM)
    receiver = KvReceiver("127.0.0.1")
    receiver.open(4, 2, new, (2, 4), sources={0, 1})
    stalled, healthy = KvLinks(), KvLinks()
    try:
        stalled.connect(4, 0, {2: ("127.0.0.1", receiver.port, receiver.token)})
        healthy.connect(4, 1, {2: ("127.0.0.1", receiver.port, receiver.token)})
        prefix_and_header, payload = encode_frame(FrameHeader(FrameKind.DATA, "kvmig-e4-w0-w2-c0"), b"x" * 4096)
        stalled.link(2).sock.sendall(bytes(prefix_and_header) + bytes(payload)[:100])  # then nothing
        t0 = time.monotonic()
        link = healthy.link(2)
        sent = link.send(Transfer(1, 2, 0, LAYERS, 2, 4, (3,), (5,)), 0, 1, old, (0, 4))
        assert link.wait() == sent
        assert time.monotonic() - t0 < kv_tcp.IO_TIMEOUT_S  # not behind the stalled frame's deadline
        assert torch.equal(new[:, :, 5], old[:, :, 3, :, 2:4])
        sock = stalled.link(2).sock
        sock.settimeout(10.0)
        header, _ = kv_tcp.read_frame(sock, 0)
        assert header.kind is FrameKind.ERROR and "no whole frame" in header.message
        sock.shutdown(socket.SHUT_WR)
    finally:
        stalled.close()
        healthy.close()
        receiver.close()
    assert any("no whole frame" in e for e in receiver.errors)


def test_the_ack_follows_the_write_even_when_the_write_is_slow(monkeypatch):
    from nitsum.transfer import kv_tcp

    real = kv_tcp.write_blocks

    def slow_write(*args):
        import time

        time.sleep(0.3)  # an ack sent before the write would reach the source before the bytes land
        real(*args)

    monkeypatch.setattr(kv_tcp, "write_blocks", slow_write)
    old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, 2, DIM)
    receiver = KvReceiver("127.0.0.1")
    receiver.open(5, 1, new, (2, 4), sources={0})
    links = KvLinks()
    try:
        links.connect(5, 0, {1: ("127.0.0.1", receiver.port, receiver.token)})
        link = links.link(1)
        link.send(Transfer(0, 1, 0, LAYERS, 2, 4, (1,), (2,)), 0, 1, old, (0, 4))
        link.wait()
        assert torch.equal(new[:, :, 2], old[:, :, 1, :, 2:4])  # checked right at the ack, no waiting
    finally:
        links.close()
        receiver.close()


def test_a_loopback_receiver_that_another_host_would_reach_is_refused_at_boot():
    one_machine = members(["a", "a", "b", "b"])  # every address loopback: one machine, host ids apart
    assert resolve_mode(one_machine) == "shm"
    routable = tuple(
        Member(r, h, True, "cpu", "auto", f"10.0.0.{r + 1}", 5000 + r) for r, h in enumerate(["a", "a", "b", "b"])
    )
    assert resolve_mode(routable) == "shm"
    bad = routable[:3] + (Member(3, "b", True, "cpu", "auto", "127.0.0.1", 5003),)
    with pytest.raises(ValueError, match=r"workers \[3\] advertise a loopback address"):
        resolve_mode(bad)
    with pytest.raises(ValueError, match=r"workers \[0, 1\] advertise"):  # and as sources' targets from b
        resolve_mode(
            tuple(
                Member(r, m.host, True, "cpu", "auto", "127.0.0.1" if r < 2 else m.addr, m.port)
                for r, m in enumerate(routable)
            )
        )
