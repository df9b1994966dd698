"""The agent side's capture plumbing beneath :mod:`agl_core.tracing` and the adapters: lean adapter spans
(``lean_spans``), spans for agents without a framework (``user_spans``), the calling agent's request
header (``agent_header``), the OpenTelemetry instrumentors (``otel_instrumentor``), the exporter that keeps
what it could not deliver (``spool``) and spans to a file (``otlp_file``)."""
