"""`nitsum bench gateway --floor`: the floor of the hops -- what the mesh's processes and NATS hops cost with no
nitsum code on them, measured with the same client as the mesh.

Two floors, each a set of bare relay processes (`python -m nitsum_load.bench_floor ROLE ...`, uvloop like the
services, aiohttp and nats-py like the gateway):

- `http`: one aiohttp server; POST /v1/completions reads and parses the JSON body and answers a fixed,
  completion-shaped JSON body (client -> HTTP only).
- `relay`: the real request path's processes and hops, without their logic: a `front` (aiohttp) sends a NATS
  request of a SubmitRequest's size to `<ns>.req.submit` (queue group) where a `coord` process takes it and
  NATS-requests a `worker` process with a RunRequest-sized body; the worker answers a RunAck-sized reply and
  publishes one frame of the size of a TokenBatch with one chunk to the front's frame subject
  (`<ns>.stream.<worker>.gw.<front>`); the coord answers the front with a SubmitReply-sized reply; the front
  answers HTTP once it has both the reply and the frame. The sizes are those of nitsum's codec for the bench's
  request of `--prompt-tokens` tokens (`message_sizes`); every hop unpacks and packs msgpack, nothing else.

The bench starts its own nats-server (plain, no accounts) for the relay floor. Each relay prints
`ready <port>` once it listens; one that exits or is not ready in time raises RelayError with its name and
the tail of its stderr. Every relay is stopped when the floor ends, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

NAMESPACE = "floor"
WORKER_ID = "w0"
SUBMIT_SUBJECT = f"{NAMESPACE}.req.submit"
RUN_SUBJECT = f"{NAMESPACE}.worker.{WORKER_ID}.run"
COORD_QUEUE = "coordinator"
READY_TIMEOUT_S = 30.0
ROLES = ("http", "front", "coord", "worker")

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


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _spin_until(deadline: float) -> None:
    while time.perf_counter() < deadline:  # pure Python: holds the GIL but for the interpreter's switches
        pass


SERVE = {"http": serve_http, "front": serve_front, "coord": serve_coord, "worker": serve_worker}


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
    p = argparse.ArgumentParser(prog="python -m nitsum_load.bench_floor", description=__doc__)
    p.add_argument("role", choices=ROLES)
    p.add_argument("--nats", default="", help="nats-server URL (front, coord, worker)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout of a relay's own requests")
    for name in ("submit", "run", "run-ack", "submit-reply", "frame"):
        p.add_argument(f"--{name}-bytes", type=int, default=0, help=f"size of the {name} message")
    args = p.parse_args(argv)
    if args.role != "http" and not args.nats:
        p.error(f"{args.role} needs --nats")
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


# ---- the bench side ---------------------------------------------------------------------------------------


class Relays:
    """The relay processes of one floor; `with Relays(dir) as r:` stops every one of them on the way out."""

    def __init__(self, run_dir: Path, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.run_dir = run_dir
        self.ready_timeout_s = ready_timeout_s
        self.procs: list[tuple[str, subprocess.Popen]] = []
        run_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Relays:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, role: str, *extra: str) -> int:
        """Start one relay; returns its HTTP port (0 for a relay without one) once it is ready."""
        out, err = self.run_dir / f"{role}.out", self.run_dir / f"{role}.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nitsum_load.bench_floor", role, *extra],
                stdout=o,
                stderr=e,
                start_new_session=True,  # a terminal's Ctrl-C reaches the bench, which stops it
            )
        self.procs.append((role, proc))
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            for line in out.read_text(errors="replace").splitlines():
                if line.startswith("ready "):
                    return int(line.split()[1])
            if proc.poll() is not None:
                raise RelayError(
                    f"floor relay {role!r} exited with {proc.returncode} before it was ready:\n{_tail(err)}"
                )
            if time.monotonic() > deadline:
                raise RelayError(f"floor relay {role!r} was not ready within {self.ready_timeout_s:g} s:\n{_tail(err)}")
            time.sleep(0.05)

    def stop(self) -> None:
        from nitsum_load.mesh import stop_process

        while self.procs:
            stop_process(self.procs.pop()[1], timeout_s=5.0)


def _tail(path: Path, chars: int = 2000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:] if text.strip() else "(its stderr is empty)"


def tree_cpu_s(root: int | None = None) -> float | None:
    """CPU seconds (user + system) used so far by process `root` (this one by default) and every live descendant
    (Linux /proc; None elsewhere). A phase's CPU is the difference of two readings: the bench's client, and the
    relays, nats-server or the mesh it started."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ... utime stime
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    if root not in cpu:
        return None
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu[pid] for pid in tree)


def size_args(sizes: dict[str, int]) -> list[str]:
    return [a for name, n in sizes.items() for a in (f"--{name.replace('_', '-')}-bytes", str(n))]


def run_floors(
    measure: Callable[[str], dict],
    run_dir: Path,
    sizes: dict[str, int],
    timeout_s: float,
    per_token: Callable[[str], Any] | None = None,
) -> dict:
    """Measure the http floor, then the relay floor (on a nats-server of its own), one after the other; then, with
    `per_token`, its streams through the same relays (under "per_token")."""
    from nitsum.natsserver import NatsServer, free_port

    floors: dict[str, dict] = {}
    with Relays(run_dir / "http") as relays:
        port = relays.start("http")
        print(f"http floor on port {port}: the same requests ...", flush=True)
        floors["http"] = measure(f"http://127.0.0.1:{port}")
    nats = NatsServer(port=free_port(), config_path=None).start(log_path=run_dir / "nats.log")
    try:
        with Relays(run_dir / "relay") as relays:
            common = ["--nats", nats.url, "--timeout", str(timeout_s), *size_args(sizes)]
            relays.start("worker", *common)
            relays.start("coord", *common)
            port = relays.start("front", *common)
            print(f"relay floor on port {port} (front -> coord -> worker over NATS): the same requests ...", flush=True)
            floors["relay"] = measure(f"http://127.0.0.1:{port}")
            if per_token is not None:
                print("per-token floor: streams through the same relays ...", flush=True)
                floors["per_token"] = per_token(f"http://127.0.0.1:{port}")
    finally:
        nats.stop()
    return floors


def floor_result(compare, engine: dict, floors: dict, gateway: dict | None, sizes: dict[str, int]) -> dict:
    """The floor rows beside the mesh's (when it ran); `compare` is bench_gateway.compare.

    A floor runs no engine, so all of its latency is added latency: its `added_latency_*` is its own latency
    (what the hops alone cost), where the mesh's is its latency minus the in-process engine's, as the bench
    reports it. Throughput ratios are all to the in-process engine."""
    rows: dict[str, dict] = {}
    for name, measured in (*floors.items(), *((("mesh", gateway),) if gateway is not None else ())):
        c = compare(engine, measured)
        lat = c["gateway_latency_ms"]
        rows[name] = {
            "latency_ms": lat,
            "added_latency_p50_ms": c["added_latency_p50_ms"] if name == "mesh" else lat["p50"],
            "added_latency_p90_ms": c["added_latency_p90_ms"] if name == "mesh" else lat["p90"],
            "requests_per_s": c["gateway_requests_per_s"],
            "throughput_ratio": c["throughput_ratio"],
            "throughput_cpu_ms_per_request": measured.get("throughput_cpu_ms_per_request"),
        }
    out: dict[str, Any] = {
        "rows": rows,
        "engine_throughput_cpu_ms_per_request": engine.get("throughput_cpu_ms_per_request"),
        "message_bytes": sizes,
    }
    e_cpu, r_cpu = out["engine_throughput_cpu_ms_per_request"], rows["relay"]["throughput_cpu_ms_per_request"]
    if e_cpu and r_cpu:
        # Every core busy, nothing else running: the engine's CPU per request plus the relay floor's (hops,
        # nats-server and this client) is the least any mesh with these hops spends per request here.
        bound = (os.cpu_count() or 1) * 1000.0 / (e_cpu + r_cpu)
        out["cpu_bound"] = {
            "cpus": os.cpu_count(),
            "requests_per_s": bound,
            "ratio": bound / engine["requests_per_s"],
        }
    if "mesh" in rows:
        out["own_code_added_p50_ms"] = rows["mesh"]["added_latency_p50_ms"] - rows["relay"]["added_latency_p50_ms"]
        out["own_code_added_p90_ms"] = rows["mesh"]["added_latency_p90_ms"] - rows["relay"]["added_latency_p90_ms"]
    return out


def format_floor(engine_latency: dict, engine_rps: float, floor: dict) -> str:
    labels = {
        "http": "http floor (aiohttp only)",
        "relay": "relay floor (3 procs, NATS)",
        "mesh": "mesh (nitsum up)",
    }
    lines = [
        "floor of the hops              p50 (ms)   p90 (ms)   added p50   requests/s   / engine",
        f"{'in-process engine':29s} {engine_latency['p50']:9.2f}  {engine_latency['p90']:9.2f}  {'':>10s}"
        f"  {engine_rps:11.1f}   {1.0:7.2f}x",
    ]
    for name, row in floor["rows"].items():
        lines.append(
            f"{labels[name]:29s} {row['latency_ms']['p50']:9.2f}  {row['latency_ms']['p90']:9.2f}"
            f"  {row['added_latency_p50_ms']:+10.2f}  {row['requests_per_s']:11.1f}   {row['throughput_ratio']:7.2f}x"
        )
    if "cpu_bound" in floor:
        b = floor["cpu_bound"]
        lines.append(
            f"CPU per request at concurrency: engine {floor['engine_throughput_cpu_ms_per_request']:.2f} ms, "
            + ", ".join(
                f"{name} {row['throughput_cpu_ms_per_request']:.2f} ms"
                for name, row in floor["rows"].items()
                if row["throughput_cpu_ms_per_request"] is not None
            )
            + f"; engine + relay floor on all {b['cpus']} cores: at most {b['requests_per_s']:.0f} requests/s"
            f" ({b['ratio']:.2f}x the engine)"
        )
    if "own_code_added_p50_ms" in floor:
        lines.append(
            f"nitsum's own code adds (mesh - relay floor): p50 {floor['own_code_added_p50_ms']:+.2f} ms, "
            f"p90 {floor['own_code_added_p90_ms']:+.2f} ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(relay_main(sys.argv[1:]))
