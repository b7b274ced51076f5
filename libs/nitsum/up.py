"""`nitsum up`: the whole mesh on this machine.

Starts nats-server (unless --nats URL) with one identity per service, writes the tiny model on first run,
starts the coordinator, the flow-scheduler, N workers and the gateway as child processes, waits for
`/ready` and prints the URL. A child that dies is named with its exit status and the tail of its log,
then restarted (at most 3 times a minute; past that the whole stack stops with an error). Ctrl-C stops
every child; children also die with this process (PR_SET_PDEATHSIG), so nothing is orphaned.
The children themselves (start, readiness, restarts, stop) are supervise.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from nitsum.config import default_home
from nitsum.cpus import Placement, allowed_cpus, parse_cpu_list, plan_placement
from nitsum.natsserver import (
    HANDED_OUT,
    NatsExited,
    NatsServer,
    free_port,
    new_passwords,
    render_config,
    worker_identity,
    write_secure,
)
from nitsum.supervise import (
    MAX_PORT_RETRIES,
    MAX_RESTARTS_PER_MINUTE,
    Child,
    _die_with_parent,
    _stop_all,
    _supervise,
    _wait_ready,
    metrics_port_taken,
    write_pids,
)

NATS_START_TRIES = 5  # picks of the NATS port when another process takes the picked one first

__all__ = [
    "MAX_PORT_RETRIES",
    "MAX_RESTARTS_PER_MINUTE",
    "NATS_START_TRIES",
    "Child",
    "_die_with_parent",
    "_free_port_span",
    "_port_free",
    "_remove_weight_store",
    "_stop_all",
    "_supervise",
    "_wait_ready",
    "main",
    "metrics_port_taken",
    "parse_args",
    "start_nats",
    "write_pids",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nitsum up", description="Run the nitsum mesh on this machine.")
    p.add_argument(
        "--model",
        default=os.environ.get("NITSUM_MODEL", "tiny"),
        help="model directory (Hugging Face format) or 'tiny' (default)",
    )
    p.add_argument("--devices", type=int, default=4, help="number of workers (one per device; default 4)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--max-tp", type=int, default=None, help="largest TP level (default: --devices, capped at 4)")
    p.add_argument("--policy", default="adaptive", help="adaptive | static-tp:K | disagg | static-hybrid")
    p.add_argument("--host", default="127.0.0.1", help="gateway listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--nats", default="", help="use this NATS server instead of starting one")
    p.add_argument("--run-dir", default="", help="logs and spans go here (default: NITSUM_HOME/run/<time>)")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for /ready")
    p.add_argument("--prefill-workers", type=int, default=0, help="how many of the workers start as prefill-workers")
    p.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes sharing the HTTP port (SO_REUSEPORT; each serves the streams it submitted; default 1)",
    )
    p.add_argument("--no-node-world", action="store_true", help="standalone TP=1 workers: no run-time TP changes")
    p.add_argument(
        "--cpu-affinity",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): with --device cpu and at least one CPU more than the workers need (NITSUM_TORCH_THREADS "
        "each), each worker on CPUs of its own and the other processes on the rest (NITSUM_CPUS per child); "
        "off: wherever the kernel puts them",
    )
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error("--devices must be >= 1")
    if args.gateways < 1:
        p.error("--gateways must be >= 1")
    if args.max_tp is None:
        args.max_tp = min(args.devices, 4)
    if args.max_tp < 1 or args.max_tp & (args.max_tp - 1) or args.max_tp > args.devices:
        p.error("--max-tp must be a power of two no larger than --devices")
    if not 0 <= args.prefill_workers <= args.devices:
        p.error("--prefill-workers must be between 0 and --devices")
    problem = _policy_problem(args.policy, args.devices, args.max_tp)
    if problem:
        p.error(f"--policy: {problem}")
    return args


def cpu_placement(args: argparse.Namespace, environ: dict[str, str]) -> tuple[Placement | None, str]:
    """Where `--cpu-affinity` puts the children, and the line `nitsum up` prints about it."""
    if args.cpu_affinity == "off":
        return None, "CPU affinity off (--cpu-affinity off)"
    if environ.get("NITSUM_CPUS"):
        return None, f"every child on NITSUM_CPUS={environ['NITSUM_CPUS']} (set in the environment)"
    if args.device != "cpu":
        return None, "CPU affinity: not pinned (auto pins the processes of --device cpu only)"
    allowed = allowed_cpus()
    threads = environ.get("NITSUM_TORCH_THREADS", "1")
    per_worker = int(threads) if threads.isdigit() and int(threads) > 0 else 1  # a bad value stops the workers
    placement = plan_placement(allowed, args.devices, per_worker)
    if placement is None:
        return None, (
            f"CPU affinity: not pinned ({len(allowed)} CPUs for {args.devices} workers of {per_worker} torch "
            "thread(s): each worker needs that many CPUs of its own, and one is left for the other processes)"
        )
    each = "one each" if per_worker == 1 else f"{per_worker} each (NITSUM_TORCH_THREADS)"
    return placement, (
        f"CPU affinity: workers on CPU {','.join(placement.workers)}, {each}; gateway, "
        f"coordinator, flow-scheduler and nats-server on CPU {placement.others}"
    )


def _policy_problem(spec: str, devices: int, max_tp: int) -> str:
    """Why `spec` cannot run on one node of `devices` workers with this --max-tp ('' if it can)."""
    from nitsum.policy.registry import layout_problem, make_policy
    from nitsum.policy.snapshot import NodeView

    return layout_problem(make_policy(spec), NodeView("node0", devices, 1, max_tp, ()))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir) if args.run_dir else default_home() / "run" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"nitsum up: run directory {run_dir}", flush=True)

    from nitsum.modelpath import resolve_model_dir

    t0 = time.monotonic()
    try:
        model_dir = resolve_model_dir(args.model)
    except (FileNotFoundError, ValueError) as exc:
        print(f"nitsum up: {exc}", file=sys.stderr)
        return 2
    print(f"nitsum up: model {model_dir}", flush=True)

    placement, where = cpu_placement(args, dict(os.environ))
    print(f"nitsum up: {where}", flush=True)
    HANDED_OUT.add(args.port)  # the gateway binds it last: no port picked below may land on it

    nats: NatsServer | None = None
    passwords: dict[str, str] = {}
    if args.nats:
        nats_url = args.nats
    else:
        port = 4222 if _port_free(4222) else free_port()
        passwords = new_passwords(_worker_ids(args.devices))
        config_path = run_dir / "nats.conf"  # start_nats writes it
        nats = start_nats(
            run_dir, port, passwords, _worker_ids(args.devices), parse_cpu_list(placement.others) if placement else ()
        )
        nats_url = nats.url
        print(
            f"nitsum up: nats-server on {nats_url} (one identity per service and per worker, see {config_path})",
            flush=True,
        )
    write_secure(
        default_home() / "run" / "current.json",
        json.dumps(
            {
                "nats_url": nats_url,
                "admin_user": "admin" if passwords else "",
                "admin_password": passwords.get("admin", ""),
                "run_dir": str(run_dir),
                "gateway": f"http://{args.host}:{args.port}",
            }
        ),
    )

    base_env = dict(os.environ)
    base_env.update(
        {
            "NITSUM_NATS_URL": nats_url,
            "NITSUM_RUN_DIR": str(run_dir),
            "NITSUM_MODEL": str(model_dir),
            "NITSUM_MAX_TP": str(args.max_tp),
            "NITSUM_POLICY": args.policy,
            "NITSUM_DEVICE": args.device,
            "PYTHONUNBUFFERED": "1",
        }
    )
    if placement is not None:
        base_env["NITSUM_CPUS"] = placement.others  # every child but the workers, which get their own below

    def env_for(identity: str, **extra: str) -> dict[str, str]:
        env = dict(base_env)
        if passwords:
            env["NITSUM_NATS_USER"] = identity
            env["NITSUM_NATS_PASSWORD"] = passwords[identity]
        env["NITSUM_METRICS_PORT"] = str(free_port())
        env.update(extra)
        return env

    children = [
        Child("coordinator", "coordinator", env_for("coordinator"), run_dir / "coordinator.log"),
        Child("flow-scheduler", "flow-scheduler", env_for("flow-scheduler"), run_dir / "flow-scheduler.log"),
    ]
    # Workers of the node join one process world (pre-built groups, shared weights) so that the
    # coordinator can merge and split them at run time.
    # Re-formed worlds (generation g) meet at the master port + g mod 16: the whole span starts out free.
    world = (
        {}
        if args.no_node_world or args.max_tp == 1
        else {"NITSUM_NODE_SIZE": str(args.devices), "NITSUM_NODE_MASTER_PORT": str(_free_port_span())}
    )
    for i in range(args.devices):
        service = "prefill-worker" if i < args.prefill_workers else "decode-worker"
        worker_id = _worker_ids(args.devices)[i]
        own = {"NITSUM_CPUS": placement.workers[i]} if placement is not None else {}
        children.append(
            Child(
                f"worker-{i}",
                service,
                env_for(
                    worker_identity(worker_id), NITSUM_DEVICE_INDEX=str(i), NITSUM_WORKER_ID=worker_id, **world, **own
                ),
                run_dir / f"worker-{i}.log",
            )
        )
    children.extend(_gateways(args, env_for, run_dir))

    stopping = {"flag": False}

    def on_signal(_sig, _frame) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    for child in children:
        child.start()
    write_pids(children, run_dir)
    api_keys = [k for k in os.environ.get("NITSUM_API_KEYS", "").split(",") if k.strip()]
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{args.port}"
    code = 0
    try:
        code = _wait_ready(children, url, api_keys[0] if api_keys else "", args.ready_timeout, stopping, run_dir)
        if code == 0:
            print(
                f"nitsum up: ready in {time.monotonic() - t0:.1f} s — OpenAI-compatible API at {url}/v1 (Ctrl-C stops everything)",
                flush=True,
            )
            code = _supervise(children, stopping, run_dir)
    finally:
        _stop_all(children)
        if nats is not None:
            nats.stop()
        if world:
            from nitsum.config import default_dtype

            dtype = os.environ.get("NITSUM_DTYPE") or "auto"
            _remove_weight_store(model_dir, default_dtype(args.device) if dtype == "auto" else dtype)
        print("nitsum up: stopped", flush=True)
    return code


def _gateways(args: argparse.Namespace, env_for, run_dir: Path) -> list[Child]:
    """`--gateways N` gateway processes on one port (with N > 1 they share it: SO_REUSEPORT), all under the
    gateway's NATS identity; the first keeps the name `gateway`, the others are `gateway-1` ... `gateway-<N-1>`."""
    shared = {"NITSUM_GATEWAY_REUSE_PORT": "1"} if args.gateways > 1 else {}
    children = []
    for i in range(args.gateways):
        name = "gateway" if i == 0 else f"gateway-{i}"
        env = env_for("gateway", NITSUM_GATEWAY_PORT=str(args.port), NITSUM_GATEWAY_HOST=args.host, **shared)
        children.append(Child(name, "gateway", env, run_dir / f"{name}.log"))
    return children


def _worker_ids(devices: int) -> tuple[str, ...]:
    """The workers' ids (each one its own NATS identity, `worker-<id>`)."""
    return tuple(f"node0-{i}" for i in range(devices))


def _remove_weight_store(model_dir: Path, dtype: str) -> None:
    """The workers' shared-memory weight store lives in /dev/shm; it goes with the mesh that made it."""
    from nitsum.parallel.weights import DEFAULT_SHM_DIR, store_key

    base = Path(DEFAULT_SHM_DIR) / store_key(model_dir, dtype)
    for suffix in (".json", ".bin", ".lock"):
        base.with_suffix(suffix).unlink(missing_ok=True)


def _free_port_span(count: int = 0) -> int:
    """A free port whose next `count - 1` ports are free too (default: the node world's generation span), below
    the kernel's ephemeral range when there is room (see `free_port`: such ports never become an outgoing
    connection's local port between the probe and the rendezvous' bind)."""
    import random

    from nitsum.config import NODE_PORT_SPAN
    from nitsum.natsserver import LOWEST_PICKED_PORT, ephemeral_low

    count = count or NODE_PORT_SPAN

    def take(base: int) -> int:  # later picks of this process (metrics ports) keep out of the span
        HANDED_OUT.update(range(base, base + count))
        return base

    def unclaimed(base: int) -> bool:
        return not HANDED_OUT.intersection(range(base, base + count))

    low = ephemeral_low()
    if low - count > LOWEST_PICKED_PORT:
        rng = random.Random()
        for _ in range(200):
            base = rng.randrange(LOWEST_PICKED_PORT, low - count)
            if unclaimed(base) and all(_port_free(base + i) for i in range(count)):
                return take(base)
    for _ in range(200):
        base = free_port()
        rest = range(base + 1, base + count)  # free_port handed out `base` itself
        if base + count - 1 <= 65535 and not HANDED_OUT.intersection(rest) and all(_port_free(p) for p in rest):
            return take(base)
    raise RuntimeError(f"no {count} consecutive free ports found for the node world's rendezvous")


def start_nats(
    run_dir: Path, port: int, passwords: dict[str, str], worker_ids: tuple[str, ...], cpus: tuple[int, ...] = ()
) -> NatsServer:
    """The mesh's own nats-server on `port`, with its config in run_dir/nats.conf. A port taken between the probe
    and the server's bind (another `nitsum up` starting beside this one) is picked again, up to NATS_START_TRIES
    times; any other failure to start is raised."""
    config_path = run_dir / "nats.conf"
    attempt = 1
    while True:
        write_secure(config_path, render_config(port, passwords, worker_ids=worker_ids))
        try:
            return NatsServer(port=port, config_path=config_path, cpus=cpus).start(log_path=run_dir / "nats-server.log")
        except NatsExited:
            if _port_free(port) or attempt >= NATS_START_TRIES:
                raise
            print(f"nitsum up: port {port} was taken as nats-server started; trying another", flush=True)
            port = free_port()
            attempt += 1


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
