"""Processes for the namespace testbed: `python -m nitsum.bench.testbed receive|send ...`.

receive: a TcpTransferReceiver on --host/--port; prints "ready" once listening and serves until its
         stdin closes (so it never outlives the test that started it).
send:    reads a JSON plan from stdin — [{"flow_id", "size_bytes", "level", "start_ms", "rate_bps"}] —
         sends every flow at its start time and level, and prints {"finish_ms": {id: ms}, "errors": {id: msg}}
         with times relative to the plan's start (ACK received = finished).
replay:  reads {"scheduler", "rate_mbit", "layers", "requests": [...], optional "rmlq": {"e", "u"}} from stdin and plays each request
         live under that scheduler: KV-reuse fetch → prefill layers (layer boundaries) → P2D transfer
         with the TTFT deadline. Flows go out in chunks; each chunk is sent at the flow's level *now*
         (promotion between messages, never inside one) after a host-side strict-priority gate on the
         service keys, paced at `rates()` where the scheduler gives one. Prints {"ttft_ms": {id: ms}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from nitsum.transfer.framing import TransferError
from nitsum.transfer.tcp import MemorySink, TcpTransferReceiver, TcpTransferSender

TICK_MS = 5.0  # replay's scheduler tick (MLU re-evaluation grid)


async def _receive(host: str, port: int) -> int:
    rx = TcpTransferReceiver(MemorySink(), host=host, port=port, max_flow_bytes=1 << 28)
    await rx.start()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # returns at EOF: the parent is done or gone
    await rx.close()
    return 0


async def _send(host: str, port: int, source: str | None, plan: list[dict[str, object]]) -> int:
    tx = TcpTransferSender(host, port, source_host=source, chunk_bytes=64 * 1024, timeout_s=60.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    finish_ms: dict[str, float] = {}
    errors: dict[str, str] = {}

    async def one(spec: dict[str, object]) -> None:
        fid = str(spec["flow_id"])
        delay_s = float(spec.get("start_ms", 0.0)) / 1000.0 - (loop.time() - t0)  # type: ignore[arg-type]
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        rate = spec.get("rate_bps")
        try:
            await tx.send(
                fid,
                bytes(int(spec["size_bytes"])),
                level=int(spec["level"]),  # type: ignore[call-overload]
                rate_bps=float(rate) if rate else None,
            )  # type: ignore[arg-type]
            finish_ms[fid] = (loop.time() - t0) * 1000.0
        except TransferError as exc:
            errors[fid] = str(exc)

    # Open every class connection first so connection setup does not favour one flow.
    for level in sorted({int(s["level"]) for s in plan}):  # type: ignore[call-overload]
        await tx.send(f"warmup-{level}", b"", level=level)
    t0 = loop.time()
    await asyncio.gather(*(one(s) for s in plan))
    await tx.close()
    print(json.dumps({"finish_ms": finish_ms, "errors": errors}), flush=True)
    return 0 if not errors else 1


async def _replay(host: str, port: int, source: str | None, load: dict[str, object]) -> int:
    from nitsum.policy.flow_baselines import make_flow_scheduler
    from nitsum.policy.flows import FlowSpec, Stage

    thresholds = load.get("rmlq") or {}  # {"e": E, "u": U}: RMLQ's promotion thresholds Q_i = E^-i * U
    sched = make_flow_scheduler(
        str(load["scheduler"]),
        rmlq_e=thresholds.get("e"),  # type: ignore[union-attr]
        rmlq_u=thresholds.get("u"),  # type: ignore[union-attr]
        # the breakdown: a baseline runs RMLQ's worst-case check too (load["prune"] still decides whether it runs)
        overload_check=True if load.get("prune_baselines") else None,
    )
    link_bps = float(load["rate_mbit"]) * 1e6  # type: ignore[arg-type]
    if hasattr(sched, "set_link_bandwidth"):
        sched.set_link_bandwidth("link", link_bps)  # type: ignore[attr-defined]
    num_layers = int(load["layers"])  # type: ignore[call-overload]
    chunk = 32 * 1024
    tx = TcpTransferSender(host, port, source_host=source, chunk_bytes=chunk, timeout_s=60.0)
    loop = asyncio.get_running_loop()
    gate = asyncio.Condition()
    wanting: set[str] = set()
    # Overload pruning as the live flow-scheduler runs it (load["prune"]): on every flow's arrival and departure,
    # the scheduler's worst-case check over the requests with flows on the link, each delayed by its remaining
    # bytes over the link rate; a pruned request stops sending and counts as missed (live, it is re-run).
    pruning = bool(load.get("prune"))
    pruned: set[str] = set()
    request_of: dict[str, str] = {}

    def prune_check() -> None:
        if not pruning:
            return
        est: dict[str, float] = {}
        for fid in wanting:
            st = sched.state(fid)
            if st is not None:
                est[request_of[fid]] = est.get(request_of[fid], 0.0) + st.remaining_bytes * 8.0 / link_bps * 1000.0
        pruned.update(sched.prune(now_ms(), est))

    def now_ms() -> float:
        return (loop.time() - t0) * 1000.0

    async def transfer(spec: FlowSpec) -> bool:
        """Send one flow under the scheduler; False when its request was pruned (what is left is not sent)."""
        if spec.request_id in pruned:
            return False
        sched.on_arrival(spec, now_ms())  # the scheduler must know the flow to rank it
        wanting.add(spec.flow_id)
        request_of[spec.flow_id] = spec.request_id
        prune_check()
        sent = 0
        try:
            while sent < spec.size_bytes:
                if spec.request_id in pruned:
                    return False
                async with gate:  # host-side strict priority: wait while a smaller key wants to send
                    while True:
                        keys = sched.service_keys(now_ms())
                        rates = sched.rates(now_ms(), {"link": link_bps}) or {}
                        mine = keys.get(spec.flow_id)
                        # Paced flows (Karuna) take only their rate: they never hold others back.
                        if spec.request_id in pruned:
                            break
                        if mine is None or all(keys.get(f, mine) >= mine or f in rates for f in wanting):
                            break
                        await gate.wait()
                if spec.request_id in pruned:
                    return False
                level = sched.priorities(now_ms()).get(spec.flow_id, sched.num_levels)
                n = min(chunk, spec.size_bytes - sent)
                await tx.send(f"{spec.flow_id}#{sent}", bytes(n), level=level, rate_bps=rates.get(spec.flow_id))
                sent += n
                sched.on_progress(spec.flow_id, spec.size_bytes - sent, now_ms())
                async with gate:
                    gate.notify_all()
        finally:
            wanting.discard(spec.flow_id)
            request_of.pop(spec.flow_id, None)
            sched.on_complete(spec.flow_id, now_ms())
            prune_check()
            async with gate:
                gate.notify_all()
        return True

    ttft_ms: dict[str, float] = {}

    async def request(r: dict[str, object]) -> None:
        rid = str(r["id"])
        arrival_ms = float(r["arrival_ms"])  # type: ignore[arg-type]
        await asyncio.sleep(max(arrival_ms - now_ms(), 0.0) / 1000.0)
        deadline_ms = arrival_ms + float(r["slo_ms"])  # type: ignore[arg-type]
        unit = f"u-{rid}"
        sched.on_layer_boundary(unit, 0, now_ms())
        reused = await transfer(
            FlowSpec(
                f"{rid}-reuse",
                rid,
                unit,
                Stage.KV_REUSE,
                int(r["reuse_bytes"]),
                "A",
                "B",  # type: ignore[call-overload]
                ("link",),
                target_layer=1,
                request_deadlines_ms=(deadline_ms,),
                request_deadline_ms=deadline_ms,
            )
        )
        if not reused:
            sched.on_unit_done(unit, now_ms())
            return  # pruned: no TTFT, a miss
        layer_s = float(r["compute_ms"]) / num_layers / 1000.0  # type: ignore[arg-type]
        for layer in range(1, num_layers + 1):
            await asyncio.sleep(layer_s)
            sched.on_layer_boundary(unit, layer, now_ms())
        sched.on_unit_done(unit, now_ms())
        handed = await transfer(
            FlowSpec(
                f"{rid}-p2d",
                rid,
                unit,
                Stage.P2D,
                int(r["p2d_bytes"]),
                "A",
                "B",
                ("link",),  # type: ignore[call-overload]
                deadline_ms=deadline_ms,
                request_deadlines_ms=(deadline_ms,),
            )
        )
        if not handed:
            return
        ttft_ms[rid] = now_ms() - arrival_ms

    async def ticker() -> None:
        # Time-driven promotions (a flow's MLU rises as its deadline nears) happen on ticks; wake the gate
        # after each so a flow promoted past a waiting one overtakes it.
        while True:
            await asyncio.sleep(TICK_MS / 1000.0)
            sched.on_tick(now_ms())
            async with gate:
                gate.notify_all()

    for level in range(1, sched.num_levels + 1):  # connections up before the clock starts
        await tx.send(f"warmup-{level}", b"", level=level)
    t0 = loop.time()
    tick = asyncio.create_task(ticker())
    try:
        await asyncio.gather(*(request(r) for r in load["requests"]))  # type: ignore[union-attr]
    finally:
        tick.cancel()
    await tx.close()
    print(json.dumps({"ttft_ms": ttft_ms, "pruned": sorted(pruned)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nitsum.bench.testbed")
    p.add_argument("mode", choices=("receive", "send", "replay"))
    p.add_argument("--host", required=True, help="receiver address (inside the namespaces)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--source", default=None, help="sender's local address to bind")
    args = p.parse_args(argv)
    if args.mode == "receive":
        return asyncio.run(_receive(args.host, args.port))
    plan = json.loads(sys.stdin.read())
    if args.mode == "replay":
        if not isinstance(plan, dict):
            p.error("the load on stdin must be a JSON object")
        return asyncio.run(_replay(args.host, args.port, args.source, plan))
    if not isinstance(plan, list):
        p.error("the plan on stdin must be a JSON list")
    return asyncio.run(_send(args.host, args.port, args.source, plan))


if __name__ == "__main__":
    sys.exit(main())
