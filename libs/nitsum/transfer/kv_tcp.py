"""A TP transition's KV across hosts: the transfer data plane's framing over TCP, one connection per DSCP class.

Workers of one host write migrated blocks straight into each other's new caches (shared memory,
`nitsum.transfer.shm`). A source on another host cannot: it sends each chunk to the destination's `KvReceiver`,
which writes it into the new cache and acks *after* the write. A source counts a chunk done only on its
ack, so when every source of a commit has its acks the delta has landed everywhere and the barrier after it
is safe.

Protocol (frames of `nitsum.transfer.framing`: magic, msgpack header, payload, CRC32), one connection per
(epoch, source, destination) pair *and class*, each with IP_TOS = `tos_for_dscp(dscp)` set before connect
(the handshake carries the class too). This module: the protocol's constants and frames; the source's end
is `nitsum.transfer.kv_link` (KvLink, KvLinks), the destination's `nitsum.transfer.kv_receiver` (KvReceiver):
- hello: an END frame, flow id `kvmig-e<epoch>-w<src>-w<dst>`, `block_ids` = (epoch, src, dst, dscp, token),
  no bytes. `token` is the receiver's secret (63 random bits drawn at its start, told to the node world's
  members only, in their exchange at boot): whoever merely reaches the port cannot write into a cache. The
  receiver checks the token and the epoch it serves, marks its end of the connection with the same
  class (its acks and errors travel in the class of the bytes they answer) and answers ACK, or ERROR and
  closes. The pair's first connection is opened by the source in prepare, in the delta's class
  `STAGE_M_DSCP`, and the source waits for that ACK inside prepare: a pair that cannot connect refuses the
  prepare on every member.
- a chunk: a DATA frame (offset 0, the chunk's K/V bytes in the layout
  [layers, K/V, blocks, block_size, heads, head_dim]) then an END frame with `total_bytes` and, in
  `block_ids`, the placement: (layer_start, layer_end, head_start, head_end, *destination block ids), so
  the receiver needs nothing but its cache. ACK (`total_bytes`) once written; ERROR on any mismatch.

Blocking sockets, not the asyncio plane of P/D hand-offs (`nitsum.transfer.tcp`): the source side runs in the step
thread, which is synchronous and must know a chunk landed before it returns (pre-copy between two decode steps,
the delta inside the pause); an event-loop thread would add a thread hop per chunk and a loop to own and stop,
for nothing. The receiver needs one thread per epoch anyway (its worker's step thread is busy with its own old
group's steps while sources write): a `selectors` loop over the listening socket and the epoch's
connections. The async classes also buffer a flow whole before a sink sees it; here a chunk is one frame.

Classes (ALGORITHMS.md §2.4: each level maps to a DSCP; KV bytes across hosts go over TCP connections whose
IP_TOS carries it, one connection per class):
- pre-copy: a stage-M flow's chunks go in the class of the level its flow-scheduler permit grants
  (services/worker/migration_flows.py maps the level through the agent's DSCP table; the step thread gets
  the DSCP with the chunks, `NodeCommand.classes`). A flow run without a permit (scheduler silent or
  pruning) goes at the lowest level's, `LOWEST_DSCP` (LE), like every unpermitted flow.
- the commit's delta, and any pre-copy chunk still left at commit: copied inside the commit, not under a
  permit, on the critical path of the cutover (streams are paused): the highest class used for urgent
  stage-M traffic, `STAGE_M_DSCP` = P1 of DSCP_TABLE (EF).
The choice: one connection per class per pair, as the testbed's `TcpTransferSender` does (DSCP ->
connection, TOS set before connect), the delta's opened in prepare (it doubles as the reachability check),
every other class lazily at its first chunk (a connect and a hello written from the step thread; the hello's
ack is read with the chunk's). Re-marking the pair's single connection (setsockopt IP_TOS between classes)
was not taken: a pair carries one pre-copy flow per epoch, but also the delta, in another class; Linux
reads a socket's TOS at transmit time, so re-marking would re-class whatever TCP still holds queued or
retransmits, the receiver would need an in-band re-mark to keep its acks in step, and a switch could not be
observed on the wire by the receiver (it sees the class of the handshake). Separate connections keep each
class's bytes on its own queue; it costs one connection per class a pair actually uses (normally two).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import sys
from collections.abc import Iterable

import torch

from nitsum.policy.flows import DSCP_LE, DSCP_TABLE
from nitsum.transfer.framing import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX,
    ErrorCode,
    FrameHeader,
    TransferError,
    decode_body,
    decode_prefix,
    encode_frame,
)

# The commit's delta (and chunks left to the commit): inside the pause, the urgent explicit class P1.
STAGE_M_LEVEL = 1
STAGE_M_DSCP = DSCP_TABLE[STAGE_M_LEVEL]
# A pre-copy chunk whose flow has no permit class: the lowest level's (every dscp_table(K) maps level K to LE).
LOWEST_DSCP = DSCP_LE
# Connect + hello, and then one frame or one ack: below the node world's collective timeout (30 s by default),
# so that a stuck link fails as a link (the span refuses the epoch) before the span's exchange times out.
CONNECT_TIMEOUT_S = 10.0
# A class opened at its first chunk, from the old group's step thread: the peer already answered in prepare (in
# the delta's class), so a slow connect here is the path refusing this class -- it must not stall decoding for
# long; the flow then fails and the prepare is refused (the old topology keeps serving).
LAZY_CONNECT_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 10.0
# A receiver's limits for connections that have not said their hello yet (anyone who reaches the port).
HELLO_MAX_HEADER_BYTES = 1024
MAX_CONNECTIONS = 256
ERROR_PEEK_S = 0.5  # after a failed write: how long to look for the receiver's ERROR that explains it
MAX_ERRORS = 256  # what a receiver keeps of its refusals (each is logged too)
THREAD_PREFIX = "nitsum-kv-recv"

log = logging.getLogger("nitsum.kv")


def flow_id(epoch: int, src: int, dst: int) -> str:
    return f"kvmig-e{epoch}-w{src}-w{dst}"


# -- frames on a blocking socket ------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError(ErrorCode.CLOSED, "connection closed by the peer")
        got += k
    return buf


def read_frame(
    sock: socket.socket, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[FrameHeader, bytearray]:
    try:
        hdr_len, payload_len, crc = decode_prefix(bytes(_recv_exact(sock, PREFIX.size)), max_payload_bytes)
        hdr = bytes(_recv_exact(sock, hdr_len))
        payload = _recv_exact(sock, payload_len) if payload_len else bytearray()
    except TimeoutError as exc:
        raise TransferError(ErrorCode.TIMEOUT, f"no frame within {sock.gettimeout()} s") from exc
    except (ConnectionError, OSError) as exc:
        raise TransferError(ErrorCode.CLOSED, repr(exc)) from exc
    return decode_body(hdr, payload, crc), payload


def write_frame(sock: socket.socket, header: FrameHeader, payload: bytes | memoryview = b"") -> None:
    try:
        for buf in encode_frame(header, payload):
            sock.sendall(buf)
    except TimeoutError as exc:
        raise TransferError(ErrorCode.TIMEOUT, "send stalled", header.flow_id) from exc
    except (ConnectionError, OSError) as exc:
        raise TransferError(ErrorCode.CLOSED, repr(exc), header.flow_id) from exc


def tos_of(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)


_IP_PKTOPTIONS = getattr(socket, "IP_PKTOPTIONS", 9)  # Linux
_CMSG_HEADER = struct.Struct("@Nii")  # cmsg_len, cmsg_level, cmsg_type


def handshake_tos(sock: socket.socket) -> int | None:
    """The TOS byte an accepted TCP connection's handshake arrived with, i.e. the class the peer set before
    connecting, as seen on the wire (Linux keeps it for IP_PKTOPTIONS once IP_RECVTOS is on); None where the
    platform does not tell."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        raw = sock.getsockopt(socket.IPPROTO_IP, _IP_PKTOPTIONS, 256)
    except OSError:
        return None
    offset, align = 0, struct.calcsize("@N")
    while offset + _CMSG_HEADER.size <= len(raw):
        length, level, kind = _CMSG_HEADER.unpack_from(raw, offset)
        if length < _CMSG_HEADER.size:
            return None
        data = raw[offset + _CMSG_HEADER.size : offset + length]
        if level == socket.IPPROTO_IP and kind == socket.IP_TOS and data:
            return struct.unpack("@i", data)[0] & 0xFF if len(data) >= 4 else data[0]
        offset += (length + align - 1) // align * align
    return None


def open_kv_sockets(receiver_port: int, peer_ports: Iterable[int]) -> int:
    """TCP sockets this process holds open on the KV data plane (Linux: its descriptors matched against
    /proc/net/tcp): connections accepted on `receiver_port` and links to the peers' receiver ports. The
    listening socket itself is not counted. A leak check that does not trust this module's bookkeeping."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    peers = set(peer_ports) - {0}
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if inode not in inodes or state == "0A":  # not ours, or LISTEN
                continue
            if int(local.split(":")[1], 16) == receiver_port or int(remote.split(":")[1], 16) in peers:
                count += 1
    return count


# -- the destination side ---------------------------------------------------------------------------------
def write_blocks(cache: torch.Tensor, heads: tuple[int, int], placement: tuple[int, ...], payload: bytearray) -> None:
    """One received chunk into this worker's new cache; TransferError(PROTOCOL) when it does not fit."""
    if len(placement) < 5:
        raise TransferError(ErrorCode.PROTOCOL, f"placement {placement[:8]} names no block")
    l0, l1, h0, h1, *ids = placement
    layers, _, num_blocks, block_size, _, head_dim = cache.shape
    if not (0 <= l0 < l1 <= layers and heads[0] <= h0 < h1 <= heads[1]):
        raise TransferError(
            ErrorCode.PROTOCOL,
            f"layers [{l0}, {l1}) / heads [{h0}, {h1}) outside this cache ({layers} layers, heads {list(heads)})",
        )
    if not all(0 <= b < num_blocks for b in ids):
        raise TransferError(ErrorCode.PROTOCOL, f"a block id outside [0, {num_blocks})")
    shape = (l1 - l0, 2, len(ids), block_size, h1 - h0, head_dim)
    if len(payload) != math.prod(shape) * cache.element_size():
        raise TransferError(ErrorCode.PROTOCOL, f"{len(payload)} bytes for a chunk of shape {shape}")
    src = torch.frombuffer(payload, dtype=cache.dtype).view(shape)
    index = torch.tensor(ids, dtype=torch.long)
    cache[l0:l1, :, index, :, h0 - heads[0] : h1 - heads[0]] = src
