"""``agl import``: OTLP trace files (the Collector's file exporter, JSON lines or protobuf, gzip or not)
into a store, grouped into rollouts that ``agl inspect`` and the trainer read like any other; and
known-good calls written as such files (:func:`write_demonstrations`), a warm start's data."""

from __future__ import annotations

from ._demonstrations import Demonstration, write_demonstrations
from ._files import FORMATS
from ._grouping import session_rollout_id, trace_rollout_id
from ._run import ImportSummary, import_traces

__all__ = [
    "FORMATS",
    "Demonstration",
    "ImportSummary",
    "import_traces",
    "session_rollout_id",
    "trace_rollout_id",
    "write_demonstrations",
]
