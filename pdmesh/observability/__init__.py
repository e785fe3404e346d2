"""Observability shared by every service: OpenTelemetry tracing (off unless OTEL_* configures
it) and Prometheus metrics (a `/metrics` endpoint per process, engine state read at scrape time).

Services call into it with small hooks; what they measure and name lives beside them.
"""
