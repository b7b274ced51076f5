"""NATS as a cluster: N nats-servers joined by routes, each carrying nitsum's per-service identities.

Every member's config is `natsserver.render_config` (listen address, identities and their permissions)
plus its `server_name` and a `cluster {}` block: routes authenticate as the `route` user; a client
connected to any member reaches every other member's clients. Services take the members' URLs as a
comma-separated NITSUM_NATS_URL and, when the server they are connected to goes away, reconnect to
another one (nitsum.bus).

`python -m nitsum.natscluster --out deploy/nats/cluster` writes the three-server configuration kept
in the repository: passwords and routes are `$NITSUM_NATS_*` references that nats-server reads from
its environment (NITSUM_NATS_ROUTES holds a list, e.g.
`["nats-route://route:<password>@nats-2:6222", "nats-route://route:<password>@nats-3:6222"]`).
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nitsum.natsserver import NatsServer, find_binary, free_port, render_config, write_secure

ROUTE_USER = "route"
CLUSTER_NAME = "nitsum"
ROUTE_PASSWORD_ENV = "NITSUM_NATS_PASSWORD_ROUTE"
ROUTES_ENV = "NITSUM_NATS_ROUTES"


@dataclass(frozen=True)
class Member:
    """One server of the cluster: where clients and the other members reach it."""

    name: str
    host: str
    client_port: int = 4222
    cluster_port: int = 6222
    listen_host: str = ""  # "" = host
    monitor_port: int = 0  # HTTP monitoring (/connz, /routez); 0 = off

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.client_port}"

    def route_url(self, route_password: str | None) -> str:
        auth = f"{ROUTE_USER}:{route_password}@" if route_password else ""
        return f"nats-route://{auth}{self.host}:{self.cluster_port}"


def render_member_config(
    member: Member,
    peers: Sequence[Member],
    passwords: dict[str, str] | None,
    route_password: str | None,
    namespace: str = "nitsum",
    env_refs: bool = False,
) -> str:
    """The config of `member`, routed to `peers`. With `env_refs` passwords and routes are references; with
    neither passwords nor `env_refs` clients connect anonymously (tests' plain servers; routes still authenticate)."""
    listen = member.listen_host or member.host
    if passwords is None and not env_refs:
        base = f"listen: {listen}:{member.client_port}\nmax_payload: 8MB\n"
    else:
        base = render_config(member.client_port, passwords, namespace=namespace, host=listen, env_refs=env_refs)
    if env_refs:
        password, routes = f"${ROUTE_PASSWORD_ENV}", f"${ROUTES_ENV}"
    else:
        if not route_password:
            raise ValueError("a route password is required unless env_refs is set")
        password = json.dumps(route_password)
        routes = json.dumps([p.route_url(route_password) for p in peers if p.name != member.name])
    lines = [f"server_name: {json.dumps(member.name)}", base.rstrip("\n")]
    if member.monitor_port:
        lines.append(f"http: {listen}:{member.monitor_port}")
    lines += [
        "cluster {",
        f"  name: {json.dumps(CLUSTER_NAME)}",
        f"  listen: {listen}:{member.cluster_port}",
        f"  authorization {{ user: {json.dumps(ROUTE_USER)}, password: {password} }}",
        f"  routes: {routes}",
        "}",
        "",
    ]
    return "\n".join(lines)


def urls(members: Sequence[Member]) -> str:
    """NITSUM_NATS_URL for a service that may use any member."""
    return ",".join(m.url for m in members)


def new_route_password() -> str:
    return secrets.token_urlsafe(24)


def monitor(member: Member, path: str, timeout_s: float = 2.0) -> dict:
    with urllib.request.urlopen(f"http://{member.host}:{member.monitor_port}/{path}", timeout=timeout_s) as resp:
        return json.loads(resp.read())


@dataclass
class LocalCluster:
    """N members on one address (loopback), each a nats-server child process; for tests and `nitsum up`-like use."""

    directory: Path
    passwords: dict[str, str] | None
    size: int = 3
    host: str = "127.0.0.1"
    members: list[Member] = field(default_factory=list)
    servers: list[NatsServer] = field(default_factory=list)
    route_password: str = field(default_factory=new_route_password)

    @property
    def url(self) -> str:
        return urls(self.members)

    def start(self, timeout_s: float = 15.0) -> LocalCluster:
        if not self.members:
            self.members = [
                Member(
                    f"nats-{i + 1}",
                    self.host,
                    free_port(self.host),
                    free_port(self.host),
                    monitor_port=free_port(self.host),
                )
                for i in range(self.size)
            ]
        for member in self.members:
            conf = self.directory / f"{member.name}.conf"
            write_secure(conf, render_member_config(member, self.members, self.passwords, self.route_password))
            server = NatsServer(port=member.client_port, config_path=conf, host=self.host)
            self.servers.append(server.start(log_path=self.directory / f"{member.name}.log", timeout_s=timeout_s))
        self.wait_routed(timeout_s)
        return self

    def wait_routed(self, timeout_s: float = 15.0) -> None:
        """Until every running member has a route to every other running member."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [
                m for m, s in zip(self.members, self.servers) if s.process is not None and s.process.poll() is None
            ]
            try:
                if all(
                    len({r.get("remote_id") for r in monitor(m, "routez")["routes"] or []}) >= len(alive) - 1
                    for m in alive
                ):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the NATS cluster did not form within {timeout_s} s (logs in {self.directory})")
            time.sleep(0.1)

    def server_of(self, client_name: str) -> int:
        """Index of the member the client named `client_name` is connected to (-1: none)."""
        for i, (member, server) in enumerate(zip(self.members, self.servers)):
            if server.process is None or server.process.poll() is not None:
                continue
            try:
                conns = monitor(member, "connz?limit=1024")["connections"] or []
            except OSError:
                continue
            if any(c.get("name") == client_name for c in conns):
                return i
        return -1

    def kill(self, index: int) -> None:
        """SIGKILL one member: its clients see their connection drop, nothing is handed over."""
        process = self.servers[index].process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def start_member_process(
    config_path: Path, log_path: Path, prefix: Sequence[str] = (), env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A nats-server for `config_path`, optionally under a command prefix (e.g. `ip netns exec NS`)."""
    out = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [*prefix, find_binary(), "-c", str(config_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    finally:
        out.close()


def deploy_members(count: int = 3) -> list[Member]:
    """The repository's cluster: members nats-1..N, reached by those host names, on the standard ports."""
    return [Member(f"nats-{i + 1}", f"nats-{i + 1}", 4222, 6222, listen_host="0.0.0.0") for i in range(count)]


def deploy_config(member: Member, members: Sequence[Member]) -> str:
    header = (
        f"# {member.name} of the three-server nitsum NATS cluster. Generated by `python -m nitsum.natscluster --out deploy/nats/cluster`.\n"
        f"# nats-server reads from its environment: NITSUM_NATS_PASSWORD_<IDENTITY> (one per service identity),\n"
        f"# {ROUTE_PASSWORD_ENV} (the routes' password) and {ROUTES_ENV}, the other members' routes as a list, e.g.\n"
        f"# {ROUTES_ENV}='{json.dumps([p.route_url('<password>') for p in members if p.name != member.name])}'\n"
    )
    return header + render_member_config(member, members, None, None, env_refs=True)


K8S_SERVER_NAME_ENV = "POD_NAME"


def k8s_config() -> str:
    """The config every pod of a NATS StatefulSet runs (deploy/k8s/nats.yaml): its name is the pod's, its routes are
    every member's (a route to itself is dropped by nats-server) and come, with the passwords, from the environment."""
    member = Member("k8s", "0.0.0.0", 4222, 6222)
    text = render_member_config(member, [], None, None, env_refs=True)
    return text.replace('server_name: "k8s"', f"server_name: ${K8S_SERVER_NAME_ENV}", 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nitsum.natscluster", description="write the NATS cluster configs")
    parser.add_argument("--out", required=True, help="directory for nats-1.conf ... nats-N.conf")
    parser.add_argument("--size", type=int, default=3)
    args = parser.parse_args(argv)
    members = deploy_members(args.size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for member in members:
        (out / f"{member.name}.conf").write_text(deploy_config(member, members))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
