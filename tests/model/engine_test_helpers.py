"""Helpers shared by the model/engine tests (module name kept unique across the test tree)."""

import torch


def prompts_of_lengths(lengths, seed=1):
    """Deterministic byte-token prompts (ids < 256) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def record_logits(engine):
    """Wrap the runner so every step's logits are kept (test-only instrumentation)."""
    recorded = []
    execute = engine.runner.execute

    def wrapped(plan):
        logits = execute(plan)
        recorded.append(logits.clone())
        return logits

    engine.runner.execute = wrapped
    return recorded


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the rendezvous of a spawned group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(argvs, timeout_s: float = 180.0) -> list[str]:
    """Run one process per argv (a TP group or a node: gloo on loopback, one torch thread each) until all
    exit; kills whatever is left on a timeout or an error; asserts every exit code is 0, showing every log
    otherwise. Returns the logs in argv order."""
    import os
    import subprocess

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for argv in argvs]
    logs: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            logs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), f"worker exit codes {codes}:\n" + "\n---\n".join(logs)
    return logs
