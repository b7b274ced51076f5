"""The one KV export form (`engine.migration.KVExport`): a msgpack header and one payload per layer, as the
worker's P/D hand-off ships it; malformed parts are refused with ValueError, not taken apart half-way."""

from __future__ import annotations

import msgpack
import pytest
import torch

from nitsum.engine.migration import KVExport, gather_blocks, scatter_blocks


def _export() -> KVExport:
    kv = torch.arange(3 * 2 * 2 * 4 * 2 * 8, dtype=torch.float32).view(3, 2, 2, 4, 2, 8)
    return KVExport({"id": "r1", "tokens": [1, 2, 3]}, 7, (0, 2), kv)


def test_header_and_layers_round_trip():
    sent = _export()
    got = KVExport.from_layers(sent.header(), {i: sent.layer_bytes(i) for i in range(sent.num_layers)})
    assert got.state == sent.state and got.num_tokens == 7 and got.heads == (0, 2)
    assert got.kv.dtype == sent.kv.dtype and torch.equal(got.kv, sent.kv)


def test_malformed_parts_are_refused():
    sent = _export()
    layers = {i: sent.layer_bytes(i) for i in range(sent.num_layers)}
    with pytest.raises(ValueError, match="not 0..2"):
        KVExport.from_layers(sent.header(), {0: layers[0], 1: layers[1], 5: layers[2]})
    bad_dtype = msgpack.packb([sent.state, 7, [0, 2], "Tensor", [2, 2, 4, 2, 8]], use_bin_type=True)
    with pytest.raises(ValueError, match="not a torch dtype"):
        KVExport.from_layers(bad_dtype, layers)
    with pytest.raises(ValueError):
        KVExport.from_layers(b"\xc1", layers)  # not msgpack


def test_gather_then_scatter_moves_exactly_the_named_blocks():
    cache = torch.randn(2, 2, 6, 4, 2, 8)
    out = torch.zeros_like(cache)
    scatter_blocks(out, [5, 0], gather_blocks(cache, [1, 3]))
    assert torch.equal(out[:, :, 5], cache[:, :, 1]) and torch.equal(out[:, :, 0], cache[:, :, 3])
    assert not out[:, :, 1:5].any()
    scatter_blocks(out, [2], gather_blocks(cache, [0, 4]), positions=[1])  # only the second block
    assert torch.equal(out[:, :, 2], cache[:, :, 4])
