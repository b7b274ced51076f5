# One image for every nitsum service: `nitsum serve <service>` picks the role.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 NITSUM_HOME=/var/lib/nitsum
WORKDIR /opt/nitsum
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY load ./load
RUN pip install .
EXPOSE 8000 9090
ENTRYPOINT ["nitsum"]
CMD ["serve", "gateway"]
