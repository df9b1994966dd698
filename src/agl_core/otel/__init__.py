"""The OpenTelemetry machinery beneath :mod:`agl_core.tracing` and :mod:`agl_core.capture`: lean adapter
spans (``lean_spans``), the exporter that keeps what it could not deliver (``spool``) and spans to an OTLP
JSON lines file (``otlp_file``). Nothing here imports another agl_core package but :mod:`agl_core.semconv`."""
