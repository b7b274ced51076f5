"""Typed NITSUM_* settings: how a frozen config dataclass declares its settings (`setting`: the environment
variable, default, help and check of each field), builds itself from them (`load`: defaults ← environment ←
command-line flags; a bad value raises ConfigError naming the setting) and shows itself (`describe`: secrets
masked); and the settings every service shares (`CommonConfig`). Each service's own are in `nitsum.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nitsum.cpus import cpu_list_error

C = TypeVar("C")


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting and what was expected."""


def setting(
    env: str,
    default: Any,
    help: str,
    *,
    secret: bool = False,
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """Declare one setting: its NITSUM_* variable, default, help and an optional check (returns an error or None)."""
    meta = {"env": env, "help": help, "secret": secret, "check": check}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in configs")
    # Secrets stay out of repr() so that a logged config never shows them.
    return field(default=default, metadata=meta, repr=not secret)


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a TCP port (0-65535)"


def one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def power_of_two(value: int) -> str | None:
    return None if value >= 1 and value & (value - 1) == 0 else "must be a power of two >= 1"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(tp: Any, raw: str) -> Any:
    if tp is bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError("expected a boolean (true/false, 1/0, yes/no, on/off)")
    if tp is int:
        try:
            return int(raw.strip())
        except ValueError:
            raise ValueError("expected an integer") from None
    if tp is float:
        try:
            return float(raw.strip())
        except ValueError:
            raise ValueError("expected a number") from None
    if tp is str:
        return raw
    if typing.get_origin(tp) is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    raise TypeError(f"unsupported setting type {tp}")


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "env" in f.metadata]


def load(
    cls: type[C], argv: list[str] | None = None, environ: Mapping[str, str] | None = None, prog: str | None = None
) -> C:
    """Build a frozen config: defaults ← environment ← command-line flags. Raises ConfigError."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in _fields(cls):
        name = f.metadata["env"]
        if name in env and env[name] != "":
            try:
                values[f.name] = _parse(hints[f.name], env[name])
            except ValueError as exc:
                raise ConfigError(f"{name}={_show(f, env[name])!s}: {exc}") from None
    if argv:
        parser = argparse.ArgumentParser(prog=prog, add_help=True, exit_on_error=False)
        for f in _fields(cls):
            flag = "--" + f.name.replace("_", "-")
            parser.add_argument(flag, dest=f.name, default=None, help=f"{f.metadata['help']} [{f.metadata['env']}]")
        try:
            ns, unknown = parser.parse_known_args(argv)
        except argparse.ArgumentError as exc:
            raise ConfigError(str(exc)) from None
        if unknown:
            raise ConfigError(f"unknown option(s): {' '.join(unknown)}")
        for f in _fields(cls):
            raw = getattr(ns, f.name)
            if raw is not None:
                try:
                    values[f.name] = _parse(hints[f.name], raw)
                except ValueError as exc:
                    flag = "--" + f.name.replace("_", "-")
                    raise ConfigError(f"{flag} {_show(f, raw)} ({f.metadata['env']}): {exc}") from None
    config = cls(**values)
    for f in _fields(cls):
        check = f.metadata["check"]
        if check is not None:
            problem = check(getattr(config, f.name))
            if problem:
                raise ConfigError(f"{f.metadata['env']}={_show(f, getattr(config, f.name))}: {problem}")
    return config


def _show(f: dataclasses.Field, value: Any) -> str:
    return "***" if f.metadata.get("secret") else repr(value)


def describe(config: Any) -> dict[str, Any]:
    """The config as a dict for logs and `admin status`, with secrets masked."""
    out = {}
    for f in _fields(type(config)):
        value = getattr(config, f.name)
        out[f.metadata["env"]] = ("***" if value else "") if f.metadata["secret"] else value
    return out


def settings_of(cls: type) -> dict[str, str]:
    """Environment variable → help for every setting of a config class (README and compose checks use it)."""
    return {f.metadata["env"]: f.metadata["help"] for f in _fields(cls)}


# ---- the settings every service shares ---------------------------------------------------------------------
NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def nats_urls(value: str) -> list[str]:
    """NITSUM_NATS_URL's servers in order: one URL, or the comma-separated members of a NATS cluster."""
    return [s.strip() for s in value.split(",") if s.strip()]


def nats_url_list(value: str) -> str | None:
    """Every entry of a NITSUM_NATS_URL list is [scheme://]host[:port] with a NATS scheme."""
    from urllib.parse import urlsplit

    servers = nats_urls(value)
    if not servers:
        return "must name at least one NATS server (nats://host:port, comma-separated for a cluster)"
    for entry in servers:
        url = urlsplit(entry if "://" in entry else "nats://" + entry)
        try:
            url.port  # noqa: B018 - raises on a bad port
        except ValueError:
            return f"entry {servers.index(entry) + 1} has a bad port (expected nats://host:port)"
        if url.scheme not in NATS_SCHEMES or not url.hostname:
            return f"entry {servers.index(entry) + 1} is not a NATS URL (expected {'|'.join(NATS_SCHEMES)}://host:port)"
    return None


def default_home() -> Path:
    return Path(os.environ.get("NITSUM_HOME") or Path.home() / ".cache" / "nitsum")


@dataclass(frozen=True)
class CommonConfig:
    nats_url: str = setting(
        "NITSUM_NATS_URL",
        "nats://127.0.0.1:4222",
        "NATS server URL(s), comma-separated: the members of a NATS cluster (a service reconnects to another when its server goes)",
        check=nats_url_list,
    )
    nats_user: str = setting("NITSUM_NATS_USER", "", "NATS user name of this service's identity")
    nats_password: str = setting("NITSUM_NATS_PASSWORD", "", "NATS password of this service's identity", secret=True)
    namespace: str = setting("NITSUM_NAMESPACE", "nitsum", "subject namespace shared by one mesh")
    run_dir: str = setting("NITSUM_RUN_DIR", "", "directory for logs and the span file (default: NITSUM_HOME/run)")
    log_level: str = setting("NITSUM_LOG_LEVEL", "INFO", "log level", check=one_of("DEBUG", "INFO", "WARNING", "ERROR"))
    metrics_port: int = setting(
        "NITSUM_METRICS_PORT", 9090, "Prometheus /metrics port for services without HTTP (0: off)", check=port
    )
    request_timeout_s: float = setting("NITSUM_NATS_TIMEOUT_S", 2.0, "timeout of one NATS request", check=positive)
    api_keys: tuple[str, ...] = setting(
        "NITSUM_API_KEYS", (), "comma-separated API keys for HTTP routes (empty: no auth)", secret=True
    )
    api_key_file: str = setting("NITSUM_API_KEY_FILE", "", "file with one API key per line (joins NITSUM_API_KEYS)")
    cpus: str = setting(
        "NITSUM_CPUS",
        "",
        "CPUs this service runs on, as taskset writes them (1, 0-3,6): every thread of the process is pinned at "
        "start; a CPU it may not use stops it with an error (Linux; empty: wherever it was started; "
        "`nitsum up --cpu-affinity auto` sets it)",
        check=cpu_list_error,
    )

    def resolved_api_keys(self) -> tuple[str, ...]:
        """Keys from NITSUM_API_KEYS and the key file; a missing key file is a ConfigError."""
        keys = list(self.api_keys)
        if self.api_key_file:
            try:
                text = Path(self.api_key_file).read_text()
            except OSError as exc:
                raise ConfigError(
                    f"NITSUM_API_KEY_FILE={self.api_key_file!r}: cannot read it ({exc.strerror})"
                ) from None
            keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        return tuple(keys)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else default_home() / "run"
