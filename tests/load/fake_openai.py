"""A tiny OpenAI-compatible streaming server for client tests, run on its own thread and event loop.

Behaviour is chosen by the request's `model`: "ok" streams normally; "fail-429", "fail-503", "fail-400",
"fail-500" answer with that status; "break" streams two tokens then drops the connection; "slow" waits 1 s
before answering, "hang" 60 s; "no-done" ends with a finish_reason but no [DONE]; "in-stream-error" sends an error event;
"multi" sends all tokens in one chunk with token_ids. Without `stream: true` it answers one JSON body. Every request's headers and body are kept in `seen`.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

FIRST_TOKEN_DELAY_S = 0.004
TOKEN_DELAY_S = 0.002


class FakeOpenAI:
    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeOpenAI:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        # shutdown_timeout: do not wait out a handler still sleeping for a client that already gave up.
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        # Handlers still sleeping ("hang") for clients that left: cancel them so none outlives the loop.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "ok", "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
        mode = body["model"]
        chat = request.path.endswith("/chat/completions")
        if mode.startswith("fail-"):
            status = int(mode.split("-")[1])
            return web.json_response(
                {"error": {"message": "nope", "type": "x", "param": None, "code": status}}, status=status
            )
        if mode == "slow":
            await asyncio.sleep(1.0)
        if mode == "hang":
            await asyncio.sleep(60.0)
        n = int(body["max_tokens"])
        prompt = body.get("prompt") or body["messages"][0]["content"]
        # A made-up tokenizer: 3 tokens per word, plus a 5-token chat template; token-id prompts count as sent.
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 3 * len(prompt.split()) + (5 if chat else 0)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if not body.get("stream"):
            return web.json_response(
                {"choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}], "usage": usage}
            )
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "x-request-id": "srv-1",
                "x-request-tier": request.headers.get("x-request-tier", ""),
            }
        )
        await resp.prepare(request)

        async def event(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def choice(i: int, text: str, finish: str | None = None) -> dict:
            c = {"index": 0, "finish_reason": finish}
            if chat:
                c["delta"] = {"content": text}
            else:
                c["text"] = text
            return c

        if chat:
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        if mode == "in-stream-error":
            await event({"error": {"message": "engine died"}})
            await resp.write_eof()
            return resp
        if mode == "multi":
            c = choice(0, "x" * n, "length")
            c["token_ids"] = list(range(n))
            await event({"choices": [c]})
        else:
            for i in range(n):
                if mode == "break" and i == 2:
                    request.transport.close()
                    return resp
                if i:
                    await asyncio.sleep(TOKEN_DELAY_S)
                await event({"choices": [choice(i, f" t{i}", "length" if i == n - 1 else None)]})
        await event({"choices": [], "usage": usage})
        if mode != "no-done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
