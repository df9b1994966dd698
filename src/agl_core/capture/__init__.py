"""The agent side's capture APIs above :mod:`agl_core.tracing`: spans for agents without a framework
(``user_spans``), the calling agent's request header (``agent_header``) and the OpenTelemetry
instrumentors the adapters register (``otel_instrumentor``). The span machinery they stand on is in
:mod:`agl_core.otel`."""
