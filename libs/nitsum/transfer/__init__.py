"""KV data plane: framing (msgpack header + CRC32), TCP per priority class with DSCP, shared memory.

Bulk KV bytes never travel over NATS. Imports neither torch nor NATS; tensors go in as buffers.
"""
