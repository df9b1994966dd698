"""``agl import``: OTLP trace files (the Collector's file exporter, JSON lines or protobuf, gzip or not)
into a store, grouped into rollouts that ``agl inspect`` and the trainer read like any other."""

from __future__ import annotations

from ._files import FORMATS
from ._grouping import session_rollout_id, trace_rollout_id
from ._run import ImportSummary, import_traces

__all__ = ["FORMATS", "ImportSummary", "import_traces", "session_rollout_id", "trace_rollout_id"]
