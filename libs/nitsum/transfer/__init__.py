"""KV data plane: framing (msgpack header + CRC32), one TCP plane with a connection per DSCP class, shared memory.

Bulk KV bytes never travel over NATS. The one TCP plane: `kv_tcp` (protocol, frames, classes), `kv_link` (the
source's end) and `kv_receiver` (the destination's, writing into torch KV caches). The namespace testbed's
async flow sender (`nitsum.bench.flow_tcp`) is a benchmark tool, not a data plane of the mesh.
"""
