"""An HTTP client of the gateway run inside a network namespace (tests/net/test_netns_mesh.py).

Waits until the gateway is ready and the coordinator has `--workers` ready workers, streams `--n` greedy completions
and prints JSON lines: {"event": "mid"} once every stream has `--mid` tokens (the test then kills a server), and
{"event": "done", "results": [...]} at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import nats

from tests.e2e.harness import prompts, stream_completion


async def wait_mesh(url: str, nats_url: str, workers: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get(url + "/ready") as resp:
                    ready = resp.status == 200
                nc = await nats.connect(servers=nats_url.split(","), allow_reconnect=False, connect_timeout=2)
                try:
                    msg = await nc.request("nitsum.admin.status", b"{}", timeout=2)
                finally:
                    await nc.close()
                status = json.loads(msg.data)
                if ready and sum(w["state"] == "ready" for w in status.get("workers", [])) >= workers:
                    return
                last = f"ready={ready} workers={[(w.get('worker_id'), w['state']) for w in status.get('workers', [])]}"
            except Exception as exc:  # not up yet
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise SystemExit(f"the mesh did not become ready: {last}")
            await asyncio.sleep(0.3)


async def main(args) -> None:
    await wait_mesh(args.url, args.nats, args.workers, 150.0)
    batch = prompts(args.n, seed=11)
    counts = [0] * args.n
    said = {"mid": False}

    def tracker(i):
        def on_token(n):
            counts[i] = n
            if not said["mid"] and min(counts) >= args.mid:
                said["mid"] = True
                print(json.dumps({"event": "mid", "counts": counts}), flush=True)

        return on_token

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        results = await asyncio.gather(
            *(
                stream_completion(session, args.url, p, args.max_tokens, on_token=tracker(i))
                for i, p in enumerate(batch)
            )
        )
    print(
        json.dumps(
            {
                "event": "done",
                "results": [{"status": r.status, "tokens": r.token_ids, "error": r.error} for r in results],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--nats", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--mid", type=int, default=10000)
    asyncio.run(main(p.parse_args()))
