"""Helpers shared by the model/engine tests (module name kept unique across the test tree)."""

import torch

from nitsum.natsserver import free_port


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


def run_workers(argvs, timeout_s: float = 180.0) -> list[str]:
    """`nitsum_load.mesh.run_all`, asserting every exit code is 0 (showing every log otherwise); the logs."""
    from nitsum_load.mesh import run_all

    codes, logs = run_all(argvs, timeout_s)
    assert codes == [0] * len(codes), f"worker exit codes {codes}:\n" + "\n---\n".join(logs)
    return logs


def run_node_script(
    model_dir, script: dict, tmp_path, world: int, extra_args=None, timeout_s: float = 150.0, **options
) -> list[dict]:
    """Run a scripted node (`nitsum.bench.node_run`, one process per worker) and return every worker's report.
    `options` become flags (block_size=8 -> --block-size 8; a shm_dir option defaults to tmp_path/shm);
    `extra_args` maps a rank to more argv of its own, or is a function of the rank."""
    import json
    import sys

    script_path = tmp_path / "script.json"
    script_path.write_text(json.dumps(script))
    flags = {"shm_dir": tmp_path / "shm", **options}
    common = [arg for name, value in flags.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    own = extra_args if callable(extra_args) else (lambda rank: (extra_args or {}).get(rank, []))
    port = free_port()
    run_workers(
        [
            [
                sys.executable,
                "-m",
                "nitsum.bench.node_run",
                "--model-dir",
                str(model_dir),
                "--rank",
                str(rank),
                "--world-size",
                str(world),
                "--master-port",
                str(port),
                "--script",
                str(script_path),
                "--out",
                str(tmp_path / f"out{rank}.json"),
                *common,
                *own(rank),
            ]
            for rank in range(world)
        ],
        timeout_s,
    )
    return [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(world)]
