"""Processes for the namespace testbed: `python -m nitsum.transfer.testbed receive|send ...`.

receive: a TcpTransferReceiver on --host/--port; prints "ready" once listening and serves until its
         stdin closes (so it never outlives the test that started it).
send:    reads a JSON plan from stdin — [{"flow_id", "size_bytes", "level", "start_ms", "rate_bps"}] —
         sends every flow at its start time and level, and prints {"finish_ms": {id: ms}, "errors": {id: msg}}
         with times relative to the plan's start (ACK received = finished).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from nitsum.transfer.framing import TransferError
from nitsum.transfer.tcp import MemorySink, TcpTransferReceiver, TcpTransferSender


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
            await tx.send(fid, bytes(int(spec["size_bytes"])), level=int(spec["level"]),  # type: ignore[call-overload]
                          rate_bps=float(rate) if rate else None)  # type: ignore[arg-type]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nitsum.transfer.testbed")
    p.add_argument("mode", choices=("receive", "send"))
    p.add_argument("--host", required=True, help="receiver address (inside the namespaces)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--source", default=None, help="sender's local address to bind")
    args = p.parse_args(argv)
    if args.mode == "receive":
        return asyncio.run(_receive(args.host, args.port))
    plan = json.loads(sys.stdin.read())
    if not isinstance(plan, list):
        p.error("the plan on stdin must be a JSON list")
    return asyncio.run(_send(args.host, args.port, args.source, plan))


if __name__ == "__main__":
    sys.exit(main())
