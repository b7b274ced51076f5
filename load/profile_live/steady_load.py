"""Steady load for profiling: phase 'tokens' (C streams of N tokens, closed loop, D seconds), phase 'requests'
(C in flight of 1-token non-streamed requests, D seconds). Prints tokens and requests done per phase."""

import asyncio
import json
import sys
import time

import aiohttp

url, phase, conc, dur = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
ntok = int(sys.argv[5]) if len(sys.argv) > 5 else 64


async def main():
    done = {"req": 0, "tok": 0}
    stop = time.monotonic() + dur
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(i):
            while time.monotonic() < stop:
                i += conc
                prompt = [100 + (i * 7 + j) % 100 for j in range(16)]
                if phase == "tokens":
                    body = {
                        "model": "tiny",
                        "prompt": prompt,
                        "max_tokens": ntok,
                        "ignore_eos": True,
                        "stream": True,
                        "temperature": 0,
                    }
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        async for line in r.content:
                            if line.startswith(b"data: {"):
                                done["tok"] += 1
                else:
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                        done["tok"] += 1
                done["req"] += 1

        t = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(conc)))
        print(json.dumps({"phase": phase, "conc": conc, "s": time.monotonic() - t, **done}))


asyncio.run(main())
