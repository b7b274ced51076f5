"""Typed NITSUM_* settings: env, CLI override, errors that name the setting, secrets never shown."""

from __future__ import annotations

import dataclasses

import pytest

from nitsum.config import ConfigError, CoordinatorConfig, GatewayConfig, WorkerConfig, all_settings, describe, load


def test_defaults_env_and_cli_override():
    cfg = load(GatewayConfig, ["--port", "9001"], {"NITSUM_GATEWAY_PORT": "9000", "NITSUM_NATS_URL": "nats://h:1"})
    assert cfg.port == 9001
    assert cfg.nats_url == "nats://h:1"
    assert cfg.max_body_bytes == 8 << 20
    assert load(GatewayConfig, [], {"NITSUM_GATEWAY_PORT": "9000"}).port == 9000


@pytest.mark.parametrize(
    "cls, env, argv, named",
    [
        (GatewayConfig, {"NITSUM_GATEWAY_PORT": "eighty"}, [], "NITSUM_GATEWAY_PORT"),
        (GatewayConfig, {"NITSUM_GATEWAY_PORT": "70000"}, [], "NITSUM_GATEWAY_PORT"),
        (CoordinatorConfig, {}, ["--max-tp", "3"], "NITSUM_MAX_TP"),
        (CoordinatorConfig, {"NITSUM_RECONFIG_INTERVAL_MS": "0"}, [], "NITSUM_RECONFIG_INTERVAL_MS"),
        (WorkerConfig, {"NITSUM_DEVICE": "tpu"}, [], "NITSUM_DEVICE"),
        (WorkerConfig, {"NITSUM_ENABLE_RELOAD_FREE_WEIGHTS": "maybe"}, [], "NITSUM_ENABLE_RELOAD_FREE_WEIGHTS"),
        (WorkerConfig, {}, ["--no-such-flag", "1"], "--no-such-flag"),
    ],
)
def test_bad_values_name_the_setting(cls, env, argv, named):
    with pytest.raises(ConfigError) as info:
        load(cls, argv, env)
    assert named in str(info.value)


def test_configs_are_frozen():
    cfg = load(WorkerConfig, [], {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_cache_mb = 1  # type: ignore[misc]


def test_secrets_are_masked_everywhere(tmp_path):
    env = {"NITSUM_API_KEYS": "sk-secret-1,sk-secret-2", "NITSUM_NATS_PASSWORD": "hunter2"}
    cfg = load(GatewayConfig, [], env)
    assert cfg.api_keys == ("sk-secret-1", "sk-secret-2")
    text = repr(cfg) + str(describe(cfg))
    assert "sk-secret" not in text and "hunter2" not in text
    keyfile = tmp_path / "keys"
    keyfile.write_text("# comment\nsk-from-file\n\n")
    cfg = load(GatewayConfig, [], {"NITSUM_API_KEY_FILE": str(keyfile), "NITSUM_API_KEYS": "a"})
    assert cfg.resolved_api_keys() == ("a", "sk-from-file")
    with pytest.raises(ConfigError, match="NITSUM_API_KEY_FILE"):
        load(GatewayConfig, [], {"NITSUM_API_KEY_FILE": str(tmp_path / "missing")}).resolved_api_keys()


def test_architecture_names_are_settings():
    names = all_settings()
    for name in (
        "NITSUM_MAX_TP",
        "NITSUM_ENABLE_RELOAD_FREE_WEIGHTS",
        "NITSUM_NVLINK_P2P_MIGRATION",
        "NITSUM_RECONFIG_INTERVAL_MS",
        "NITSUM_NATS_URL",
    ):
        assert name in names
    assert load(CoordinatorConfig, [], {}).reconfig_interval_ms == 1000
