"""deploy/k8s is checked offline: every manifest against the Kubernetes OpenAPI schemas (kubernetes-validate, strict),
every nitsum container runs a real service with known settings, one node world per host, and the NATS config in
the ConfigMap is the generator's and forms a real three-server cluster."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
import yaml

from nitsum.cli import SERVICES
from nitsum.config import all_settings
from nitsum.natscluster import K8S_SERVER_NAME_ENV, ROUTE_PASSWORD_ENV, ROUTES_ENV, k8s_config, start_member_process
from nitsum.natsserver import IDENTITIES, free_port, wait_for_port

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate (the test extra)"
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
KUBE_VERSION = "1.30.0"
DOCS = [
    (path.name, doc)
    for path in sorted(K8S.glob("*.yaml"))
    if path.name != "kustomization.yaml"
    for doc in yaml.safe_load_all(path.read_text())
    if doc
]


def pod_specs():
    for name, doc in DOCS:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield name, doc, doc["spec"]["template"]["spec"]


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_manifest_is_valid_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    _, doc, _ = next(pod_specs())
    broken = copy.deepcopy(doc)
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_kustomization_lists_every_manifest_but_the_secret_example():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {p.name for p in K8S.glob("*.yaml")} - {
        "kustomization.yaml",
        "secret.example.yaml",
    }


def test_nitsum_containers_run_real_services_with_known_settings():
    known = set(all_settings()) | {"POD_NAME", "POD_IP"}
    settings = next(d for _, d in DOCS if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nitsum-settings")[
        "data"
    ]
    assert set(settings) <= known
    roles = set()
    for _name, doc, spec in pod_specs():
        for c in spec["containers"]:
            if c.get("args", [""])[0] != "serve":
                continue
            roles.add(c["args"][1])
            assert c["args"][1] in SERVICES
            for env in c.get("env", []):
                assert env["name"] in known, f"{doc['metadata']['name']}/{c['name']}: unknown setting {env['name']}"
            assert {"configMapRef": {"name": "nitsum-settings"}} in c["envFrom"]
    assert roles == set(SERVICES)
    # The coordinator's cost model and the workers read NITSUM_DTYPE from the one ConfigMap, nowhere else.
    for _, _, spec in pod_specs():
        for c in spec["containers"]:
            assert all(e["name"] != "NITSUM_DTYPE" for e in c.get("env", [])), c["name"]


def test_one_node_world_per_host():
    node = next(d for _, d in DOCS if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nitsum-node")
    spec = node["spec"]["template"]["spec"]
    term = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == node["spec"]["selector"]["matchLabels"]
    workers = spec["containers"]
    envs = [{e["name"]: e.get("value") for e in c["env"]} for c in workers]
    assert {e["NITSUM_NODE_SIZE"] for e in envs} == {str(len(workers))}
    assert sorted(int(e["NITSUM_DEVICE_INDEX"]) for e in envs) == list(range(len(workers)))
    assert {e["NITSUM_HOST_ID"] for e in envs} == {"$(POD_NAME)"} and {e["NITSUM_NODE_ID"] for e in envs} == {
        "$(POD_NAME)"
    }
    assert len({e["NITSUM_WORKER_ID"] for e in envs}) == len(workers)
    assert len({e["NITSUM_METRICS_PORT"] for e in envs}) == len(workers), "a pod's containers share its ports"
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    for c in workers:
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_nats_configmap_is_generated_and_forms_a_cluster(tmp_path):
    config_map = next(d for _, d in DOCS if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nitsum-nats")
    text = config_map["data"]["nats.conf"]
    assert text == k8s_config(), "deploy/k8s/nats.yaml's config drifted from nitsum.natscluster.k8s_config()"
    nats = next(d for _, d in DOCS if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats")
    env_names = {e["name"] for e in nats["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {K8S_SERVER_NAME_ENV, ROUTE_PASSWORD_ENV, ROUTES_ENV} | {
        f"NITSUM_NATS_PASSWORD_{i.upper().replace('-', '_')}" for i in IDENTITIES
    } <= env_names
    # Three real servers run this very config (loopback ports), each routed to all three (itself included).
    ports = [(free_port(), free_port()) for _ in range(3)]
    routes = json.dumps([f"nats-route://route:rpw@127.0.0.1:{cluster}" for _, cluster in ports])
    env = {**os.environ, ROUTE_PASSWORD_ENV: "rpw", ROUTES_ENV: routes}
    env.update({f"NITSUM_NATS_PASSWORD_{i.upper().replace('-', '_')}": f"pw-{i}" for i in IDENTITIES})
    procs = []
    try:
        for k, (client, cluster) in enumerate(ports):
            conf = tmp_path / f"nats-{k}.conf"
            conf.write_text(
                text.replace("0.0.0.0:4222", f"127.0.0.1:{client}").replace("0.0.0.0:6222", f"127.0.0.1:{cluster}")
            )
            procs.append(
                start_member_process(conf, tmp_path / f"nats-{k}.log", env={**env, K8S_SERVER_NAME_ENV: f"nats-{k}"})
            )
        assert all(wait_for_port("127.0.0.1", client, 15) for client, _ in ports)
        deadline = time.monotonic() + 15
        logs = [tmp_path / f"nats-{k}.log" for k in range(3)]
        while time.monotonic() < deadline and not all("Route connection created" in p.read_text() for p in logs):
            time.sleep(0.1)
        for p in logs:
            log = p.read_text()
            assert "Route connection created" in log and "Authorization Violation" not in log, log[-2000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
