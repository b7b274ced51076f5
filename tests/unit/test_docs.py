"""The README documents the public interface: every setting, subject, metric, route, verb and service."""

from __future__ import annotations

from pathlib import Path

from nitsum.cli import BENCHES, SERVICES, VERBS
from nitsum.config import all_settings
from nitsum.wire.subjects import ADMIN_COMMANDS, Subjects

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

METRICS = (
    "nitsum_current_tp_level",
    "nitsum_slo_compliance_ratio",
    "nitsum_reconfiguration_duration_ms",
    "nitsum_time_to_first_token_seconds",
    "nitsum_time_per_output_token_seconds",
    "nitsum_requests_total",
    "nitsum_goodput_requests_total",
    "nitsum_queue_depth",
    "nitsum_kv_migration_bytes_total",
    "nitsum_flow_permits_total",
)


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    head = README.split("---")[0]
    blocks = [b.split("```")[0].strip() for b in head.split("```bash")[1:]]
    assert len(blocks) == 2
    assert "nitsum up" in blocks[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1] in ci.splitlines(), "the README test command must be a line of .ci/run"
    assert "5" in ci  # exit 5 is handled


def test_every_setting_is_documented():
    missing = [name for name in all_settings() if f"`{name}`" not in README]
    assert missing == []


def test_subjects_metrics_routes_verbs_documented():
    s = Subjects()
    for subject in (s.submit, s.abort, s.worker_stats, s.worker_lost, s.coordinator_up, s.flow_submit, s.flow_done):
        assert subject in README, subject
    for command in ADMIN_COMMANDS:
        assert command in README
    for metric in METRICS:
        assert metric in README, metric
    for route in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/openapi.json",
    ):
        assert route in README
    for header in ("x-request-tier", "x-slo-ttft-ms", "x-slo-tpot-ms", "x-request-id"):
        assert header in README
    for verb in [*VERBS, "serve", "bench"]:
        assert f"nitsum {verb}" in README
    for name in [*SERVICES, *BENCHES]:
        assert name in README


def test_metric_names_exist_in_code():
    from nitsum.telemetry.metrics import Metrics

    m = Metrics("t")
    for factory in (
        "requests_total",
        "goodput_requests_total",
        "ttft_seconds",
        "tpot_seconds",
        "slo_compliance_ratio",
        "queue_depth",
        "current_tp_level",
        "reconfiguration_duration_ms",
        "kv_migration_bytes_total",
        "flow_permits_total",
    ):
        getattr(m, factory)()
    text = m.render()[0].decode()
    for metric in METRICS:
        assert f"# TYPE {metric}" in text or f"# HELP {metric}" in text, metric
