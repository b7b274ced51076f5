"""docker-compose.yml is checked without a Docker engine: commands, settings, ports, health and the node world must be
real. (deploy/compose-smoke.sh runs it for real: builds, starts the CPU profile, serves one chat completion.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from nitsum.cli import SERVICES
from nitsum.config import CommonConfig, CoordinatorConfig, GatewayConfig, WorkerConfig, all_settings, load
from nitsum.natsserver import NatsServer, free_port, render_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
NITSUM_SERVICES = {name: svc for name, svc in COMPOSE["services"].items() if svc.get("command", [None])[0] == "serve"}
WORKERS = {name: svc for name, svc in NITSUM_SERVICES.items() if svc["command"][1].endswith("-worker")}


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR:-default} / ${VAR:?err} / ${VAR} with an empty environment (or `env`)."""
    env = env or {}

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in env and (env[name] or op != ":-"):
            return env[name]
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(:-|:\?)?([^}]*)\}", one, str(value))


def profile_services(profile: str) -> dict[str, dict]:
    return {n: s for n, s in COMPOSE["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def test_every_nitsum_service_is_a_real_serve_target():
    roles = {svc["command"][1] for svc in NITSUM_SERVICES.values()}
    assert roles == set(SERVICES), "compose must run each of the five services"
    for name, svc in NITSUM_SERVICES.items():
        assert svc["command"][0] == "serve" and svc["command"][1] in SERVICES, name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["nitsum"]' in dockerfile
    # Both profiles run every role; only the CPU profile runs without a GPU.
    for profile in ("gpu", "cpu"):
        assert {
            s["command"][1] for s in profile_services(profile).values() if s.get("command", [""])[0] == "serve"
        } >= {"coordinator", "flow-scheduler", "gateway", "decode-worker"}
    assert all("deploy" not in s for n, s in profile_services("cpu").items()), "the CPU profile reserves no device"


def test_every_environment_variable_is_a_known_setting():
    known = set(all_settings())
    for name, svc in NITSUM_SERVICES.items():
        for var in svc["environment"]:
            assert var in known or var.startswith("OTEL_"), f"{name}: unknown setting {var}"


def test_host_networking_only_and_distinct_ports():
    for name, svc in COMPOSE["services"].items():
        assert svc.get("network_mode") == "host", f"{name}: host networking only (no container network)"
        assert "ports" not in svc and "networks" not in svc, name
    assert COMPOSE["x-nitsum"]["build"]["network"] == "host"
    gateway = load(GatewayConfig, [], {})
    for profile in ("gpu", "cpu"):
        ports = [
            int(interpolate(s["environment"]["NITSUM_METRICS_PORT"]))
            for s in profile_services(profile).values()
            if "NITSUM_METRICS_PORT" in s.get("environment", {})
        ]
        ports.append(int(interpolate(NITSUM_SERVICES["gateway"]["environment"]["NITSUM_GATEWAY_PORT"])))
        assert len(ports) == len(set(ports)), f"{profile}: services share a host port {sorted(ports)}"
    assert int(interpolate(NITSUM_SERVICES["gateway"]["environment"]["NITSUM_GATEWAY_PORT"])) == gateway.port
    targets = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    for name, svc in profile_services("gpu").items():
        if name in NITSUM_SERVICES:
            port = interpolate(
                svc["environment"].get("NITSUM_METRICS_PORT") or svc["environment"]["NITSUM_GATEWAY_PORT"]
            )
            assert f'"127.0.0.1:{port}"' in targets, name


def test_one_node_world_per_host_sharing_ipc_and_shm():
    for profile, size in (("gpu", 4), ("cpu", 2)):
        workers = {n: s for n, s in profile_services(profile).items() if n in WORKERS}
        assert len(workers) == size, profile
        envs = [{k: interpolate(v) for k, v in s["environment"].items()} for s in workers.values()]
        for svc in workers.values():
            assert svc["ipc"] == "host", "the node world's workers share IPC and /dev/shm"
        configs = [load(WorkerConfig, [], env) for env in envs]
        assert {c.node_size for c in configs} == {size}
        assert sorted(c.device_index for c in configs) == list(range(size))
        assert len({c.worker_id for c in configs}) == size
        assert len({c.host_id for c in configs}) == 1 and configs[0].host_id, "one host identity for the node's workers"
        assert len({c.node_id for c in configs}) == 1
        assert {c.device for c in configs} == {"cuda" if profile == "gpu" else "cpu"}


def test_coordinator_dtype_comes_from_the_workers_setting():
    coordinator = NITSUM_SERVICES["coordinator"]["environment"]
    for env in ({}, {"NITSUM_DTYPE": "float16"}, {"NITSUM_DTYPE": "float32"}):
        coord = load(CoordinatorConfig, [], {k: interpolate(v, env) for k, v in coordinator.items()})
        for name, svc in WORKERS.items():
            worker = load(WorkerConfig, [], {k: interpolate(v, env) for k, v in svc["environment"].items()})
            assert worker.dtype == coord.dtype, (name, env)
    assert load(CoordinatorConfig, [], {k: interpolate(v) for k, v in coordinator.items()}).dtype == "bfloat16"
    assert coordinator["NITSUM_DTYPE"] == COMPOSE["x-env"]["NITSUM_DTYPE"]


def test_healthchecks_and_healthy_dependencies():
    for name, svc in COMPOSE["services"].items():
        if "image" in svc and not svc["image"].startswith("nitsum"):
            continue  # observability images
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, (name, dep)
            assert dep in COMPOSE["services"] and not COMPOSE["services"][dep].get("profiles"), (name, dep)
    assert "nats" in NITSUM_SERVICES["coordinator"]["depends_on"]
    for name in WORKERS:
        assert {"nats", "coordinator"} <= set(COMPOSE["services"][name]["depends_on"]), name
    assert "/ready" in " ".join(NITSUM_SERVICES["gateway"]["healthcheck"]["test"])


def test_gpu_workers_reserve_gpus_as_compose_documents():
    gpu = {n: s for n, s in WORKERS.items() if "gpu" in s.get("profiles", [])}
    assert gpu
    for svc in gpu.values():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert devices[0]["count"] == "all" or int(devices[0]["count"]) >= 1
    nats = COMPOSE["services"]["nats"]
    assert nats["image"].startswith("nitsum") and nats["entrypoint"] == ["nats-server"], (
        "NATS runs from the nitsum image"
    )
    images = {svc.get("image", "") for svc in COMPOSE["services"].values()}
    assert any("jaeger" in i for i in images) and any("prometheus" in i for i in images)


def test_nats_config_is_generated_and_accepted_by_a_real_server(tmp_path):
    text = (ROOT / "deploy/nats/nats.conf").read_text()
    assert render_config(4222, None, host="0.0.0.0", env_refs=True) in text
    # nats-server must accept it: fill the password references and start one on a free port.
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(text.replace("0.0.0.0:4222", f"127.0.0.1:{port}"))
    env_vars = set(re.findall(r"\$(NITSUM_NATS_PASSWORD_[A-Z_]+)", text))
    assert len(env_vars) == 5
    assert env_vars <= set(COMPOSE["services"]["nats"]["environment"])
    old = {k: os.environ.get(k) for k in env_vars}
    os.environ.update({k: "pw-" + k.lower() for k in env_vars})
    try:
        server = NatsServer(port=port, config_path=conf).start(log_path=tmp_path / "log")
        server.stop()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_common_defaults_are_unchanged():
    assert load(CommonConfig, [], {}).nats_url == interpolate(COMPOSE["x-env"]["NITSUM_NATS_URL"])
