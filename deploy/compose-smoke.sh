#!/usr/bin/env bash
# docker compose for real: build the image, start the CPU profile of docker-compose.yml, serve one chat completion
# through the official openai client, tear everything down. CI does not run it (it needs root and a Docker engine).
#
# Needs: docker (dockerd may run as `dockerd --bridge=none --iptables=false`: every container uses host networking),
# `docker compose` (v2) or `docker-compose` (v1.28+), debootstrap, and this repository's venv (.venv, with `openai`).
# No image registry is used: the base image is built with debootstrap from Debian's mirror
# (deploy/docker/build-base-image.sh), the wheels come from this machine's pip (deploy/docker/wheels/).
# Ports on this host: NATS and the gateway on free ports (NATS_PORT, NITSUM_GATEWAY_PORT), metrics 9090, 9091, 9100,
# 9101, node world 29400.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
BASE="${NITSUM_BASE_IMAGE:-nitsum-base:bookworm}"
PROJECT="${NITSUM_SMOKE_PROJECT:-nitsum-smoke}"
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
COMPOSE+=(-p "$PROJECT" --profile cpu)

started=$(date +%s)
deploy/docker/build-base-image.sh "$BASE"
echo "== wheels for an offline build"
"$PY" -m pip wheel -q -w deploy/docker/wheels . "setuptools>=68" wheel

export NITSUM_BASE_IMAGE="$BASE" NITSUM_PIP_INSTALL_ARGS="--no-index --find-links /opt/wheels"
export NITSUM_DTYPE=float32 NITSUM_DEVICE_KIND=cpu NITSUM_MAX_TP=2
# NATS and the gateway on free ports of this host (a `nitsum up` may hold 4222 and 8000).
free_port() { "$PY" -c 'from nitsum.natsserver import free_port; print(free_port())'; }
export NATS_PORT="${NATS_PORT:-$(free_port)}" NITSUM_GATEWAY_PORT="${NITSUM_GATEWAY_PORT:-$(free_port)}"
export NITSUM_NATS_URL="nats://127.0.0.1:$NATS_PORT"
for id in GATEWAY COORDINATOR WORKER FLOW_SCHEDULER ADMIN; do  # throwaway passwords for this run only
  export "NITSUM_NATS_PASSWORD_$id=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(18))')"
done

teardown() {
  rc=$?
  if [ "$rc" != 0 ]; then "${COMPOSE[@]}" logs --tail=80 || true; fi
  "${COMPOSE[@]}" down -v --remove-orphans || true
  echo "compose-smoke: $([ "$rc" = 0 ] && echo PASS || echo FAIL) in $(( $(date +%s) - started )) s"
  exit "$rc"
}
trap teardown EXIT

echo "== build"
"${COMPOSE[@]}" build
echo "== up (cpu profile)"
"${COMPOSE[@]}" up -d
gateway="$("${COMPOSE[@]}" ps -q gateway)"
for _ in $(seq 1 120); do
  health="$(docker inspect --format '{{.State.Health.Status}}' "$gateway")"
  [ "$health" = healthy ] && break
  [ "$health" = unhealthy ] && { echo "gateway unhealthy"; exit 1; }
  sleep 3
done
[ "$health" = healthy ] || { echo "gateway not healthy in time ($health)"; exit 1; }
"${COMPOSE[@]}" ps

echo "== one chat completion through the openai client"
"$PY" - "$NITSUM_GATEWAY_PORT" <<'PYEOF'
import sys
from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello from compose"}], max_tokens=8)
print(f"model={model} finish={reply.choices[0].finish_reason} completion_tokens={reply.usage.completion_tokens} text={reply.choices[0].message.content!r}")
assert reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason in ("length", "stop")
PYEOF
