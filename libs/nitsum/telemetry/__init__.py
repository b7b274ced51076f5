"""OpenTelemetry tracing (with NATS header propagation) and the Prometheus metric names."""
