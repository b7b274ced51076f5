"""KV data plane: framing (msgpack header + CRC32), one TCP plane with a connection per DSCP class, shared memory.

Bulk KV bytes never travel over NATS. Two TCP planes, one per caller's threading model, sharing the DSCP classes
and `kv_tcp.handshake_tos`: `kv_tcp` (protocol, frames, classes), `kv_link` (the source's end) and `kv_receiver`
(the destination's, writing into torch KV caches) for node-world TP changes, driven from the synchronous step
thread; `tcp` (asyncio, a flow buffered whole, then handed to a sink) for P/D hand-offs and stage-1 reuse between
hosts (`services/worker/kv_net.py`) and the namespace testbed.
"""
