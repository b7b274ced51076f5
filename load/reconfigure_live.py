"""`nitsum bench reconfigure`'s live run: a mesh of its own, greedy streams driven through the chain of
topology changes, and the restart baseline on a fresh mesh."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from nitsum.natsserver import free_port
from nitsum_load.live_mesh import (
    LiveMesh,
    admin_call,
    histogram_sums,
    make_model,
    remove_weight_store,
    start_live_mesh,
    weight_store_bytes,
)
from nitsum_load.reconfigure_core import BOOT_SHAPES, CHAINS, SHAPE_NAMES, precopy_stats


async def stream_through_chain(mesh: LiveMesh, args: argparse.Namespace) -> dict:
    """Stream the requests; once each has `--steady-tokens` tokens, apply each change of the chain, letting
    every stream move on by `--steady-tokens` tokens after each answer."""
    import aiohttp

    from nitsum_load.cli import discover_model
    from nitsum_load.client import ClientConfig, RequestSpec, RequestTracker, send

    model = await discover_model(mesh.url, None)
    cfg = ClientConfig(
        base_url=mesh.url,
        model=model,
        endpoint="completions",
        prompt_format="token-ids",
        return_token_ids=True,
        request_timeout_s=600.0,
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    origin_unix = time.time()  # wall clock of clock() == 0, to line the timeline up with the services' logs

    def clock() -> float:
        return (loop.time() - t0) * 1000.0

    chain = list(CHAINS[args.devices]) * args.rounds
    trackers = [
        RequestTracker(RequestSpec(f"r{i}", 0.0, 16 + 37 * i % 200, args.max_tokens, "interactive", 1e9, 1e9, 1.0))
        for i in range(args.requests)
    ]
    windows: list[tuple[float, float]] = []
    answers: list[dict] = []
    import nats

    nc = await nats.connect(servers=[mesh.nats_url], connect_timeout=5)
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(send(session, cfg, t, clock, seed_index=i)) for i, t in enumerate(trackers)]

        async def advance(marks: list[int]) -> None:
            # A stream that stalls (see `stalled` in the report) is not waited for beyond the gateway's own
            # stream timeout: the chain goes on, and the stall shows as that transition's gap.
            deadline = loop.time() + args.advance_timeout_s
            while not all(task.done() for task in tasks) and loop.time() < deadline:
                if all(
                    len(t.token_times_ms) >= m + args.steady_tokens or task.done()
                    for t, m, task in zip(trackers, marks, tasks)
                ):
                    return
                await asyncio.sleep(0.005)

        await advance([0] * len(trackers))
        for _kind, _src, dst in chain:
            start = clock()
            answer = await admin_call(
                mesh.nats_url,
                "set-topology",
                {"topology": dst, "node_id": "node0", "id": f"bench-{len(answers)}"},
                nc=nc,
            )
            end = clock()
            if not answer.get("ok"):
                raise RuntimeError(f"set-topology {dst} failed: {answer}")
            windows.append((start, end))
            answers.append(answer)
            await advance([len(t.token_times_ms) for t in trackers])
        # The streams are long on purpose (a fast model must not finish them before the chain ends); what
        # is left of them after the last change is not part of the measurement.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await nc.close()
    return {
        "chain": chain,
        "windows": windows,
        "answers": answers,
        "origin_unix": origin_unix,
        "token_times_ms": [list(t.token_times_ms) for t in trackers],
        "streams": [{"tokens": len(t.token_times_ms), "error": t.error, "detail": t.error_detail} for t in trackers],
    }


def restart_baseline(
    work: Path, mesh: LiveMesh, model_dir: Path, nats_url: str, env_extra: dict, devices: int = 4
) -> dict:
    stop_ms = mesh.stop()
    removed = remove_weight_store(model_dir)
    fresh = start_live_mesh(
        work / "restart", model_dir=model_dir, nats_url=nats_url, env_extra=env_extra, devices=devices
    )
    boot = BOOT_SHAPES[devices]
    # Each target shape of the chain from the boot shape, back to the boot shape in between.
    targets: list[str] = []
    for _kind, _src, dst in CHAINS[devices]:
        if dst != boot and dst not in targets:
            targets += [dst, boot]
    try:
        reloaded_bytes = weight_store_bytes(model_dir)
        to_target: dict[str, float] = {}
        for target in targets:
            t0 = time.monotonic()
            try:
                answer = asyncio.run(
                    admin_call(
                        nats_url,
                        "set-topology",
                        {"topology": target, "node_id": "node0", "id": f"restart-{target}"},
                        timeout_s=30.0,
                    )
                )
            except Exception as exc:  # nats-py timeout types vary; an unanswered change leaves that target out  # noqa: BLE001
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            if not answer.get("ok"):
                print(f"warning: set-topology {target} on the restarted mesh: {answer}", file=sys.stderr)
                continue
            if target != boot:
                to_target[target] = (time.monotonic() - t0) * 1000.0
    finally:
        fresh.stop()
        remove_weight_store(model_dir)
    return {
        "stop_ms": stop_ms,
        "ready_ms": fresh.ready_ms,
        "boot_ms": fresh.workers_ready_ms,
        "to_target_ms": {SHAPE_NAMES[k]: v for k, v in to_target.items()},
        "_to_target": to_target,
        "store_removed": removed,
        "store_reloaded_bytes": reloaded_bytes,
    }


def measure_live(
    p: argparse.ArgumentParser, args: argparse.Namespace, out: Path, env_extra: dict[str, str]
) -> tuple[dict, dict, dict | None, int] | None:
    """The whole live measurement on a fresh model directory and nats-server of its own: the streamed chain
    (with the workers' pre-copy figures), the coordinator's histogram, then the restart baseline. Returns
    (run, restart, histogram, weight store bytes), or None once a RuntimeError is reported (logs in out/logs)."""
    from nitsum.natsserver import NatsServer

    with tempfile.TemporaryDirectory(prefix="nitsum-bench-reconfigure-") as tmp:
        work = Path(tmp)
        try:
            model_dir = make_model(args.model, work)
        except FileNotFoundError as exc:
            p.error(str(exc))
        nats = NatsServer(port=free_port(), config_path=None).start(log_path=out / "logs" / "nats-server.log")
        mesh: LiveMesh | None = None
        try:
            print(f"starting nitsum up --devices {args.devices} --model {model_dir} ...", flush=True)
            mesh = start_live_mesh(
                out / "logs" / "live", model_dir=model_dir, nats_url=nats.url, env_extra=env_extra, devices=args.devices
            )
            store_bytes = weight_store_bytes(model_dir)
            print(
                f"ready in {mesh.workers_ready_ms / 1000:.1f} s; streaming {args.requests} x {args.max_tokens} "
                f"tokens through {len(CHAINS[args.devices]) * args.rounds} changes ...",
                flush=True,
            )
            run = asyncio.run(stream_through_chain(mesh, args))
            worker_logs = sorted(mesh.run_dir.glob("worker-*.log"))
            run["precopy"] = precopy_stats(
                [line for path in worker_logs for line in path.read_text(errors="replace").splitlines()]
            )
            histogram = None
            metrics_url = mesh.coordinator_metrics_url()
            if metrics_url:
                try:
                    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
                        histogram = histogram_sums(resp.read().decode(), "nitsum_reconfiguration_duration_ms")
                except (urllib.error.URLError, OSError):
                    histogram = None
            print("restart baseline: stop, delete the weight store, fresh nitsum up ...", flush=True)
            restart = restart_baseline(out / "logs", mesh, model_dir, nats.url, env_extra, args.devices)
        except RuntimeError as exc:
            sys.stderr.write(f"nitsum bench reconfigure: {exc}\n(logs in {out / 'logs'})\n")
            return None
        finally:
            if mesh is not None:
                mesh.stop()
            nats.stop()
            remove_weight_store(model_dir)
    return run, restart, histogram, store_bytes
