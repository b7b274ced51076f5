"""The bare relay processes of `nitsum bench gateway --floor` (load/bench_floor.py starts and measures them):
`python -m nitsum_load.floor_relays ROLE ...`, uvloop like the services, aiohttp and nats-py like the gateway.

Roles: `http` (an aiohttp server answering a fixed, completion-shaped JSON body), and the relay floor's `front`
(aiohttp -> NATS request to the submit subject), `coord` (queue group; NATS-requests the worker) and `worker`
(answers, publishes one frame to the front's frame subject), with messages of the sizes nitsum's codec gives
(`message_sizes`) and no nitsum code. `engine-worker` is the worker with the real engine in it (`--model`, built
as the in-process baseline builds it): the requests it is asked to run join the engine's next step, stepped on
a thread of its own while the loop answers and publishes (`--step-inline`: on the event loop itself, no thread
hand-off), one frame per request and step -- the least a worker around this engine must do, none of the worker
service's code. It answers `STATS_SUBJECT` with its steps and the requests that joined them. Each prints `ready <port>` once it listens and stops on SIGTERM/SIGINT;
one that cannot start says why on stderr and exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from typing import Any

import msgpack

NAMESPACE = "floor"
WORKER_ID = "w0"
SUBMIT_SUBJECT = f"{NAMESPACE}.req.submit"
RUN_SUBJECT = f"{NAMESPACE}.worker.{WORKER_ID}.run"
STATS_SUBJECT = f"{NAMESPACE}.worker.{WORKER_ID}.stats"  # engine-worker: its steps so far (msgpack map)
COORD_QUEUE = "coordinator"
READY_TIMEOUT_S = 30.0
ROLES = ("http", "front", "coord", "worker", "engine-worker")

# The fixed answer of both floors: a non-streamed 1-token completion, as the gateway answers one.
COMPLETION = {
    "id": "cmpl-floor",
    "object": "text_completion",
    "created": 0,
    "model": "floor",
    "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 16, "completion_tokens": 1, "total_tokens": 17},
}
COMPLETION_BYTES = json.dumps(COMPLETION).encode()


class RelayError(RuntimeError):
    """A floor relay did not start (or died): names it and carries the tail of its stderr."""


def message_sizes(prompt: list[int]) -> dict[str, int]:
    """Encoded sizes (nitsum's codec) of the request path's messages for one 1-token request of `prompt`."""
    from nitsum.wire import encode
    from nitsum.wire import messages as m

    rid, worker, gateway = "cmpl-" + uuid.uuid4().hex, "worker-0", "gw-" + uuid.uuid4().hex[:12]
    submit = m.SubmitRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=m.SamplingSpec(max_tokens=1, ignore_eos=True),
        tier="interactive",
        ttft_ms=500.0,
        tpot_ms=50.0,
        weight=1.0,
        arrival_unix_ms=time.time() * 1000.0,
        stream_subject=f"nitsum.stream.*.gw.{gateway}",
    )
    chunk = m.TokenChunk(rid, worker, 0, (123,), "x", True, "length", len(prompt), 0, attempt=0)
    return {
        "submit": len(encode(submit)),
        "run": len(encode(m.RunRequest(submit))),
        "run_ack": len(encode(m.RunAck(rid, worker, True))),
        "submit_reply": len(encode(m.SubmitReply(rid, True, worker, "g-" + worker))),
        "frame": len(encode(m.TokenBatch(worker, (chunk,)))),
    }


def padded(fields: list, size: int) -> bytes:
    """msgpack of `fields` plus one bytes field, sized so that the whole frame is `size` bytes (or just the
    fields when they alone are larger)."""
    base = len(msgpack.packb([*fields, b""]))
    pad = max(0, size - base)
    frame = msgpack.packb([*fields, bytes(pad)])
    while len(frame) > size and pad > 0:  # the bytes field's own length header grew
        pad -= len(frame) - size
        pad = max(0, pad)
        frame = msgpack.packb([*fields, bytes(pad)])
    return frame


# ---- the relays (child processes) ------------------------------------------------------------------------


async def _nats(url: str, name: str):
    import nats

    async def quiet(_exc: Exception) -> None:  # the one failure that matters is raised by connect below
        pass

    try:
        return await nats.connect(
            servers=[url], name=name, allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=2, error_cb=quiet
        )
    except Exception as exc:  # nats-py raises several types for "cannot connect"
        raise RuntimeError(f"cannot connect to NATS at {url}: {exc}") from None


async def _http_site(handler) -> tuple[Any, int]:
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


async def serve_http(args) -> tuple[list, int]:
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        json.loads(await request.read())
        return web.Response(body=COMPLETION_BYTES, content_type="application/json")

    runner, port = await _http_site(completions)
    return [runner.cleanup], port


def _chunk(rid: str, frame: list) -> bytes:
    """One SSE event of a streamed completion: the frame's token as an OpenAI completion chunk."""
    finish = "length" if frame[5] else None
    body = {"id": rid, "object": "text_completion", "created": 0, "model": "floor"}
    body["choices"] = [{"index": 0, "text": frame[4], "logprobs": None, "finish_reason": finish}]
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def serve_front(args) -> tuple[list, int]:
    from aiohttp import web

    nc = await _nats(args.nats, "floor-front")
    front_id = "gw-" + uuid.uuid4().hex[:12]
    frame_subject = f"{NAMESPACE}.stream.{WORKER_ID}.gw.{front_id}"
    waiting: dict[str, asyncio.Queue] = {}

    async def on_frame(msg) -> None:
        frame = msgpack.unpackb(msg.data)
        queue = waiting.get(frame[0])
        if queue is not None:
            queue.put_nowait(frame)

    await nc.subscribe(f"{NAMESPACE}.stream.*.gw.{front_id}", cb=on_frame)
    await nc.flush()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        rid = "cmpl-" + uuid.uuid4().hex
        waiting[rid] = frames = asyncio.Queue()
        try:
            # A frame per token: max_tokens of them, paced by the worker at floor_step_ms (0: back to back), its
            # step thread sleeping (floor_step_spin false) or spinning in Python, holding the GIL, as the step.
            fields = [rid, frame_subject, body["prompt"], int(body.get("max_tokens", 1))]
            fields += [float(body.get("floor_step_ms", 0.0)), bool(body.get("floor_step_spin", False))]
            submit = padded(fields, args.submit_bytes)
            reply = msgpack.unpackb((await nc.request(SUBMIT_SUBJECT, submit, timeout=args.timeout)).data)
            if not reply[1]:
                return web.json_response({"error": {"message": f"coord refused: {reply[2]}"}}, status=502)
            if not body.get("stream"):
                while not (await asyncio.wait_for(frames.get(), args.timeout))[5]:
                    pass
                return web.Response(body=COMPLETION_BYTES, content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            while True:
                frame = await asyncio.wait_for(frames.get(), args.timeout)
                await resp.write(_chunk(rid, frame))
                if frame[5]:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            del waiting[rid]

    runner, port = await _http_site(completions)
    return [runner.cleanup, nc.close], port


async def serve_coord(args) -> tuple[list, int]:
    nc = await _nats(args.nats, "floor-coord")
    tasks: set[asyncio.Task] = set()

    async def route(msg) -> None:
        try:
            fields = msgpack.unpackb(msg.data)[:-1]  # the request as the front sent it, its padding aside
            run = padded(fields, args.run_bytes)
            msgpack.unpackb((await nc.request(RUN_SUBJECT, run, timeout=args.timeout)).data)
            await nc.publish(msg.reply, padded([fields[0], True, WORKER_ID], args.submit_reply_bytes))
        except Exception as exc:  # refused, as the coordinator refuses a request it cannot place
            print(f"floor relay coord: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            await nc.publish(msg.reply, msgpack.packb(["", False, f"{type(exc).__name__}: {exc}"]))

    async def on_submit(msg) -> None:  # one task per request, as the coordinator handles submissions
        task = asyncio.create_task(route(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(SUBMIT_SUBJECT, queue=COORD_QUEUE, cb=on_submit)
    await nc.flush()
    return [nc.close], 0


async def serve_worker(args) -> tuple[list, int]:
    from concurrent.futures import ThreadPoolExecutor

    nc = await _nats(args.nats, "floor-worker")
    loop = asyncio.get_running_loop()
    step_thread = ThreadPoolExecutor(1)  # where an engine would step; only paced streams use it
    tasks: set[asyncio.Task] = set()

    async def frames(rid: str, subject: str, prompt: list, tokens: int, step_s: float, spin: bool) -> None:
        start = time.perf_counter()
        step = _spin_until if spin else _sleep_until
        for i in range(tokens):
            if step_s > 0:  # "steps" end on a fixed grid, so a late wake-up does not delay the ones after it
                await loop.run_in_executor(step_thread, step, start + (i + 1) * step_s)
            last = i == tokens - 1
            await nc.publish(subject, padded([rid, WORKER_ID, i, [123], "x", last, len(prompt)], args.frame_bytes))

    async def on_run(msg) -> None:
        rid, subject, prompt, tokens, step_ms, spin = msgpack.unpackb(msg.data)[:6]
        await nc.publish(msg.reply, padded([rid, WORKER_ID, True], args.run_ack_bytes))
        if tokens == 1 and step_ms == 0:
            await frames(rid, subject, prompt, 1, 0.0, False)
            return
        task = asyncio.create_task(frames(rid, subject, prompt, max(1, tokens), step_ms / 1000.0, spin))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(RUN_SUBJECT, cb=on_run)
    await nc.flush()

    async def close() -> None:
        await nc.close()
        step_thread.shutdown(wait=False, cancel_futures=True)

    return [close], 0


async def serve_engine_worker(args) -> tuple[list, int]:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from nitsum.engine.params import SamplingParams
    from nitsum_load.bench_gateway import build_in_process

    engine = build_in_process(args.model)
    nc = await _nats(args.nats, "floor-engine-worker")
    loop = asyncio.get_running_loop()
    step_thread = ThreadPoolExecutor(1)
    arrived: list[tuple[str, list, int]] = []  # (request id, prompt, tokens) since the last step began
    streams: dict[str, list] = {}  # request id -> [frame subject, prompt length, tokens sent]
    wake = asyncio.Event()
    stats = {"steps": 0, "requests": 0, "outputs": 0}  # outputs: Σ over steps of the requests a step advanced

    def step(new: list[tuple[str, list, int]]) -> list:
        with torch.inference_mode():
            for rid, prompt, tokens in new:
                engine.add_request(rid, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
            return engine.step()

    async def stepping() -> None:
        while True:
            if not arrived and not engine.has_unfinished():
                wake.clear()
                await wake.wait()
                continue
            new = arrived[:]
            arrived.clear()
            if args.step_inline:
                outs = step(new)
                await asyncio.sleep(0)  # what arrived meanwhile is read before the next step
            else:
                outs = await loop.run_in_executor(step_thread, step, new)
            stats["steps"] += 1
            stats["requests"] += len(new)
            stats["outputs"] += len(outs)
            for out in outs:
                stream = streams[out.request_id]
                fields = [out.request_id, WORKER_ID, stream[2], list(out.new_token_ids), out.text_delta]
                stream[2] += len(out.new_token_ids)
                await nc.publish(stream[0], padded([*fields, out.finished, stream[1]], args.frame_bytes))
                if out.finished:  # a hybrid engine drops a finished request itself
                    del streams[out.request_id]

    async def on_run(msg) -> None:
        rid, subject, prompt, tokens = msgpack.unpackb(msg.data)[:4]
        await nc.publish(msg.reply, padded([rid, WORKER_ID, True], args.run_ack_bytes))
        streams[rid] = [subject, len(prompt), 0]
        arrived.append((rid, prompt, max(1, tokens)))
        wake.set()

    async def on_stats(msg) -> None:
        await nc.publish(msg.reply, msgpack.packb(stats))

    task = asyncio.create_task(stepping())
    await nc.subscribe(RUN_SUBJECT, cb=on_run)
    await nc.subscribe(STATS_SUBJECT, cb=on_stats)
    await nc.flush()

    async def close() -> None:
        task.cancel()
        await nc.close()
        step_thread.shutdown(wait=False, cancel_futures=True)

    return [close], 0


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _spin_until(deadline: float) -> None:
    while time.perf_counter() < deadline:  # pure Python: holds the GIL but for the interpreter's switches
        pass


SERVE = {
    "http": serve_http,
    "front": serve_front,
    "coord": serve_coord,
    "worker": serve_worker,
    "engine-worker": serve_engine_worker,
}


async def _serve(args) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    closers, port = await SERVE[args.role](args)
    print(f"ready {port}", flush=True)
    await stop.wait()
    for close in closers:
        await close()


def relay_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m nitsum_load.floor_relays", description=__doc__)
    p.add_argument("role", choices=ROLES)
    p.add_argument("--nats", default="", help="nats-server URL (front, coord, worker)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout of a relay's own requests")
    p.add_argument("--model", default="", help="engine-worker: the model (as `nitsum bench gateway --model`)")
    p.add_argument("--step-inline", action="store_true", help="engine-worker: step on the event loop, not a thread")
    for name in ("submit", "run", "run-ack", "submit-reply", "frame"):
        p.add_argument(f"--{name}-bytes", type=int, default=0, help=f"size of the {name} message")
    args = p.parse_args(argv)
    if args.role != "http" and not args.nats:
        p.error(f"{args.role} needs --nats")
    if args.role == "engine-worker" and not args.model:
        p.error("engine-worker needs --model")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_serve(args))
    except Exception as exc:  # a relay that cannot start says why on stderr, then exits non-zero
        print(f"floor relay {args.role}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(relay_main(sys.argv[1:]))
