"""`nitsum bench gateway --floor`: the bare relays answer through real processes and a real nats-server, the
bench's JSON carries the floor rows, and a relay that cannot start is named with its stderr (no hang)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgpack
import pytest

from nitsum.natsserver import free_port
from nitsum_load import bench_floor as bf
from nitsum_load import bench_floor_tokens as bft
from nitsum_load import bench_gateway as bg
from nitsum_load import floor_relays as fr
from nitsum_load.mesh import stop_process
from nitsum_load.sse import DONE, SseParser


def _post(port: int, prompt: list[int]) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                return r.status, await r.read()

    return asyncio.run(go())


def test_padded_frames_have_the_asked_size_and_keep_their_fields():
    for size in (40, 120, 300, 70_000):
        frame = fr.padded(["cmpl-1", "floor.stream.w0.gw.x", [1, 2, 3]], size)
        assert len(frame) == size
        assert msgpack.unpackb(frame)[:3] == ["cmpl-1", "floor.stream.w0.gw.x", [1, 2, 3]]
    assert len(fr.padded(["a" * 50], 5)) > 5  # fields larger than the size: sent as they are


def test_message_sizes_grow_with_the_prompt():
    small, large = bf.message_sizes(bg.prompts(1, 16)[0]), bf.message_sizes(bg.prompts(1, 256)[0])
    assert all(n > 0 for n in small.values())
    assert large["submit"] > small["submit"] and large["run"] > small["run"]
    assert small["run"] > small["submit"]  # a RunRequest carries the SubmitRequest


def test_relays_answer_the_completion_through_every_hop(tmp_path, nats_server):
    sizes = bf.message_sizes(bg.prompts(1, 16)[0])
    with bf.Relays(tmp_path / "http") as relays:
        status, body = _post(relays.start("http"), [1, 2])
        assert status == 200 and json.loads(body) == fr.COMPLETION
    common = ["--nats", nats_server.url, "--timeout", "5", *bf.size_args(sizes)]
    with bf.Relays(tmp_path / "relay") as relays:
        relays.start("worker", *common)
        relays.start("coord", *common)
        port = relays.start("front", *common)
        status, body = _post(port, list(range(16)))
        assert status == 200 and json.loads(body) == fr.COMPLETION
        worker = relays.procs[0][1]
        stop_process(worker, timeout_s=5.0)
        # Without the worker the chain is broken: the coord refuses, the front says so.
        status, body = _post(port, list(range(16)))
        assert status == 502 and "coord refused" in json.loads(body)["error"]["message"]
    assert relays.procs == [] and worker.poll() is not None


def test_front_streams_one_sse_chunk_per_worker_frame(tmp_path, nats_server):
    common = ["--nats", nats_server.url, "--timeout", "5", *bf.size_args(bf.message_sizes(bg.prompts(1, 16)[0]))]
    with bf.Relays(tmp_path) as relays:
        relays.start("worker", *common)
        relays.start("coord", *common)
        url = f"http://127.0.0.1:{relays.start('front', *common)}"

        async def raw() -> list[str]:
            async with aiohttp.ClientSession() as s:
                body = {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True, "floor_step_ms": 0.5}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                    return SseParser().feed(await r.read())

        events = asyncio.run(raw())
        assert events[-1] == DONE and len(events) == 6
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert [c["text"] for c in chunks] == ["x"] * 5
        assert [c["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
        measured = asyncio.run(bft.streams(url, bg.prompts(3, 16), 4, 0.0, 1, 5.0))
    assert {k: len(v) for k, v in measured.items()} == {k: 2 for k in measured}  # 3 streams, 1 warm-up
    assert all(x > 0 for x in measured["total_ms"] + measured["single_total_ms"])


@pytest.mark.parametrize("inline", [False, True])
def test_engine_worker_streams_the_engines_own_tokens(tmp_path, nats_server, nitsum_home, inline):
    """The engine relay's worker: requests asked for one after another join its engine's steps; each stream's frames
    carry, in order and indexed from 0, exactly the tokens of the same greedy requests on an in-process engine."""
    import nats

    from nitsum.engine.params import SamplingParams

    batch, tokens = bg.prompts(4, 16), 6
    with bf.Relays(tmp_path, ready_timeout_s=120.0) as relays:
        relays.start(
            "engine-worker", "--nats", nats_server.url, "--model", "tiny", *(["--step-inline"] if inline else [])
        )

        async def run() -> dict[str, list]:
            nc = await nats.connect(servers=[nats_server.url])
            frames: dict[str, list] = {}
            done = asyncio.Event()

            async def on_frame(msg) -> None:
                frame = msgpack.unpackb(msg.data)
                frames.setdefault(frame[0], []).append(frame)
                if sum(1 for f in frames.values() if f[-1][5]) == len(batch):
                    done.set()

            await nc.subscribe("test.frames", cb=on_frame)
            for i, prompt in enumerate(batch):
                ack = msgpack.unpackb(
                    (
                        await nc.request(
                            fr.RUN_SUBJECT, msgpack.packb([f"r{i}", "test.frames", prompt, tokens]), timeout=30
                        )
                    ).data
                )
                assert ack[:3] == [f"r{i}", fr.WORKER_ID, True]
            await asyncio.wait_for(done.wait(), 60)
            await nc.close()
            return frames

        frames = asyncio.run(run())
        steps = bf.engine_steps(nats_server.url)
    assert steps["requests"] == len(batch) and steps["outputs"] == len(batch) * tokens
    assert tokens <= steps["steps"] <= len(batch) * tokens
    expected = bg.build_in_process("tiny").generate(batch, SamplingParams(max_tokens=tokens, ignore_eos=True))
    for i, want in enumerate(expected):
        got = frames[f"r{i}"]
        assert [t for f in got for t in f[3]] == want
        assert [f[2] for f in got] == list(range(tokens)) and [f[5] for f in got] == [False] * (tokens - 1) + [True]
        assert all(f[6] == len(batch[i]) for f in got)


def test_a_relay_that_cannot_start_is_named_with_its_stderr(tmp_path):
    closed = free_port()  # nothing listens there
    with bf.Relays(tmp_path) as relays:
        with pytest.raises(bf.RelayError) as err:
            relays.start("coord", "--nats", f"nats://127.0.0.1:{closed}")
        proc = relays.procs[0][1]
    message = str(err.value)
    assert "'coord' exited with 1" in message and f"cannot connect to NATS at nats://127.0.0.1:{closed}" in message
    assert proc.poll() is not None


def test_a_relay_that_never_gets_ready_is_stopped(tmp_path, nats_server):
    # A relay still starting when its time is up: the error names it, and it is stopped on the way out.
    with bf.Relays(tmp_path, ready_timeout_s=0.0) as relays:
        with pytest.raises(bf.RelayError, match="'worker' was not ready within 0 s"):
            relays.start("worker", "--nats", nats_server.url)
        proc = relays.procs[0][1]
    assert proc.poll() is not None


def test_floor_only_run_carries_the_floor_rows(tmp_path, nitsum_home, capsys):
    out = tmp_path / "floor.json"
    argv = ["--floor-only", "--requests", "6", "--warmup", "1", "--concurrency", "2", "--out", str(out)]
    argv += ["--floor-tokens", "4", "--floor-streams", "2"]
    assert bg.main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["floor"]["rows"]
    assert set(rows) == {"http", "relay", "engine_relay", "engine_relay_inline"}  # no mesh phase
    for name, row in rows.items():
        assert row["latency_ms"]["p50"] > 0 and row["requests_per_s"] > 0 and row["throughput_ratio"] > 0
        if not name.startswith("engine_relay"):
            assert row["added_latency_p50_ms"] == row["latency_ms"]["p50"]  # a floor without an engine
    engine_p50 = result["engine_latency_ms"]["p50"]
    for name in ("engine_relay", "engine_relay_inline"):
        # 7 requests one at a time (1 warm-up, 6 timed), then 6 more at 2 in flight: every one of them stepped once
        assert rows[name]["engine_steps"]["requests"] == 13 and rows[name]["engine_steps"]["outputs"] == 13
        assert 1.0 <= rows[name]["throughput_batch"] <= 2.0
    assert rows["engine_relay"]["added_latency_p50_ms"] == pytest.approx(
        rows["engine_relay"]["latency_ms"]["p50"] - engine_p50
    )
    assert result["floor"]["message_bytes"] == bf.message_sizes(bg.prompts(1, 16)[0])
    assert "gateway_latency_ms" not in result and result["engine_requests_per_s"] > 0
    tokens = result["floor"]["per_token"]
    assert tokens["tokens"] == 4 and tokens["streams"] == 2 and tokens["engine_step_ms"] > 0
    for paced in (tokens["paced"], tokens["paced_spinning"]):
        assert paced["per_token_ms"]["p50"] > 0 and paced["per_token_over_step"] > 0
    text = capsys.readouterr().out
    assert "relay floor (3 procs, NATS)" in text and "relay floor + engine (inline)" in text
    assert "mesh (nitsum up)" not in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--floor-only", "--url", "http://127.0.0.1:1"], "--floor-only measures no mesh"),
        (["--floor", "--floor-tokens", "1"], "--floor-tokens must be 0 (no per-token floor) or >= 2"),
        (["--floor", "--floor-streams", "0"], "--floor-streams must be >= 1"),
    ],
)
def test_floor_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        bg.main(argv)
    assert message in capsys.readouterr().err


def test_tree_cpu_counts_a_child_process(tmp_path):
    import subprocess
    import sys

    before = bf.tree_cpu_s()
    burn = "import time\nwhile time.process_time() < 0.3: pass\nprint(time.process_time(), flush=True)\ninput()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_cpu = float(child.stdout.readline())
        after = bf.tree_cpu_s()
    finally:
        child.communicate("\n")
    assert before is not None and after is not None
    assert after - before >= child_cpu - 0.05  # the child's CPU is in the tree's (clock ticks: 10 ms)
