"""Issue 23: `nitsum up --gateways 2` -- two gateway processes share the HTTP port, both serve requests, and a
stream through either completes with its tokens in order and its usage (frames come batched per step to the
gateway that submitted the request)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.e2e.conftest import start_mesh, stop_mesh

MAX_TRIES = 40  # fresh connections (new source ports) until both gateways answered: 2**-39 to miss one


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("gateways"), devices=1, extra_args=("--gateways", "2", "--no-node-world"))
    yield mesh
    stop_mesh(mesh.process)


def _post(url: str, body: dict):
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=60)


def test_two_gateways_both_serve_and_their_streams_complete(two_gateways):
    pids = json.loads((two_gateways.run_dir / "processes.json").read_text())
    assert {"gateway", "gateway-1"} <= set(pids)
    served: dict[str, list[str]] = {}
    for i in range(MAX_TRIES):
        body = {"model": "tiny", "prompt": [100 + i, 101, 102], "max_tokens": 5, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
        with _post(two_gateways.url, body) as resp:
            assert resp.status == 200
            gateway = resp.headers["x-nitsum-gateway"]
            events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        tokens = [c for c in chunks if c["choices"]]
        assert tokens[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["usage"]["prompt_tokens"] == 3
        served.setdefault(gateway, []).append("".join(c["choices"][0]["text"] for c in tokens))
        if len(served) == 2 and i >= 3:
            break
    assert len(served) == 2, served
    # The same greedy request gives the same text whichever gateway serves it.
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    texts: dict[str, str] = {}
    for _ in range(MAX_TRIES):
        with _post(two_gateways.url, body) as resp:
            texts[resp.headers["x-nitsum-gateway"]] = json.loads(resp.read())["choices"][0]["text"]
        if len(texts) == 2:
            break
    assert len(texts) == 2 and len(set(texts.values())) == 1, texts
    # Whichever gateway answers /metrics served streams above: their frames came batched, none one by one.
    with urllib.request.urlopen(two_gateways.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert _counter(metrics, 'nitsum_stream_frames_total{kind="batch"}') > 0, metrics
    assert _counter(metrics, 'nitsum_stream_frames_total{kind="single"}') == 0


def _counter(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0
