"""The worker's cross-host KV plane (services/worker/kv_net.py) on real loopback sockets: a layer flow goes on
the connection of its level's DSCP (IP_TOS read back at both ends), the receiver keeps it only with its token,
and hands it out only with the size and CRC32 the sender announced."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest

from nitsum.policy.flows import dscp_table, tos_for_dscp
from nitsum.telemetry.metrics import Metrics
from nitsum.transfer.framing import ErrorCode, TransferError
from nitsum_services.worker.kv_net import KvNet

TABLE = dscp_table(8)


def _net(name: str, host: str) -> KvNet:
    return KvNet(None, name, host, "127.0.0.1", TABLE, Metrics(name))


def _counted(net: KvNet, direction: str) -> dict[str, float]:
    out = {}
    for line in net.metrics.render()[0].decode().splitlines():
        if line.startswith("nitsum_kv_tcp_bytes_total{") and f'direction="{direction}"' in line:
            tos = line.split('tos="')[1].split('"')[0]
            out[tos] = out.get(tos, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_a_layer_goes_in_its_levels_class_and_is_handed_out_once():
    a, b = _net("wa", "host-a"), _net("wb", "host-b")
    await b.start()
    try:
        info = b.info()
        assert a.remote(info) and not b.remote(info)
        payload = bytes(range(256)) * 300
        for level, fid in ((3, "r1.pd.0"), (8, "r1.pd.1")):
            crc = await a.send(info, fid, payload, level, "pd")
            assert crc == zlib.crc32(payload)
            assert a.flow_tos[fid] == tos_for_dscp(TABLE[level])  # read back from the socket that sent it
            assert b.take(fid, len(payload), crc) == payload
            with pytest.raises(TransferError):
                b.take(fid, len(payload), crc)  # handed out once
        want = {str(tos_for_dscp(TABLE[3])): float(len(payload)), str(tos_for_dscp(TABLE[8])): float(len(payload))}
        assert _counted(a, "sent") == want and _counted(b, "received") == want  # the wire saw the same classes
    finally:
        await a.close()
        await b.close()


async def test_a_flow_without_the_token_or_with_other_bytes_is_refused():
    a, b = _net("wa", "host-a"), _net("wb", "host-b")
    await b.start()
    try:
        forged = replace(b.info(), token=b.token ^ 1)
        with pytest.raises(TransferError) as refused:
            await a.send(forged, "r2.pd.0", b"x" * 100, 3, "pd")
        assert refused.value.code is ErrorCode.PEER and b.inbox.num_bytes == 0
        crc = await a.send(b.info(), "r3.pd.0", b"y" * 100, 3, "pd")
        with pytest.raises(TransferError) as bad:
            b.take("r3.pd.0", 100, crc ^ 1)
        assert bad.value.code is ErrorCode.CHECKSUM
    finally:
        await a.close()
        await b.close()
