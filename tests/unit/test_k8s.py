"""deploy/k8s (CPU) and deploy/k8s-gpu (its GPU overlay) are checked offline: every manifest, and what
`kubectl kustomize` renders of each, against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), every
nitsum container runs a real service with known settings, one node world per host, the GPU pod's containers share
one claim of the host's devices, and the NATS config in the ConfigMap is the generator's and forms a real
three-server cluster."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
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
K8S_GPU = ROOT / "deploy/k8s-gpu"
KUBE_VERSION = "1.30.0"
GPU_KUBE_VERSION = "1.34.0"  # resource.k8s.io/v1 (Dynamic Resource Allocation) is GA from 1.34
DOCS = [
    (path.name, doc)
    for path in sorted(K8S.glob("*.yaml"))
    if path.name != "kustomization.yaml"
    for doc in yaml.safe_load_all(path.read_text())
    if doc
]


def pod_specs(docs=None):
    for name, doc in DOCS if docs is None else docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield name, doc, doc["spec"]["template"]["spec"]


def find(docs, kind: str, name: str) -> dict:
    return next(d for _, d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def render(path: Path) -> list[tuple[str, dict]]:
    """What `kubectl apply -k PATH` would apply: kustomize's own rendering (kubectl's built-in kustomize)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [(path.name, d) for d in yaml.safe_load_all(out.stdout) if d]


DEPLOYMENTS = {"cpu": (K8S, KUBE_VERSION), "gpu": (K8S_GPU, GPU_KUBE_VERSION)}


@pytest.fixture(scope="module", params=sorted(DEPLOYMENTS))
def rendered(request):
    path, version = DEPLOYMENTS[request.param]
    return request.param, render(path), version


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
    check_services_and_settings(DOCS)


def check_services_and_settings(docs):
    known = set(all_settings()) | {"POD_NAME", "POD_IP"}
    settings = find(docs, "ConfigMap", "nitsum-settings")["data"]
    assert set(settings) <= known
    roles = set()
    for _name, doc, spec in pod_specs(docs):
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
    for _, _, spec in pod_specs(docs):
        for c in spec["containers"]:
            assert all(e["name"] != "NITSUM_DTYPE" for e in c.get("env", [])), c["name"]


def test_one_node_world_per_host():
    check_node_world(DOCS)


def check_node_world(docs) -> list[dict]:
    """One node world per host; returns its workers' settings (name -> value), one dict per container."""
    node = find(docs, "StatefulSet", "nitsum-node")
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
    ports = {p["port"] for p in find(docs, "Service", "nitsum-node")["spec"]["ports"]}
    assert {int(e["NITSUM_METRICS_PORT"]) for e in envs} <= ports
    return envs


def test_rendered_deployment_is_valid_and_complete(rendered):
    _, docs, version = rendered
    for _, doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    check_services_and_settings(docs)
    check_node_world(docs)


def test_rendered_env_references_are_defined_before_use(rendered):
    """Kubernetes expands $(NAME) only from variables defined earlier in the same container's env list (a patch
    that reorders the list would leave `$(POD_NAME)` as literal text in the worker's id)."""
    _, docs, _ = rendered
    checked = 0
    for _, doc, spec in pod_specs(docs):
        for c in spec["containers"]:
            seen: set[str] = set()
            for env in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                    assert ref in seen, f"{doc['metadata']['name']}/{c['name']}: {env['name']} uses $({ref}) first"
                    checked += 1
                seen.add(env["name"])
    assert checked > 0


def test_gpu_node_shares_one_claim_of_the_hosts_devices():
    docs = render(K8S_GPU)
    envs = check_node_world(docs)
    assert {e["NITSUM_DEVICE"] for e in envs} == {"cuda"} and len(envs) == 8
    spec = find(docs, "StatefulSet", "nitsum-node")["spec"]["template"]["spec"]
    (claim,) = spec["resourceClaims"]
    template = find(docs, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["count"] == len(envs), "the pod claims as many devices as it runs workers"
    for c in spec["containers"]:
        assert c["resources"]["claims"] == [{"name": claim["name"]}], f"{c['name']} does not see the node's devices"
    settings = find(docs, "ConfigMap", "nitsum-settings")["data"]
    assert settings["NITSUM_DTYPE"] == "bfloat16" and int(settings["NITSUM_MAX_TP"]) == len(envs)
    coordinator = find(docs, "Deployment", "coordinator")["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in coordinator["env"]}["NITSUM_DEVICE_KIND"] != "cpu"


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
