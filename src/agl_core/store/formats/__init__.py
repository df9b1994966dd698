"""What the store reads and writes on the wire: OTLP trace exports in (``otlp``: protobuf and JSON, decoded
into span rows) and the JSON of its HTTP API out (``wire``)."""
