"""KV data plane: framing (msgpack header + CRC32), TCP per priority class with DSCP, shared memory.

Bulk KV bytes never travel over NATS. `kv_tcp` is the TCP plane the node runtime uses between hosts (its
receiver writes into torch KV caches); the rest imports neither torch nor NATS (tensors go in as buffers).
"""
