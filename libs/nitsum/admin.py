"""`nitsum admin status|set-policy|set-topology|drain|role|reform-node`: the admin plane over NATS (JSON).

Connects as the admin identity: NITSUM_NATS_URL / NITSUM_NATS_USER / NITSUM_NATS_PASSWORD, or else the
credentials `nitsum up` wrote (0600) to NITSUM_HOME/run/current.json. Each command carries an id
(`--id`, default random) so that a retry is answered once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid

from nitsum.config import default_home
from nitsum.wire.subjects import Subjects

DEFAULT_TIMEOUT_S = 2.0
# A re-formation is answered once every worker joined the new world (each waits at most its world timeout).
REFORM_TIMEOUT_S = 180.0


def _connection() -> tuple[str, str, str]:
    url = os.environ.get("NITSUM_NATS_URL", "")
    user = os.environ.get("NITSUM_NATS_USER", "")
    password = os.environ.get("NITSUM_NATS_PASSWORD", "")
    current = default_home() / "run" / "current.json"
    if not url and current.exists():
        info = json.loads(current.read_text())
        url, user, password = info["nats_url"], info.get("admin_user", ""), info.get("admin_password", "")
    return url or "nats://127.0.0.1:4222", user, password


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nitsum admin", description="Operate a running nitsum mesh.")
    p.add_argument("--nats", default="", help="NATS URL (default: NITSUM_NATS_URL or the running `nitsum up`)")
    p.add_argument("--namespace", default=os.environ.get("NITSUM_NAMESPACE", "nitsum"))
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT_S:g}; reform-node {REFORM_TIMEOUT_S:g})",
    )
    p.add_argument("--id", default="", help="command id (retries with the same id are answered once)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="workers, groups, queue depth per tier, active policy")
    sp = sub.add_parser("set-policy", help="switch the policy")
    sp.add_argument("policy", help="adaptive | static-tp:K | disagg | static-hybrid")
    st = sub.add_parser("set-topology", help="apply a topology by hand")
    st.add_argument("topology", help="e.g. '[0-1 TP2 hybrid][2 TP1 decode][3 TP1 decode]'")
    st.add_argument("--node", default="node0")
    dr = sub.add_parser("drain", help="stop routing to a worker (--undo to resume)")
    dr.add_argument("worker_id")
    dr.add_argument("--undo", action="store_true")
    ro = sub.add_parser("role", help="set a worker's role")
    ro.add_argument("worker_id")
    ro.add_argument("role", choices=("prefill", "decode", "hybrid"))
    rf = sub.add_parser(
        "reform-node", help="re-form a node's world after it lost a member (the coordinator also does it by itself)"
    )
    rf.add_argument("--node", default="node0")
    return p


async def call(url: str, user: str, password: str, subject: str, body: dict, timeout_s: float) -> dict:
    import nats
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    try:
        nc = await nats.connect(
            servers=[url],
            user=user or None,
            password=password or None,
            connect_timeout=2,
            allow_reconnect=False,
            max_reconnect_attempts=0,
        )
    except Exception as exc:  # nats-py raises several types here
        raise SystemExit(f"nitsum admin: cannot connect to NATS at {url}: {exc}") from None
    try:
        msg = await nc.request(subject, json.dumps(body).encode(), timeout=timeout_s)
        return json.loads(msg.data.decode())
    except NoRespondersError:
        raise SystemExit(f"nitsum admin: no coordinator answers on {subject}") from None
    except (TimeoutError, NatsTimeout):
        raise SystemExit(f"nitsum admin: no answer on {subject} within {timeout_s} s") from None
    finally:
        await nc.close()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    url, user, password = _connection()
    if args.nats:
        url = args.nats
    body: dict = {"id": args.id or uuid.uuid4().hex}
    if args.command == "set-policy":
        body["policy"] = args.policy
    elif args.command == "set-topology":
        body.update(topology=args.topology, node_id=args.node)
    elif args.command == "drain":
        body.update(worker_id=args.worker_id, undo=args.undo)
    elif args.command == "role":
        body.update(worker_id=args.worker_id, role=args.role)
    elif args.command == "reform-node":
        body.update(node_id=args.node)
    timeout_s = (
        args.timeout
        if args.timeout is not None
        else REFORM_TIMEOUT_S
        if args.command == "reform-node"
        else DEFAULT_TIMEOUT_S
    )
    subject = Subjects(args.namespace).admin(args.command)
    answer = asyncio.run(call(url, user, password, subject, body, timeout_s))
    json.dump(answer, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if answer.get("ok") else 1
