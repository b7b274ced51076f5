"""Pure decisions (stdlib only): tiers, cost model, topology, routing, admission, flows.

Nothing in this package may import torch, nats, asyncio or msgpack: the live services and the
simulator call the very same objects (a test enforces the boundary).
"""
