"""A node world that lost a member is re-formed at the engine level (4 processes, gloo on 127.0.0.1, the tiny
Llama, the worker's own re-formation code): device 0 (the rendezvous host) is SIGKILLed while every worker
has requests in flight; the survivors' first attempt (generation 1) fails, nobody hosting its rendezvous, and
they serve on as before; a fresh process takes device 0's place as a standalone TP=1 engine on the shared
weights; the three survivors (still holding the broken world) and the fresh one form generation 2 at its
rendezvous port, each NodeRuntime adopting the engine it served with; then 4xTP1 -> TP4 runs on the new world.
Every surviving request's greedy tokens equal a run with no fault and no change, each index exactly once.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from engine_test_helpers import prompts_of_lengths

from nitsum.engine import Engine, EngineConfig, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIZE = 4
VICTIM = 0
BLOCK_SIZE = 8
SCRIPT = Path(__file__).with_name("world_generation_run.py")
# (request id, rank it runs on, prompt length, max tokens); the victim's first life's request dies with it.
REQUESTS = [("a", 0, 9, 30), ("b", 1, 23, 40), ("c", 2, 17, 36), ("d", 3, 5, 44), ("e", 1, 12, 28)]
FRESH_REQUESTS = [("z", 13, 34)]  # added to the fresh process's standalone engine before generation 1
HANG_GUARD_S = 150


def free_port() -> int:
    # Generations 1 and 2 meet at port + 1 and port + 2: a port whose successors are free too.
    from nitsum.up import _free_port_span

    return _free_port_span(3)


def spawn(tiny_dir, rank, port, sync, out, shm_dir, requests, fresh=False):
    argv = [
        sys.executable,
        str(SCRIPT),
        "--model-dir",
        str(tiny_dir),
        "--rank",
        str(rank),
        "--size",
        str(SIZE),
        "--port",
        str(port),
        "--sync",
        str(sync),
        "--out",
        str(out),
        "--shm-dir",
        str(shm_dir),
        "--requests",
        json.dumps(requests),
        "--block-size",
        str(BLOCK_SIZE),
    ]
    if fresh:
        argv.append("--fresh")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def generation_run(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    sync = tmp / "sync"
    sync.mkdir()
    prompts = prompts_of_lengths([r[2] for r in REQUESTS] + [r[1] for r in FRESH_REQUESTS], seed=5)
    mine = {
        rank: [[rid, prompt, n] for (rid, r, _, n), prompt in zip(REQUESTS, prompts) if r == rank]
        for rank in range(SIZE)
    }
    fresh_requests = [[rid, prompt, n] for (rid, _, n), prompt in zip(FRESH_REQUESTS, prompts[len(REQUESTS) :])]
    port = free_port()
    procs: dict = {}
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm_root) as shm_dir:
        try:
            for rank in range(SIZE):
                procs[rank] = spawn(tiny_dir, rank, port, sync, tmp / f"out{rank}.json", shm_dir, mine[rank])
            deadline = time.monotonic() + HANG_GUARD_S
            while not all((sync / f"ready-{r}").exists() for r in range(SIZE)):
                dead = {r: p.poll() for r, p in procs.items() if p.poll() is not None}
                assert not dead, (
                    f"a worker exited before the kill: {dead}: "
                    + procs[next(iter(dead))].communicate()[0].decode()[-3000:]
                )
                assert time.monotonic() < deadline, "workers not ready"
                time.sleep(0.05)
            victim = procs.pop(VICTIM)
            victim.send_signal(signal.SIGKILL)
            assert victim.wait(30) == -signal.SIGKILL
            victim.stdout.close()
            (sync / "go").write_text("")
            while not all((sync / f"failed-{r}").exists() for r in procs):
                assert all(p.poll() is None for p in procs.values()), "a survivor exited after its failed attempt"
                assert time.monotonic() < deadline + HANG_GUARD_S, "the failed attempt did not end"
                time.sleep(0.05)
            procs[VICTIM] = spawn(
                tiny_dir, VICTIM, port, sync, tmp / f"out{VICTIM}.json", shm_dir, fresh_requests, fresh=True
            )
            (sync / "go2").write_text("")
            logs = {}
            for rank, proc in sorted(procs.items()):
                out, _ = proc.communicate(timeout=HANG_GUARD_S)
                logs[rank] = out.decode(errors="replace")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    codes = {rank: p.returncode for rank, p in procs.items()}
    assert codes == {r: 0 for r in range(SIZE)}, f"exit codes {codes}:\n" + "\n---\n".join(logs.values())
    reports = {rank: json.loads((tmp / f"out{rank}.json").read_text()) for rank in range(SIZE)}
    return prompts, reports, port


def test_new_generation_adopts_engines_and_merges_with_exact_tokens(tiny_dir, generation_run):
    prompts, reports, port = generation_run
    survivors = [r for r in REQUESTS if r[1] != VICTIM]
    runs = [(rid, n) for rid, _, _, n in survivors] + [(rid, n) for rid, _, n in FRESH_REQUESTS]
    run_prompts = [p for (rid, r, _, _), p in zip(REQUESTS, prompts) if r != VICTIM] + prompts[len(REQUESTS) :]
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), block_size=BLOCK_SIZE, num_kv_blocks=256))
    expected = engine.generate(run_prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in runs])
    records = sorted((tuple(rec) for rep in reports.values() for rec in rep["records"]), key=lambda r: (r[0], r[1]))
    for (rid, n), tokens in zip(runs, expected):
        mine = [r for r in records if r[0] == rid]
        assert [r[1] for r in mine] == list(range(n)), rid  # every index exactly once
        assert [r[2] for r in mine] == tokens, rid
    # The request of the victim's first life went with it; nothing else emitted a token of it.
    assert not any(r[0] == "a" for r in records)


def test_a_failed_attempt_leaves_the_survivors_serving_as_before(generation_run):
    _, reports, port = generation_run
    for rank in (1, 2, 3):
        failed = reports[rank]["failed_attempt"]
        assert failed is not None, f"worker {rank}: generation 1 formed without device 0"
        assert f"127.0.0.1, {port + 1}" in failed["error"], failed  # its rendezvous, which nobody hosted
        # Same engine, same TP=1 group; outside any world now (its old one went to make room), and says why.
        assert failed["same_engine"] is True and failed["group"] == [rank, 1] and failed["in_world"] is False, failed
        assert failed["world_lost"].startswith("re-formation failed"), failed


def test_the_new_world_is_generation_2_at_its_port_and_runs_tp4(generation_run):
    _, reports, port = generation_run
    for _rank, rep in reports.items():
        assert rep["generation"] == 2 and rep["rendezvous_port"] == port + 2, rep
        assert rep["adopted"] is True  # the runtime kept the engine it served with
        assert rep["acks"] == [["prepare", 1, True, ""], ["commit", 1, True, ""]], rep["acks"]
        assert rep["group"] == [0, SIZE]
        assert rep["views_of_store"] is True  # the TP4 runner cuts views of the shared store
    assert reports[0]["fresh"] is True
    # The requests really spanned the re-formation: tokens before it (their boot world or standalone) and after
    # the merge (on the TP4 leader, device 0, the fresh process).
    leader = {r[0] for r in reports[0]["records"]}
    for rank in (1, 2, 3):
        ran = {r[0] for r in reports[rank]["records"]}
        assert ran and ran <= leader, (rank, ran, leader)
    assert reports[0]["final"]["free"] == reports[0]["final"]["total"]
