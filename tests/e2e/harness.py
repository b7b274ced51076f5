"""A mesh assembled service by service (real nats-server, real processes), for fault tests that need to
kill, stop, restart or pause one piece without `nitsum up` restarting it behind the test's back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from nitsum.natsserver import NatsServer, free_port


@dataclass
class Service:
    name: str
    service: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None

    def start(self) -> Service:
        log = open(self.log_path, "ab")
        from nitsum.up import _die_with_parent

        # Dies with the test process even if the test is killed before its teardown runs.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nitsum.cli", "serve", self.service],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        log.close()
        return self

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        self.ask_to_stop()
        return self.wait_stopped(timeout_s)

    def ask_to_stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()

    def wait_stopped(self, timeout_s: float = 20.0) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@dataclass
class ManualMesh:
    tmp: Path
    model_dir: Path
    num_workers: int = 2
    env_extra: dict[str, str] = field(default_factory=dict)
    nats: NatsServer | None = None
    services: dict[str, Service] = field(default_factory=dict)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        env.update(
            {
                "NITSUM_NATS_URL": self.nats.url,
                "NITSUM_MODEL": str(self.model_dir),
                "NITSUM_RUN_DIR": str(self.tmp),
                "NITSUM_HEARTBEAT_INTERVAL_MS": "200",
                "NITSUM_HEARTBEAT_TIMEOUT_MS": "1500",
                "NITSUM_STREAM_TIMEOUT_S": "10",
                "NITSUM_READY_TIMEOUT_S": "2",
                "NITSUM_RECONFIG_INTERVAL_MS": "500",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.env_extra)
        return env

    def add(self, name: str, service: str, **env: str) -> Service:
        full = self.base_env()
        full["NITSUM_METRICS_PORT"] = str(free_port())
        full.update(env)
        svc = Service(name, service, full, self.tmp / f"{name}.log")
        self.services[name] = svc
        return svc

    def start(self) -> ManualMesh:
        self.nats_port = free_port()
        self.nats = NatsServer(port=self.nats_port, config_path=None).start(log_path=self.tmp / "nats.log")
        self.port = free_port()
        self.add("coordinator", "coordinator").start()
        for i in range(self.num_workers):
            self.add_worker(i).start()
        self.add("gateway", "gateway", NITSUM_GATEWAY_PORT=str(self.port), NITSUM_GATEWAY_HOST="127.0.0.1").start()
        self.wait_ready()
        self.wait_workers(self.num_workers)
        return self

    def add_worker(self, i: int) -> Service:
        return self.add(f"worker-{i}", "decode-worker", NITSUM_WORKER_ID=f"node0-{i}", NITSUM_DEVICE_INDEX=str(i))

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.services[name].env['NITSUM_METRICS_PORT']}/metrics"

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for svc in self.services.values():
                if (
                    svc.process is not None
                    and svc.process.poll() is not None
                    and svc.process.returncode not in (0, -9, -15)
                ):
                    raise RuntimeError(f"{svc.name} died: {svc.log_path.read_text()[-3000:]}")
            try:
                status, body = http_get(self.url + "/ready", timeout_s=5)
                if status == 200:
                    return
                last = str(body)
            except OSError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"mesh not ready: {last}")

    def admin_status(self) -> dict:
        return asyncio.run(_admin(self.nats.url, "status", {}))

    def wait_workers(self, count: int, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        status = {}
        while time.monotonic() < deadline:
            try:
                status = self.admin_status()
            except Exception:  # a coordinator that is (re)starting answers nothing for a moment
                time.sleep(0.2)
                continue
            ready = [w for w in status.get("workers", []) if w["state"] == "ready"]
            if len(ready) == count:
                return status
            time.sleep(0.2)
        raise RuntimeError(f"expected {count} ready workers, have {status}")

    def stop(self) -> None:
        # All at once, as `nitsum up` stops its children: one by one, a node world's follower sat in its
        # collective waiting for a leader that was told to stop only after it (seconds per test).
        for svc in reversed(list(self.services.values())):
            svc.ask_to_stop()
        for svc in reversed(list(self.services.values())):
            svc.wait_stopped()
        if self.nats is not None:
            self.nats.stop()
        # A node world's workers share the model's weights in /dev/shm; like `nitsum up`, the mesh that made
        # the store removes it (each test's model lives in its own tmp dir: its store would outlive the run).
        from nitsum.up import _remove_weight_store

        _remove_weight_store(Path(self.model_dir), self.base_env().get("NITSUM_DTYPE", "float32"))


async def _admin(url: str, command: str, body: dict) -> dict:
    import nats

    nc = await nats.connect(servers=[url], allow_reconnect=False, connect_timeout=2)
    try:
        msg = await nc.request(f"nitsum.admin.{command}", json.dumps(body).encode(), timeout=2)
        return json.loads(msg.data)
    finally:
        await nc.close()


def http_get(url: str, timeout_s: float = 10.0):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@dataclass
class StreamResult:
    status: int
    token_ids: list[int]
    finish_reason: str | None
    error: dict | None
    request_id: str
    indices_ok: bool = True


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    headers: dict | None = None,
    on_token=None,
) -> StreamResult:
    """A greedy streamed completion with token ids; records every token in order."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(url + "/v1/completions", json=body, headers=headers or {}) as resp:
        request_id = resp.headers.get("x-request-id", "")
        if resp.status != 200:
            return StreamResult(resp.status, [], None, (await resp.json()).get("error"), request_id)
        tokens: list[int] = []
        finish, error, done = None, None, False
        buffer = b""
        async for data in resp.content.iter_any():
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                line = event.decode().removeprefix("data: ")
                if line == "[DONE]":
                    done = True
                    continue
                obj = json.loads(line)
                if "error" in obj:
                    error = obj["error"]
                    continue
                for choice in obj["choices"]:
                    tokens.extend(choice.get("token_ids", []))
                    finish = choice.get("finish_reason") or finish
                if on_token is not None:
                    on_token(len(tokens))
        if not done and error is None:  # the connection closed mid-stream: never a success
            error = {"code": "no_done", "message": f"the stream ended without [DONE] after {len(tokens)} token(s)"}
        return StreamResult(200, tokens, finish, error, request_id)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of different lengths (token ids inside the tiny vocabulary)."""
    out = []
    for i in range(n):
        length = 4 + (i * 7 + seed) % 40
        out.append([3 + (i * 31 + j * 17 + seed) % 250 for j in range(length)])
    return out


def counter_total(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples whose labels include `labels` (0 when absent)."""
    import re

    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def stream_across_changes(
    url: str, batch: list[list[int]], lengths: list[int], changes, change, timeout_s: float = 300.0
):
    """Stream the batch; once every stream has a token, `await change(c)` for each of `changes` in turn, letting
    every stream move on before the next. Returns (stream results, the changes' answers)."""
    counts = [0] * len(batch)
    answers = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        def tracker(i):
            def on_token(n):
                counts[i] = n

            return on_token

        tasks = [
            asyncio.create_task(stream_completion(session, url, p, n, on_token=tracker(i)))
            for i, (p, n) in enumerate(zip(batch, lengths))
        ]
        for c in changes or []:
            while min(counts) < 1 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            answers.append(await change(c))
            marks = list(counts)
            while any(k <= m and k < n for k, m, n in zip(counts, marks, lengths)) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
        results = await asyncio.gather(*tasks)
    return results, answers
