"""Discrete-event cluster simulator over `nitsum.policy` (stdlib only: no torch, nats, asyncio, msgpack).

engine.py   the event core (one (time, seq) heap; handlers return the next events)
network.py  flow-level network (strict priority across classes, max-min fair within one)
cluster.py  nodes / TP groups / requests driven by the same Policy objects as the coordinator
flowsim.py  the Nuska P/D prefill cluster driven by the same FlowScheduler objects as the flow-scheduler
experiments/  `nitsum sim tiers | flows | reconfig`
"""
