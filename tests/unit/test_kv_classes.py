"""The wire class of a TP transition's KV across hosts, on real sockets: a pre-copy flow's chunks leave on the
pair's connection whose IP_TOS carries the DSCP of its permit's level (a promotion moves the next chunks to the
new class), a flow without a permit goes at the lowest level's, and what the commit copies (the delta, chunks
left to it) at STAGE_M_DSCP. Checked from both ends: the source's sockets (IP_TOS read back) and the receiver,
which counts the bytes it wrote by the TOS each connection's handshake arrived with and answers in that class."""

import torch

from nitsum.kv.reshard import Transfer
from nitsum.node.messages import NodeCommand
from nitsum.node.precopy import PreCopy, copy_transfers_one_sided, plan_flows, transfer_block_bytes
from nitsum.policy.flows import DSCP_TABLE, dscp_table, tos_for_dscp
from nitsum.transfer.kv_link import KvLinks
from nitsum.transfer.kv_receiver import KvReceiver
from nitsum.transfer.kv_tcp import LOWEST_DSCP, STAGE_M_DSCP, handshake_tos, tos_of

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 8, 4, 2, 8
EPOCH = 11
TOS_M = tos_for_dscp(STAGE_M_DSCP)


def block_bytes(t: Transfer) -> int:
    return transfer_block_bytes(t, BLOCK, DIM, 4)


def per_block() -> int:
    return LAYERS * 2 * BLOCK * HEADS * DIM * 4


def test_the_classes_are_distinct_so_the_checks_below_can_tell_them_apart():
    # Level 1 is the delta's class; the lowest level of every table is LE; levels in between are neither.
    assert STAGE_M_DSCP == DSCP_TABLE[1] and LOWEST_DSCP == DSCP_TABLE[8] == dscp_table(4)[4]
    assert len({STAGE_M_DSCP, DSCP_TABLE[3], DSCP_TABLE[5], LOWEST_DSCP}) == 4


def test_node_command_carries_the_classes_of_a_precopy_round():
    cmd = NodeCommand("precopy", 4, chunks=((0, 1), (2, 0)), classes=((0, 26), (2, 1)))
    assert NodeCommand.decode(cmd.encode()) == cmd
    assert NodeCommand.decode(NodeCommand("commit", 4).encode()).classes == ()


def _receivers(n):
    receivers = {}
    for dst in range(1, n + 1):
        new = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
        receiver = KvReceiver("127.0.0.1")
        receiver.open(EPOCH, dst, new, (0, HEADS), sources={0})
        receivers[dst] = (receiver, new)
    return receivers


def _check_receiver_ends(receiver: KvReceiver, expected_dscps: set[int]) -> None:
    """Each accepted connection answers in the class its hello named, which is the class its handshake had."""
    conns = receiver._session.conns
    assert {c.dscp for c in conns} == expected_dscps
    for c in conns:
        assert tos_of(c.sock) == tos_for_dscp(c.dscp)
        assert c.wire_tos == tos_for_dscp(c.dscp)  # seen on the wire (Linux), not taken from the hello


def test_precopy_chunks_go_in_their_permits_class_the_unpermitted_at_the_lowest_and_the_rest_at_stage_m():
    old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    # Worker 0 sends to 1 (a flow with a permit, promoted half-way), to 2 (no permit) and to 3 (its chunks
    # are left to the commit), all on another host.
    transfers = [Transfer(0, dst, 0, LAYERS, 0, HEADS, (1, 2, 3, 4), (4, 5, 6, 7)) for dst in (1, 2, 3)]
    flows = plan_flows(transfers, block_bytes, chunk_bytes=2 * per_block())  # two chunks of two blocks per flow
    assert [len(f.chunks) for f in flows] == [2, 2, 2]
    receivers = _receivers(3)
    opened: list[int] = []
    links = KvLinks(on_open=opened.append)
    try:
        links.connect(
            EPOCH, 0, {dst: ("127.0.0.1", r.port, r.token) for dst, (r, _) in receivers.items()}
        )  # as in prepare
        assert opened == [TOS_M] * 3 and links.tos == [TOS_M] * 3
        pre = PreCopy(0, [0], transfers, flows, old, (0, HEADS), {}, links)
        chunk = 2 * per_block()
        # Round 1: flow 0 at level 5, flow 1 without a class (no permit); flow 2 is not allowed yet.
        assert pre.run([(0, 0), (1, 0)], {0: DSCP_TABLE[5]}) == 2 * chunk
        # Round 2: flow 0 promoted to level 3.
        assert pre.run([(0, 1), (1, 1)], {0: DSCP_TABLE[3], 2: DSCP_TABLE[3]}) == 2 * chunk
        assert pre.finish_mine() == 2 * chunk and pre.complete and pre.error == ""

        tos = tos_for_dscp
        assert receivers[1][0].bytes_by_tos == {tos(DSCP_TABLE[5]): chunk, tos(DSCP_TABLE[3]): chunk}
        assert receivers[2][0].bytes_by_tos == {tos(LOWEST_DSCP): 2 * chunk}
        assert receivers[3][0].bytes_by_tos == {TOS_M: 2 * chunk}
        # The source's own view agrees, connection by connection.
        assert links.link(1).bytes_by_tos == receivers[1][0].bytes_by_tos
        assert links.link(2).bytes_by_tos == receivers[2][0].bytes_by_tos
        assert links.link(3).bytes_by_tos == receivers[3][0].bytes_by_tos
        # One connection per class a pair used, each opened once and recorded (the lazily opened ones too).
        assert links.link(1).tos == [TOS_M, tos(DSCP_TABLE[5]), tos(DSCP_TABLE[3])]
        assert links.link(2).tos == [TOS_M, tos(LOWEST_DSCP)]
        assert links.link(3).tos == [TOS_M]
        assert sorted(opened) == sorted(links.tos) and links.open_connections == 6
        _check_receiver_ends(receivers[1][0], {STAGE_M_DSCP, DSCP_TABLE[5], DSCP_TABLE[3]})
        _check_receiver_ends(receivers[2][0], {STAGE_M_DSCP, LOWEST_DSCP})
        _check_receiver_ends(receivers[3][0], {STAGE_M_DSCP})
        for _, new in receivers.values():
            assert torch.equal(new[:, :, 4:8], old[:, :, 1:5])

        # The commit's delta: STAGE_M_DSCP, whatever class the pair's pre-copy had.
        delta = [Transfer(0, 1, 0, LAYERS, 0, HEADS, (0,), (0,)), Transfer(0, 2, 0, LAYERS, 0, HEADS, (5,), (1,))]
        by_path, error = copy_transfers_one_sided(0, delta, old, (0, HEADS), {}, links, block_bytes, chunk)
        assert error == "" and by_path == {"shm": 0, "tcp": 2 * per_block()}
        assert receivers[1][0].bytes_by_tos[TOS_M] == per_block()
        assert receivers[2][0].bytes_by_tos == {tos(LOWEST_DSCP): 2 * chunk, TOS_M: per_block()}
        assert torch.equal(receivers[1][1][:, :, 0], old[:, :, 0]) and torch.equal(
            receivers[2][1][:, :, 1], old[:, :, 5]
        )
        assert links.open_connections == 6  # the delta reused the pairs' stage-M connections
        assert all(r.errors == [] for r, _ in receivers.values())
    finally:
        links.close()
        for receiver, _ in receivers.values():
            receiver.close()
    assert links.open_connections == 0


def test_a_class_that_cannot_connect_breaks_its_pair_and_only_its_pair():
    old = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    transfers = [Transfer(0, dst, 0, LAYERS, 0, HEADS, (1,), (2,)) for dst in (1, 2)]
    flows = plan_flows(transfers, block_bytes, chunk_bytes=per_block())
    receivers = _receivers(2)
    links = KvLinks()
    try:
        links.connect(EPOCH, 0, {dst: ("127.0.0.1", r.port, r.token) for dst, (r, _) in receivers.items()})
        receivers[1][0].close()  # its listening socket goes: a new class cannot connect to worker 1 any more
        pre = PreCopy(0, [0], transfers, flows, old, (0, HEADS), {}, links)
        pre.run([(0, 0), (1, 0)], {0: DSCP_TABLE[4], 1: DSCP_TABLE[4]})
        assert pre.complete and "KV link to worker 1 failed" in pre.error and "DSCP 18" in pre.error
        assert links.link(1).broken and not links.link(2).broken
        assert receivers[2][0].bytes_by_tos == {tos_for_dscp(DSCP_TABLE[4]): per_block()}
    finally:
        links.close()
        for receiver, _ in receivers.values():
            receiver.close()


def test_handshake_tos_reads_the_class_a_peer_connected_with():
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.socket()
    try:
        client.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_for_dscp(DSCP_TABLE[2]))
        client.connect(listener.getsockname())
        accepted, _ = listener.accept()
        assert handshake_tos(accepted) == tos_for_dscp(DSCP_TABLE[2])
        accepted.close()
    finally:
        client.close()
        listener.close()
