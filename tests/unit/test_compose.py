"""docker-compose.yml is checked without a Docker engine: commands, settings and ports must be real."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from nitsum.cli import SERVICES
from nitsum.config import CommonConfig, GatewayConfig, all_settings, load
from nitsum.natsserver import NatsServer, free_port, render_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
NITSUM_SERVICES = {name: svc for name, svc in COMPOSE["services"].items() if svc.get("command", [None])[0] == "serve"}


def test_every_nitsum_service_is_a_real_serve_target():
    assert set(NITSUM_SERVICES) == set(SERVICES), "compose must run each of the five services"
    for name, svc in NITSUM_SERVICES.items():
        assert svc["command"] == ["serve", name]
        assert svc["command"][1] in SERVICES
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["nitsum"]' in dockerfile


def test_every_environment_variable_is_a_known_setting():
    known = set(all_settings())
    for name, svc in NITSUM_SERVICES.items():
        for var in svc["environment"]:
            assert var in known or var.startswith("OTEL_"), f"{name}: unknown setting {var}"


def test_ports_are_the_config_defaults():
    gateway = load(GatewayConfig, [], {})
    common = load(CommonConfig, [], {})
    assert NITSUM_SERVICES["gateway"]["ports"] == [f"{gateway.port}:{gateway.port}"]
    for name, svc in NITSUM_SERVICES.items():
        if name != "gateway":
            assert svc["environment"]["NITSUM_METRICS_PORT"] == str(common.metrics_port)
    targets = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    for name in NITSUM_SERVICES:
        port = gateway.port if name == "gateway" else common.metrics_port
        assert re.search(rf"{name}[\"']?(:|\],\s*type: A, port: ){port}", targets), name


def test_workers_reserve_one_gpu_each_and_backends_exist():
    for name in ("prefill-worker", "decode-worker"):
        deploy = NITSUM_SERVICES[name]["deploy"]
        devices = deploy["resources"]["reservations"]["devices"]
        assert devices[0]["count"] == 1 and "gpu" in devices[0]["capabilities"]
        assert deploy["replicas"] >= 1
    images = {svc.get("image", "") for svc in COMPOSE["services"].values()}
    assert any(i.startswith("nats:") for i in images)
    assert any("jaeger" in i or "otel" in i for i in images)
    assert any("prometheus" in i for i in images)


def test_nats_config_is_generated_and_accepted_by_a_real_server(tmp_path):
    text = (ROOT / "deploy/nats/nats.conf").read_text()
    assert render_config(4222, None, host="0.0.0.0", env_refs=True) in text
    # nats-server must accept it: fill the password references and start one on a free port.
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(text.replace("0.0.0.0:4222", f"127.0.0.1:{port}"))
    env_vars = set(re.findall(r"\$(NITSUM_NATS_PASSWORD_[A-Z_]+)", text))
    assert len(env_vars) == 5
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
