"""``agl import``: trace files as the real exporters write them, into SQLite, PostgreSQL and a running store.

Collector-style files are made from spans the OpenTelemetry SDK recorded, encoded by the SDK's own OTLP
encoder (``encode_spans``) and written the way the Collector's ``file`` exporter writes them: JSON lines
(protobuf's JSON mapping with hex ids and numeric enums, as the Collector's marshaler writes) or
length-prefixed protobuf records.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_core import semconv
from agl_core.cli import main
from agl_core.importer import _run, import_traces, session_rollout_id
from agl_core.importer._files import MAX_RECORD_BYTES
from agl_core.pipeline.transitions import COUNT_MISMATCH, NO_LLM_CALL
from agl_core.records import RolloutStatus
from agl_core.store import NotFoundError, SqliteStore, StoreError
from agl_core.store.redact import parse_rules
from agl_core.testing import Collector
from agl_core.tracing import emit_reward, rollout_scope
from tests._servers import wait_healthy


# --- files as the exporters write them -----------------------------------------------------------------
def _record(build: Callable[[Any], None]) -> list[ReadableSpan]:
    """The finished spans of ``build(tracer_provider)``, as the SDK hands them to an exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "imported-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    build(provider)
    provider.shutdown()
    return list(exporter.get_finished_spans())


def _hex_ids(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            k: base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") else _hex_ids(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_hex_ids(v) for v in obj]
    return obj


def json_line(spans: list[ReadableSpan]) -> bytes:
    """One line of the Collector's file exporter (JSON): hex ids, numeric enums, 64-bit ints as strings."""
    data = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    return json.dumps(_hex_ids(data), separators=(",", ":")).encode() + b"\n"


def proto_record(spans: list[ReadableSpan]) -> bytes:
    """One record of the Collector's file exporter with ``format: proto``."""
    body = encode_spans(spans).SerializeToString()
    return len(body).to_bytes(4, "big") + body


def _agent_run(rollout_id: str) -> Callable[[Any], None]:
    def build(provider: Any) -> None:
        tracer = provider.get_tracer("agent")
        with rollout_scope(rollout_id, "at-1", "task-1", tracer_provider=provider):
            with tracer.start_as_current_span("step"):
                pass
            emit_reward(1.0, tracer_provider=provider)

    return build


def _late_rollout(session: str, rollout_id: str, *, other: bool = False) -> dict[str, ReadableSpan]:
    """A trace (``root``) whose span ``first`` names ``session`` and whose span ``second`` names
    ``rollout_id``; with ``other``, a second trace of the same session (``other``). By span name."""

    def build(provider: Any) -> None:
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("root"):
            with tracer.start_as_current_span("first", attributes={semconv.SESSION_ID: session}):
                pass
            with tracer.start_as_current_span("second", attributes={semconv.ROLLOUT_ID: rollout_id}):
                pass
        if other:
            with tracer.start_as_current_span("other", attributes={semconv.SESSION_ID: session}):
                pass

    return {s.name: s for s in _record(build)}


def _openinference_session(session: str, traces: int = 2) -> Callable[[Any], None]:
    """Spans as OpenInference instrumentors write them: an AGENT span over an LLM and a TOOL span, each
    carrying ``session.id``, one trace per turn."""

    def build(provider: Any) -> None:
        tracer = provider.get_tracer("openinference.instrumentation.test")
        for turn in range(traces):
            common = {semconv.SESSION_ID: session}
            with tracer.start_as_current_span(
                "agent",
                attributes={**common, semconv.OPENINFERENCE_SPAN_KIND: semconv.OPENINFERENCE_KIND_AGENT},
            ):
                with tracer.start_as_current_span(
                    "ChatCompletion",
                    attributes={
                        **common,
                        semconv.OPENINFERENCE_SPAN_KIND: semconv.OPENINFERENCE_KIND_LLM,
                        semconv.LLM_MODEL_NAME: "gpt-test",
                        semconv.LLM_TOKEN_COUNT_PROMPT: 12,
                        semconv.LLM_TOKEN_COUNT_COMPLETION: 3 + turn,
                        "user.email": "someone@example.com",
                    },
                ):
                    pass
                with tracer.start_as_current_span(
                    "search",
                    attributes={
                        **common,
                        semconv.OPENINFERENCE_SPAN_KIND: semconv.OPENINFERENCE_KIND_TOOL,
                        semconv.OI_TOOL_NAME: "search",
                    },
                ):
                    pass

    return build


def _write(path: Path, data: bytes, *, gz: bool = False, zstd: bool = False) -> Path:
    if zstd:  # as the Collector's file exporter writes with compression: zstd, a frame per write
        import zstandard

        half = len(data) // 2
        compressor = zstandard.ZstdCompressor()
        data = compressor.compress(data[:half]) + compressor.compress(data[half:])
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _by_rollout(store: Any, rollout_id: str) -> list[Any]:
    return store.query_spans(rollout_ids=[rollout_id], limit=100_000)


class _open:
    def __init__(self, path: Path) -> None:
        self.store = SqliteStore(path)

    def __enter__(self) -> SqliteStore:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


# --- formats ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind", ["json", "proto", "bare", "json-gzip", "proto-gzip", "json-zstd", "proto-zstd", "document"]
)
def test_exporter_files_import_as_rollouts(tmp_path, sqlite_store, kind):
    first, second = _record(_agent_run("ro-a")), _record(_agent_run("ro-b"))
    if kind.startswith("json"):
        data = json_line(first) + json_line(second)
    elif kind.startswith("proto"):
        data = proto_record(first) + proto_record(second)
    elif kind == "bare":
        data = encode_spans(first + second).SerializeToString()
    else:  # one pretty-printed OTLP/JSON document
        data = json.dumps(_hex_ids(MessageToDict(encode_spans(first + second))), indent=2).encode()
    path = _write(tmp_path / "traces.out", data, gz=kind.endswith("gzip"), zstd=kind.endswith("zstd"))

    summary = import_traces([path], sqlite_store)

    assert (summary.spans, summary.new_spans, summary.rollouts, summary.problems) == (6, 6, 2, [])
    spans = _by_rollout(sqlite_store, "ro-a")
    # the rollout and reward spans keep their id; "step" (no rollout attribute) joins its trace's rollout
    assert sorted(s.name for s in spans) == sorted([semconv.SPAN_ROLLOUT, semconv.SPAN_REWARD, "step"])
    assert {s.resource["service.name"] for s in spans} == {"imported-agent"}
    (rollout,) = sqlite_store.get_rollouts(["ro-a"])
    assert rollout.status is RolloutStatus.SUCCEEDED and rollout.attempts == ()
    assert rollout.metadata == {"source": "import", "file": str(path)}


def test_grouping_by_session_across_traces_then_by_trace(tmp_path, store):
    spans = _record(_openinference_session("conv-42", traces=2)) + _record(_openinference_session("", 1))
    path = _write(tmp_path / "oi.jsonl", json_line(spans))

    summary = import_traces([path], store)

    assert summary.spans == 9 and summary.rollouts == 2 and summary.exit_code == 0
    rollouts = {r.rollout_id: r for r in store.get_rollouts(_rollout_ids(store))}
    session = next(r for r in rollouts.values() if r.metadata.get(semconv.SESSION_ID) == "conv-42")
    assert session.rollout_id.startswith("imp-s-")
    grouped = _by_rollout(store, session.rollout_id)
    assert len(grouped) == 6 and len({s.trace_id for s in grouped}) == 2
    assert all(s.attributes[semconv.ROLLOUT_ID] == session.rollout_id for s in grouped)
    (alone,) = [r for r in rollouts.values() if r is not session]
    (trace_id,) = {s.trace_id for s in _by_rollout(store, alone.rollout_id)}
    assert alone.rollout_id == f"imp-t-{trace_id}" and alone.metadata["trace_id"] == trace_id


def _rollout_ids(store: Any) -> list[str]:
    return sorted({s.rollout_id for s in store.query_spans(limit=100_000) if s.rollout_id})


def test_importing_twice_stores_nothing_twice(tmp_path, store):
    path = _write(tmp_path / "t.jsonl", json_line(_record(_openinference_session("s-1"))))
    first = import_traces([path], store)
    stats = store.stats()
    again = import_traces([path], store)
    assert (first.new_spans, again.new_spans, again.spans, again.rollouts) == (6, 0, 6, 1)
    assert store.stats() == stats


def test_gen_ai_conversation_id_groups_and_session_id_wins(tmp_path, sqlite_store):
    def build(provider: Any) -> None:
        tracer = provider.get_tracer("t")
        for conversation in ("c-1", "c-1", "c-2"):
            with tracer.start_as_current_span(
                "chat", attributes={semconv.GEN_AI_CONVERSATION_ID: conversation}
            ):
                pass
        with tracer.start_as_current_span("chat", attributes={semconv.GEN_AI_CONVERSATION_ID: "c-2"}):
            with tracer.start_as_current_span("inner", attributes={semconv.SESSION_ID: "c-1"}):
                pass

    path = _write(tmp_path / "g.jsonl", json_line(_record(build)))
    assert import_traces([path], sqlite_store).rollouts == 2
    sizes = sorted(len(_by_rollout(sqlite_store, r)) for r in _rollout_ids(sqlite_store))
    assert sizes == [1, 4]  # c-1: two traces + the trace whose session.id is c-1; c-2: one


@pytest.mark.parametrize("kind", ["json", "proto", "proto-spilled-to-disk"])
def test_a_session_named_in_a_later_record_groups_the_whole_trace(tmp_path, sqlite_store, monkeypatch, kind):
    """The grouping is learnt from every record before any span is written: a trace whose session is
    named only on a span of a later record (or is named there by the preferred key) is one rollout."""

    def build(provider: Any) -> None:
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("agent"):  # trace 1: session.id only on "late"
            with tracer.start_as_current_span("step"):
                pass
            with tracer.start_as_current_span("late", attributes={semconv.SESSION_ID: "s-late"}):
                pass
        with tracer.start_as_current_span("chat", attributes={semconv.GEN_AI_CONVERSATION_ID: "c-early"}):
            with tracer.start_as_current_span("late", attributes={semconv.SESSION_ID: "s-wins"}):
                pass  # trace 2: gen_ai.conversation.id first, session.id (preferred) later
        with tracer.start_as_current_span("other"):  # trace 3: no session
            pass

    spans = _record(build)  # finished order: step, late, agent, late, chat, other
    late = [s for s in spans if s.name == "late"]
    early = [s for s in spans if s.name != "late"]
    encode = json_line if kind == "json" else proto_record
    path = _write(tmp_path / "late.out", b"".join(encode(r) for r in (early, late[:1], late[1:])))
    if kind == "proto-spilled-to-disk":
        monkeypatch.setattr(_run, "_SPILL_MEMORY_BYTES", 1)

    summary = import_traces([path], sqlite_store)

    assert (summary.spans, summary.rollouts, summary.problems) == (6, 3, [])
    trace_ids = {s.name: format(s.context.trace_id, "032x") for s in early}
    for name, session, count in (("agent", "s-late", 3), ("chat", "s-wins", 2)):
        stored = sqlite_store.query_spans(trace_id=trace_ids[name])
        assert len(stored) == count
        assert {s.rollout_id for s in stored} == {session_rollout_id(session)}
        assert {s.attributes[semconv.ROLLOUT_ID] for s in stored} == {session_rollout_id(session)}
        (rollout,) = sqlite_store.get_rollouts([session_rollout_id(session)])
        assert rollout.metadata == {"source": "import", "file": str(path), semconv.SESSION_ID: session}
    (alone,) = sqlite_store.query_spans(trace_id=trace_ids["other"])
    assert alone.rollout_id == f"imp-t-{trace_ids['other']}"


def _counting_readings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files whose records are read, once per reading."""
    readings: list[str] = []
    records = _run.TraceFile.records

    def counted(self: Any) -> Any:
        readings.append(self.path.name)
        return records(self)

    monkeypatch.setattr(_run.TraceFile, "records", counted)
    return readings


def _plain_traces(provider: Any) -> None:
    """Two traces of three spans that name no session and no rollout."""
    tracer = provider.get_tracer("plain")
    for _ in range(2):
        with tracer.start_as_current_span("agent"):
            for name in ("llm", "tool"):
                with tracer.start_as_current_span(name):
                    pass


@pytest.mark.parametrize("kind", ["sessions", "plain traces"])
def test_plain_protobuf_files_are_read_once_and_written_while_read(tmp_path, sqlite_store, monkeypatch, kind):
    """No file names a rollout id, and each span names its trace's session (or no trace names any): each
    trace's rollout is certain as soon as it is read, so its spans go to the writer then, and no file is
    read twice."""
    if kind == "sessions":
        records = [_record(_openinference_session(f"s-{n}")) for n in range(3)]
    else:
        records = [_record(_plain_traces) for _ in range(3)]
    path = _write(tmp_path / "oi.pb", b"".join(proto_record(spans) for spans in records))
    readings = _counting_readings(monkeypatch)
    handed: list[int] = []

    summary = import_traces([path], sqlite_store, progress=lambda *a: handed.append(a[4]))

    rollouts = 3 if kind == "sessions" else 6
    assert (summary.spans, summary.new_spans, summary.rollouts, summary.problems) == (18, 18, rollouts, [])
    assert readings == ["oi.pb"]
    assert handed == [6, 12, 18]  # spans handed to the writer after each record
    rollout_ids = _rollout_ids(sqlite_store)
    assert len(rollout_ids) == rollouts
    assert all(r.startswith("imp-s-" if kind == "sessions" else "imp-t-") for r in rollout_ids)
    assert all(len(_by_rollout(sqlite_store, r)) == 18 // rollouts for r in rollout_ids)


@pytest.mark.parametrize("memory", ["in memory", "read again"])
def test_a_rollout_id_in_a_later_file_outranks_the_session_of_its_trace(
    tmp_path, sqlite_store, monkeypatch, memory
):
    """A span of a trace names a session in the first file, another span of it a rollout id in the
    second: the trace is the rollout's, and its spans are stored in the order read, whether they waited
    for it in memory or, beyond the memory budget, were read again."""

    spans = _late_rollout("s-1", "ro-x", other=True)
    a = _write(tmp_path / "a.pb", proto_record([spans["first"], spans["other"]]))
    b = _write(tmp_path / "b.pb", proto_record([spans["second"], spans["root"]]))
    if memory == "read again":
        monkeypatch.setattr(_run, "_SPILL_MEMORY_BYTES", 1)
    readings = _counting_readings(monkeypatch)

    summary = import_traces([a, b], sqlite_store)

    assert (summary.spans, summary.rollouts, summary.problems) == (4, 2, [])
    assert readings == (["a.pb", "b.pb"] if memory == "in memory" else ["a.pb", "b.pb", "a.pb", "b.pb"])
    trace_id = format(spans["root"].context.trace_id, "032x")
    stored = sqlite_store.query_spans(trace_id=trace_id)
    assert [s.name for s in stored] == ["first", "second", "root"]
    assert {s.rollout_id for s in stored} == {"ro-x"}
    (other,) = _by_rollout(sqlite_store, session_rollout_id("s-1"))
    assert other.name == "other"
    (rollout,) = sqlite_store.get_rollouts([session_rollout_id("s-1")])
    assert rollout.metadata == {"source": "import", "file": str(a), semconv.SESSION_ID: "s-1"}


def test_a_file_written_while_it_is_imported(tmp_path, sqlite_store, monkeypatch):
    """A protobuf file is imported as it was when the import began: a record appended meanwhile waits
    for the next import; a record changed before its second reading is reported, nothing else lost."""
    path = _write(tmp_path / "live.pb", proto_record(_record(_agent_run("ro-1"))))
    late = proto_record(_record(_agent_run("ro-2")))

    def append(phase: str, *_: Any) -> None:
        with open(path, "ab") as f:
            f.write(late)

    first = import_traces([path], sqlite_store, progress=append)
    assert (first.spans, first.problems, _rollout_ids(sqlite_store)) == (3, [], ["ro-1"])
    again = import_traces([path], sqlite_store)
    assert (again.new_spans, again.problems, _rollout_ids(sqlite_store)) == (3, [], ["ro-1", "ro-2"])

    # a record still being written when the import began, completed while it runs: left for next time
    whole = proto_record(_record(_agent_run("ro-8")))
    growing = _write(tmp_path / "growing.pb", proto_record(_record(_agent_run("ro-7"))) + whole[:40])
    begun_with = growing.stat().st_size

    def complete(phase: str, *_: Any) -> None:
        if growing.stat().st_size == begun_with:
            with open(growing, "ab") as f:
                f.write(whole[40:])

    summary = import_traces([growing], sqlite_store, progress=complete)
    assert summary.problems == [
        f"{growing}: record 1 (byte {begun_with - 40}): the record ends at byte"
        f" {growing.stat().st_size}, past the {begun_with} bytes the file held when the import began (it is"
        " being written): import the file again for the rest"
    ]
    assert "ro-7" in _rollout_ids(sqlite_store) and "ro-8" not in _rollout_ids(sqlite_store)
    assert import_traces([growing], sqlite_store).new_spans == 3 and "ro-8" in _rollout_ids(sqlite_store)

    # a trace that waits (its session may yet be outranked by the rollout id the file holds), read again
    # after the file was rewritten under the import
    changing = _write(
        tmp_path / "changing.pb",
        proto_record(_record(_openinference_session("s-7"))) + proto_record(_record(_agent_run("ro-3"))),
    )
    monkeypatch.setattr(_run, "_SPILL_MEMORY_BYTES", 1)

    rewritten: list[str] = []

    def rewrite(phase: str, *_: Any) -> None:
        if not rewritten:  # the first reading holds the records already (they are read ahead)
            rewritten.append(phase)
            changing.write_bytes(proto_record(_record(_agent_run("ro-4"))) * 2)

    summary = import_traces([changing], sqlite_store, progress=rewrite)

    assert summary.exit_code == 1 and len(summary.problems) == 1
    assert summary.problems[0] == (
        f"{changing}: record 0 (byte 0): the file changed while it was imported, and 6 span(s) of this record"
        " were not written: import it again"
    )
    assert len(_by_rollout(sqlite_store, "ro-3")) == 3

    # emptied before its second reading: the record that waited is named by its number
    emptied = _write(
        tmp_path / "emptied.pb",
        proto_record(_record(_openinference_session("s-8"))) + proto_record(_record(_agent_run("ro-5"))),
    )
    summary = import_traces([emptied], sqlite_store, progress=lambda *_: emptied.write_bytes(b""))
    assert summary.problems == [
        f"{emptied}: record 0: the file changed while it was imported, and 6 span(s) of this record were"
        " not written: import it again"
    ]
    assert len(_by_rollout(sqlite_store, "ro-5")) == 3


def test_a_store_that_fails_to_write_stops_the_import_with_a_store_error(tmp_path, sqlite_store, monkeypatch):
    """Read once, the spans are written in the reading thread: a failing write is raised as the store's
    writer thread reports one, a retryable StoreUnavailableError, and what was committed before stays."""
    import sqlite3

    from agl_core.store import StoreUnavailableError

    path = _write(
        tmp_path / "t.pb",
        proto_record(_record(_agent_run("ro-1"))) + proto_record(_record(_agent_run("ro-2"))),
    )
    original = SqliteStore.add_span_rows
    calls: list[int] = []

    def failing(self: Any, rows: Any, scopes: Any) -> int:
        calls.append(len(rows))
        if len(calls) > 1:
            raise sqlite3.OperationalError("disk I/O error")
        return original(self, rows, scopes)

    monkeypatch.setattr(SqliteStore, "add_span_rows", failing)
    with pytest.raises(StoreUnavailableError, match="OperationalError: disk I/O error"):
        import_traces([path], sqlite_store)
    assert calls == [3, 3] and _rollout_ids(sqlite_store) == ["ro-1"]


def _writer_ready_at_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make an import that starts a writer process wait for it before its first write (a small import
    would otherwise be over before the process has opened the store); returns the sizes of the batches
    sent to it."""
    from agl_core.importer import _writer

    original_ready, original_send = _writer.WriterProcess.ready, _writer.WriterProcess.send
    sent: list[int] = []

    def ready(self: Any) -> bool:
        deadline = time.monotonic() + 60
        while not original_ready(self) and not self._ended and time.monotonic() < deadline:
            time.sleep(0.01)
        return original_ready(self)

    def send(self: Any, rows: Any, scopes: Any) -> None:
        sent.append(len(rows))
        original_send(self, rows, scopes)

    monkeypatch.setattr(_writer.WriterProcess, "ready", ready)
    monkeypatch.setattr(_writer.WriterProcess, "send", send)
    return sent


def _stored(store: SqliteStore) -> list[tuple[Any, ...]]:
    return [
        (s.rollout_id, s.trace_id, s.span_id, s.name, s.attributes) for s in store.query_spans(limit=1_000)
    ]


def test_a_writer_process_stores_what_the_reading_process_would(tmp_path, monkeypatch):
    """With workers, a large import read once sends its rows to a process that writes them, so decoding
    and SQLite's writes run on two cores: the store ends up the same as written by the reading process,
    the spans that waited for their rollout (here beyond the memory budget, read again) included."""

    spans = _late_rollout("s-late", "ro-late")
    records = [proto_record(_record(_openinference_session(f"s-{n}", traces=3))) for n in range(40)]
    records += [proto_record(_record(_agent_run(f"ro-{n}"))) for n in range(40)]
    records.insert(10, proto_record([spans["first"]]))
    records.append(proto_record([spans["second"], spans["root"]]))
    path = _write(tmp_path / "t.pb", b"".join(records))
    monkeypatch.setattr(_run, "_SPILL_MEMORY_BYTES", 1)

    here = SqliteStore(tmp_path / "here.sqlite")
    there = SqliteStore(tmp_path / "there.sqlite")
    try:
        expected = import_traces([path], here, parse_workers=0)
        sent = _writer_ready_at_once(monkeypatch)
        summary = import_traces([path], there, parse_workers=1)

        assert (summary.spans, summary.new_spans, summary.rollouts, summary.problems) == (
            expected.spans,
            expected.new_spans,
            expected.rollouts,
            [],
        )
        assert sum(sent) == summary.spans == 40 * 9 + 40 * 3 + 3  # every row through the process
        assert _stored(there) == _stored(here)
        assert [s.name for s in there.query_spans(rollout_ids=["ro-late"])] == ["first", "second", "root"]
        assert _rollout_ids(there) == _rollout_ids(here)
    finally:
        here.close()
        there.close()


def test_a_writer_process_that_dies_stops_the_import_with_a_store_error(tmp_path, sqlite_store, monkeypatch):
    """The writing process killed under the import (out of memory, say): the import stops with a
    retryable StoreUnavailableError naming it, what was committed stays, and importing again stores the
    rest."""
    from agl_core.importer import _writer
    from agl_core.store import StoreUnavailableError

    path = _write(
        tmp_path / "t.pb", b"".join(proto_record(_record(_agent_run(f"ro-{n}"))) for n in range(20))
    )
    sent = _writer_ready_at_once(monkeypatch)
    send = _writer.WriterProcess.send

    def send_then_die(self: Any, rows: Any, scopes: Any) -> None:
        send(self, rows, scopes)
        if len(sent) == 5:
            self._process.kill()
            self._process.join()

    monkeypatch.setattr(_writer.WriterProcess, "send", send_then_die)
    with pytest.raises(StoreUnavailableError, match=r"the import's writer process exited \(code -9\)"):
        import_traces([path], sqlite_store, parse_workers=1)
    assert len(sent) == 6  # the sixth batch found the process gone
    kept = _rollout_ids(sqlite_store)
    assert len(kept) <= 5 and all(len(_by_rollout(sqlite_store, r)) == 3 for r in kept)

    again = import_traces([path], sqlite_store, parse_workers=1)
    assert (again.spans, again.new_spans, again.problems) == (60, 60 - 3 * len(kept), [])
    assert len(_rollout_ids(sqlite_store)) == 20


def test_a_writer_process_that_cannot_start_leaves_the_writes_to_the_reading_process(
    tmp_path, sqlite_store, monkeypatch
):
    """A writing process that cannot open the store (here: refused its settings) is given up, and the
    import writes everything itself."""
    sent = _writer_ready_at_once(monkeypatch)
    monkeypatch.setattr(SqliteStore, "synchronous", property(lambda self: "SOMETIMES"))
    path = _write(tmp_path / "t.pb", b"".join(proto_record(_record(_agent_run(f"ro-{n}"))) for n in range(4)))
    summary = import_traces([path], sqlite_store, parse_workers=1)
    assert (summary.new_spans, summary.problems, sent) == (12, [], [])
    assert len(_rollout_ids(sqlite_store)) == 4


@pytest.mark.timing
def test_an_import_over_before_its_writer_process_opened_the_store_needs_it_not(tmp_path, sqlite_store):
    """A small import with workers ends before its writing process has opened the store (about 0.4 s):
    everything is written by the importing process, and the process is ended, not waited for."""
    path = _write(tmp_path / "t.pb", b"".join(proto_record(_record(_agent_run(f"ro-{n}"))) for n in range(3)))
    started = time.monotonic()
    summary = import_traces([path], sqlite_store, parse_workers=1)
    assert (summary.new_spans, summary.problems, len(_rollout_ids(sqlite_store))) == (9, [], 3)
    assert time.monotonic() - started < 30  # not the 30 s it would wait to join a process still starting


def _spawned_children(pid: int) -> list[int]:
    """The processes :mod:`multiprocessing` spawned for ``pid`` (not its resource tracker), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and b"spawn_main" in command:
            found.append(int(stat.parent.name))
    return found


def _large_protobuf_file(path: Path, records: int, spans: int) -> Path:
    """``records`` records of ``spans`` ~1 KB spans each (traces of 10, new ids in every record): over the
    size from which an import uses worker processes."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for n in range(spans):
        span = scope.spans.add(name="chat", start_time_unix_nano=1, end_time_unix_nano=2)
        span.span_id = (n + 1).to_bytes(8, "big")
        for i in range(12):
            span.attributes.add(key=f"app.field_{i}").value.string_value = "x" * 64
    with open(path, "wb") as f:
        for r in range(records):
            for n, span in enumerate(scope.spans):
                span.trace_id = (r * spans + n // 10 + 1).to_bytes(16, "big")
            body = request.SerializeToString()
            f.write(len(body).to_bytes(4, "big") + body)
    return path


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_agl_import_interrupted_says_what_stays_and_leaves_no_process(tmp_path):
    """Ctrl-C while a large import's writing process is busy: `agl import` says what stays and exits 130,
    without a traceback; its writing process is gone; the same command again imports the rest."""
    import signal

    path = _large_protobuf_file(tmp_path / "big.pb", records=40, spans=1_000)
    assert path.stat().st_size > _run._WORKERS_FROM_BYTES
    db = tmp_path / "s.sqlite"
    command = [sys.executable, "-m", "agl_core.cli", "import", str(path), "--store", str(db), "--quiet"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's Ctrl-C finds it
    )
    try:
        deadline = time.monotonic() + 60
        writers: list[int] = []
        while not writers and time.monotonic() < deadline and proc.poll() is None:
            writers = _spawned_children(proc.pid)
            time.sleep(0.005)
        assert writers, "the import started no writing process"
        os.kill(writers[0], signal.SIGSTOP)  # holds the import in its send: interrupted mid-import for sure
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        os.kill(writers[0], signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "agl import: interrupted. What was written before stays" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in writers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in writers)

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    with _open(db) as store:
        assert store.stats()["spans"] == 40_000


# --- what goes wrong --------------------------------------------------------------------------------------
def test_a_malformed_line_is_named_and_skipped(tmp_path, sqlite_store, capsys):
    good = json_line(_record(_agent_run("ro-ok")))
    bad = b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}\n'
    path = _write(tmp_path / "mixed.jsonl", good + b"not json at all\n" + bad + b"\n" + good)
    db = tmp_path / "s.sqlite"

    assert main(["import", str(path), "--store", str(db)]) == 1

    out, err = capsys.readouterr()
    assert f"{path}: line 2: body is not valid JSON" in err
    assert f"{path}: line 3: " in err and "traceId is not hex" in err
    assert "skipped: 2 line(s)/record(s)" in out and "imported 6 spans (3 new, 3 already stored)" in out
    with _open(db) as store:
        assert len(_by_rollout(store, "ro-ok")) == 3


def test_a_truncated_protobuf_file_keeps_its_whole_records(tmp_path, capsys):
    first, second = proto_record(_record(_agent_run("ro-1"))), proto_record(_record(_agent_run("ro-2")))
    path = _write(tmp_path / "cut.pb", first + second[: len(second) // 2])
    db = tmp_path / "s.sqlite"

    assert main(["import", str(path), "--store", str(db), "--format", "otlp-proto"]) == 1

    err = capsys.readouterr().err
    assert f"{path}: record 1 (byte {len(first)}): the file is truncated" in err
    with _open(db) as store:
        assert _rollout_ids(store) == ["ro-1"]


def test_problems_of_json_and_protobuf_files_come_once_in_the_files_order(tmp_path, capsys):
    # Protobuf files are read twice (scanned for grouping, then decoded while the writer commits) and
    # JSON files once: each problem is still reported once, in the order the files were given.
    garbage = b"\xff\xff\xff"  # a record whose body is no protobuf message
    pb_first = _write(
        tmp_path / "a.pb",
        proto_record(_record(_agent_run("ro-a"))) + len(garbage).to_bytes(4, "big") + garbage,
    )
    js = _write(tmp_path / "b.jsonl", json_line(_record(_agent_run("ro-b"))) + b"not json\n")
    pb_last = _write(tmp_path / "c.pb", proto_record(_record(_agent_run("ro-c"))) + b"\x00\x00")
    db = tmp_path / "s.sqlite"

    assert main(["import", str(pb_first), str(js), str(pb_last), "--store", str(db)]) == 1

    prefix = "agl import: skipped "
    problems = [
        line[len(prefix) :] for line in capsys.readouterr().err.splitlines() if line.startswith(prefix)
    ]
    assert [line.split(": ")[0] for line in problems] == [str(pb_first), str(js), str(pb_last)], problems
    assert "record 1 (byte " in problems[0] and "line 2" in problems[1] and "length prefix" in problems[2]
    with _open(db) as store:
        assert _rollout_ids(store) == ["ro-a", "ro-b", "ro-c"]
        assert all(len(_by_rollout(store, r)) == 3 for r in ("ro-a", "ro-b", "ro-c"))


def test_truncated_gzip_is_reported(tmp_path, capsys):
    data = gzip.compress(json_line(_record(_agent_run("ro-1"))) * 50)
    path = _write(tmp_path / "cut.jsonl.gz", data[: len(data) - 20])
    assert main(["import", str(path), "--store", str(tmp_path / "s.sqlite")]) == 1
    assert "the gzip data is truncated or corrupt" in capsys.readouterr().err


def test_truncated_zstd_is_reported_and_a_missing_zstandard_named(tmp_path, capsys, monkeypatch):
    import zstandard

    data = zstandard.ZstdCompressor().compress(json_line(_record(_agent_run("ro-1"))) * 50)
    path = _write(tmp_path / "cut.jsonl.zst", data[: len(data) - 20])
    assert main(["import", str(path), "--store", str(tmp_path / "s.sqlite")]) == 1
    assert "the zstd data is truncated or corrupt" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as without the package
    whole = _write(tmp_path / "whole.jsonl.zst", data)
    assert main(["import", str(whole), "--store", str(tmp_path / "t.sqlite")]) == 1
    assert "pip install 'agl[zstd]'" in capsys.readouterr().err


def test_bad_arguments_stop_before_anything_is_written(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl", json_line(_record(_agent_run("ro-1"))))
    db = tmp_path / "s.sqlite"
    assert main(["import", str(path), str(tmp_path / "missing.jsonl"), "--store", str(db)]) == 2
    assert f"no such file: {tmp_path / 'missing.jsonl'}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["import", str(path), "--format", "csv", "--store", str(db)])
    assert exited.value.code == 2 and "invalid choice: 'csv'" in capsys.readouterr().err
    assert main(["import", str(path), "--store", str(db), "--redact", "nonsense"]) == 2
    assert not db.exists()


# --- redaction, a running store, agl inspect ---------------------------------------------------------------
def test_redaction_rules_apply_to_imported_spans(tmp_path, sqlite_store):
    path = _write(tmp_path / "oi.jsonl", json_line(_record(_openinference_session("s-1"))))
    import_traces([path], sqlite_store, redactor=parse_rules(["email", f"key:{semconv.LLM_MODEL_NAME}"]))
    llm = [s for s in sqlite_store.query_spans() if s.name == "ChatCompletion"]
    assert [s.attributes["user.email"] for s in llm] == ["[REDACTED]"] * 2
    assert not any(semconv.LLM_MODEL_NAME in s.attributes for s in llm)


def test_redacting_the_session_key_keeps_the_grouping(tmp_path, sqlite_store):
    """The grouping is learnt from the spans as read, before redaction drops or masks their keys."""
    path = _write(tmp_path / "oi.pb", proto_record(_record(_openinference_session("s-1"))))
    summary = import_traces([path], sqlite_store, redactor=parse_rules([f"key:{semconv.SESSION_ID}"]))
    assert (summary.spans, summary.rollouts, summary.problems) == (6, 1, [])
    spans = _by_rollout(sqlite_store, session_rollout_id("s-1"))
    assert len(spans) == 6 and not any(semconv.SESSION_ID in s.attributes for s in spans)
    (rollout,) = sqlite_store.get_rollouts([session_rollout_id("s-1")])
    assert rollout.metadata == {"source": "import", "file": str(path)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served_store(tmp_path) -> Iterator[tuple[str, Path]]:
    """``agl store serve`` as its own process, with a token and a redaction rule; (url, its db)."""
    port, db = _free_port(), tmp_path / "served.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(db), "--http-port", str(port)]
        + ["--no-grpc", "--token", "s3cret", "--redact", "email", "--parse-workers", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/healthz", proc)
        yield url, db
    finally:
        proc.terminate()
        proc.wait(30)


def test_import_into_a_running_store_with_a_token(tmp_path, served_store, capsys, monkeypatch):
    url, _ = served_store
    oi = _record(_openinference_session("s-9"))
    path = _write(tmp_path / "t.pb.gz", proto_record(oi) + proto_record(_record(_agent_run("ro-r"))), gz=True)
    monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
    assert main(["import", str(path), "--store", url]) == 2
    assert "HTTP 401" in capsys.readouterr().err

    monkeypatch.setenv("AGL_STORE_TOKEN", "s3cret")
    assert main(["import", str(path), "--store", url]) == 0
    assert "imported 9 spans (9 new, 0 already stored) in 2 rollout(s)" in capsys.readouterr().out
    assert main(["import", str(path), "--store", url, "-q"]) == 0
    assert "(0 new, 9 already stored)" in capsys.readouterr().out

    from agl_core.store import StoreClient

    with StoreClient(url, token="s3cret") as client:
        (rollout_id,) = [r for r in _client_rollouts(client, oi) if r.startswith("imp-s-")]
        spans = client.all_spans([rollout_id])
        assert len(spans) == 6
        assert {s.attributes.get("user.email") for s in spans} == {None, "[REDACTED]"}
        (rollout,) = client.get_rollouts([rollout_id])
        assert rollout.metadata == {"source": "import", "file": str(path), semconv.SESSION_ID: "s-9"}
        assert client.get_rollouts(["ro-r"])[0].status is RolloutStatus.SUCCEEDED


def _client_rollouts(client: Any, spans: list[ReadableSpan]) -> set[str]:
    trace_id = format(spans[0].context.trace_id, "032x")
    return {s.rollout_id for s in client.query_spans(trace_id=trace_id) if s.rollout_id}


def test_import_through_the_testing_collector(tmp_path):
    path = _write(tmp_path / "t.jsonl", json_line(_record(_agent_run("ro-c"))))
    with Collector(token="tok") as collector:
        summary = import_traces([path], collector.url, token="tok")
        assert summary.new_spans == 3 and summary.rollouts == 1
        assert len(collector.client.all_spans(["ro-c"])) == 3


def test_inspect_shows_an_imported_rollout_and_why_it_does_not_train(tmp_path, capsys):
    path = _write(tmp_path / "oi.jsonl", json_line(_record(_openinference_session("s-1"))))
    db = tmp_path / "s.sqlite"
    assert main(["import", str(path), "--store", str(db), "--quiet"]) == 0
    with _open(db) as store:
        (rollout_id,) = _rollout_ids(store)
    capsys.readouterr()

    assert main(["inspect", rollout_id, "--store", str(db)]) == 0

    report = capsys.readouterr().out
    assert f"rollout {rollout_id}: 6 spans" in report
    assert report.count("ChatCompletion") >= 2 and "search" in report
    # LLM calls recorded without token ids (no gateway span) make no transition, and the report says why
    assert report.count(f"no transition: {COUNT_MISMATCH}") == 2
    assert f"rollout: {NO_LLM_CALL}" in report


# --- the store's record of observed rollouts --------------------------------------------------------------
def test_observed_rollouts_are_recorded_once(store, tmp_path):
    request = {"rollout_id": "ro-x", "task_id": "t", "metadata": {"source": "import"}}
    (first,) = store.add_observed_rollouts([request])
    (again,) = store.add_observed_rollouts([{**request, "metadata": {"other": 1}}])
    assert first == again and first.status is RolloutStatus.SUCCEEDED
    assert store.stats()["rollouts"] == 1
    with Collector(store) as collector:
        (seen,) = collector.client.add_observed_rollouts(
            [
                request,
            ]
        )
        assert seen.metadata == {"source": "import"}
        response = httpx.post(collector.url + "/api/rollouts/observed", json={"rollouts": [{"task_id": "t"}]})
        assert response.status_code == 400 and "rollout_id" in response.text


def test_progress_goes_to_a_terminal_only(tmp_path):
    path = _write(tmp_path / "t.jsonl", json_line(_record(_agent_run("ro-1"))))
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "import", str(path), "--store", str(tmp_path / "s.sqlite")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=60,
    )
    assert done.returncode == 0 and done.stderr == ""


# --- decompression and size bombs (hardening, round three) -----------------------------------------------
def _child_peak_rss_mib(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``agl`` with ``argv`` in a child process of its own: its result and its peak RSS in MiB."""
    script = (
        "import resource, subprocess, sys;"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
        "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr);"
        "sys.exit(r.returncode)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, sys.executable, "-m", "agl_core.cli", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    *_, peak = done.stderr.strip().splitlines()
    return done, int(peak) / 1024


def _gzip_stream(path: Path, parts: Iterator[bytes]) -> Path:
    with gzip.open(path, "wb", compresslevel=1) as f:
        for part in parts:
            f.write(part)
    return path


def test_a_gzipped_line_of_300_mb_is_skipped_in_bounded_memory(tmp_path):
    """A small .gz holding one 300 MB JSON line between two good ones (it once cost 3x its size in
    memory): the line is reported and skipped, never held, the good lines are imported."""
    good_a, good_b = json_line(_record(_agent_run("ro-a"))), json_line(_record(_agent_run("ro-b")))
    chunk = b"x" * (1 << 20)
    path = _gzip_stream(
        tmp_path / "bomb.jsonl.gz",
        iter([good_a, b'{"resourceSpans": [], "pad": "', *([chunk] * 300), b'"}\n', good_b]),
    )
    assert path.stat().st_size < 2 * 1024 * 1024
    done, peak = _child_peak_rss_mib(["import", str(path), "--store", str(tmp_path / "s.sqlite")])
    assert done.returncode == 1, done.stderr
    assert f"{path}: line 2: longer than {MAX_RECORD_BYTES} bytes" in done.stderr
    assert "imported 6 spans" in done.stdout
    assert peak < 600, f"peak RSS {peak:.0f} MiB"
    with _open(tmp_path / "s.sqlite") as store:
        assert _rollout_ids(store) == ["ro-a", "ro-b"]


def test_a_zstd_message_decompressing_past_the_bound_is_skipped(tmp_path):
    import zstandard

    # one protobuf message (field 1, a 100 MB resourceSpans) in a few KB of zstd
    size = 100 * 1024 * 1024
    head = b"\x0a" + _varint(size)
    compressor = zstandard.ZstdCompressor(level=3)
    path = tmp_path / "bomb.pb.zst"
    with path.open("wb") as f, compressor.stream_writer(f) as writer:
        writer.write(head)
        for _ in range(100):
            writer.write(b"\x00" * (1 << 20))
    done, peak = _child_peak_rss_mib(["import", str(path), "--store", str(tmp_path / "s.sqlite")])
    assert done.returncode == 1, done.stderr
    assert f"decompresses to one protobuf message of more than {MAX_RECORD_BYTES} bytes" in done.stderr
    assert peak < 600, f"peak RSS {peak:.0f} MiB"


def test_a_zstd_file_of_zeros_stops_at_the_first_empty_length_prefix(tmp_path, capsys):
    """8 KB of zstd holding 256 MB of zeros once ran for minutes as 64 million empty records."""
    import zstandard

    path = tmp_path / "zeros.pb.zst"
    with path.open("wb") as f, zstandard.ZstdCompressor().stream_writer(f) as writer:
        for _ in range(256):
            writer.write(b"\x00" * (1 << 20))
    assert path.stat().st_size < 64 * 1024
    assert main(["import", str(path), "--store", str(tmp_path / "s.sqlite")]) == 1
    assert "record 0 (byte 0): a length prefix of 0 bytes" in capsys.readouterr().err


def test_a_zstd_bomb_is_read_within_bounded_memory(tmp_path):
    """32 KB of zstd holding 1 GiB of zeros once took 2.1 GB resident (the whole 1 MiB of input it read
    was decompressed at once); it is now fed in pieces, like gzip."""
    import zstandard

    path = tmp_path / "bomb.zst"
    with path.open("wb") as f, zstandard.ZstdCompressor(level=19).stream_writer(f) as writer:
        for _ in range(1024):
            writer.write(b"\x00" * (1 << 20))
    assert path.stat().st_size < 64 * 1024
    done, peak = _child_peak_rss_mib(["import", str(path), "--store", str(tmp_path / "s.sqlite")])
    assert done.returncode == 1 and "a length prefix of 0 bytes" in done.stderr, done.stderr
    assert peak < 400, f"peak RSS {peak:.0f} MiB"


def test_a_truncated_gzip_with_no_whole_record_reports_the_cut_and_exits_1(
    tmp_path, served_store, capsys, monkeypatch
):
    """Into a running store: nothing whole before the cut, so no rollout to record; exit 1 naming the
    truncation (it was exit 2 with the store's 400 for an empty list of rollouts)."""
    url, _ = served_store
    monkeypatch.setenv("AGL_STORE_TOKEN", "s3cret")
    data = gzip.compress(json_line(_record(_agent_run("ro-1"))))
    path = _write(tmp_path / "cut.jsonl.gz", data[: len(data) // 2])
    assert main(["import", str(path), "--store", url]) == 1
    err = capsys.readouterr().err
    assert "the gzip data is truncated or corrupt" in err and "HTTP 400" not in err


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# --- importing again after a cut file ------------------------------------------------------------------
def _session_parent_and_plain_trace(provider: Any) -> None:
    """Trace 1: ``agent`` names session ``s-cut``, its child ``step`` names nothing (finished first);
    trace 2: ``alone``, no session."""
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("agent", attributes={semconv.SESSION_ID: "s-cut"}):
        with tracer.start_as_current_span("step"):
            pass
    with tracer.start_as_current_span("alone"):
        pass


def _cut_and_whole(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """The same three records (``step`` | ``agent`` | ``alone``), whole and cut inside ``agent``'s line."""
    spans = {s.name: s for s in _record(_session_parent_and_plain_trace)}
    lines = [json_line([spans[name]]) for name in ("step", "agent", "alone")]
    whole = _write(tmp_path / "whole.jsonl", b"".join(lines))
    cut = _write(tmp_path / "cut.jsonl", lines[0] + lines[1][: len(lines[1]) // 2])
    return cut, whole, {name: format(s.context.trace_id, "032x") for name, s in spans.items()}


def _assert_one_rollout_per_trace(store: Any, traces: dict[str, str]) -> None:
    grouped = store.query_spans(trace_id=traces["agent"])
    assert sorted(s.name for s in grouped) == ["agent", "step"]
    assert {s.rollout_id for s in grouped} == {session_rollout_id("s-cut")}
    assert {s.attributes[semconv.ROLLOUT_ID] for s in grouped} == {session_rollout_id("s-cut")}
    with pytest.raises(NotFoundError):  # the emptied rollout is gone
        store.get_rollouts([f"imp-t-{traces['agent']}"])
    (alone,) = store.query_spans(trace_id=traces["alone"])
    assert alone.rollout_id == alone.attributes[semconv.ROLLOUT_ID] == f"imp-t-{traces['alone']}"
    assert {r.rollout_id for r in store.list_rollouts(limit=50).rollouts} == {
        session_rollout_id("s-cut"),
        f"imp-t-{traces['alone']}",
    }


def test_importing_the_whole_file_after_a_cut_one_moves_the_trace_into_one_rollout(tmp_path, store):
    cut, whole, traces = _cut_and_whole(tmp_path)
    first = import_traces([cut], store)
    assert first.exit_code == 1 and first.spans == 1  # the cut line skipped and named
    (early,) = store.query_spans(trace_id=traces["agent"])
    assert early.rollout_id == f"imp-t-{traces['agent']}"  # its session was on the line cut off

    again = import_traces([whole], store)

    assert (again.exit_code, again.new_spans, again.merged_spans) == (0, 2, 1)
    _assert_one_rollout_per_trace(store, traces)
    assert import_traces([whole], store).merged_spans == 0  # and once moved, nothing moves again


def test_importing_the_whole_file_again_into_a_running_store_moves_the_trace(
    tmp_path, served_store, capsys, monkeypatch
):
    url, db = served_store
    cut, whole, traces = _cut_and_whole(tmp_path)
    monkeypatch.setenv("AGL_STORE_TOKEN", "s3cret")
    assert main(["import", str(cut), "--store", url, "-q"]) == 1
    assert main(["import", str(whole), "--store", url, "-q"]) == 0
    out = capsys.readouterr().out
    assert "1 span(s) of earlier imports moved into their trace's rollout" in out
    with _open(db) as stored:
        _assert_one_rollout_per_trace(stored, traces)


def test_merging_refuses_rollouts_that_ran_under_the_queue_and_bad_ids(store):
    (queued,) = store.enqueue_rollouts([{"task_id": "t", "rollout_id": "queued-1"}])
    store.dequeue_rollout("w")
    store.add_observed_rollouts([{"rollout_id": "obs-1"}, {"rollout_id": "obs-2"}])
    with pytest.raises(StoreError, match="'queued-1' ran under the queue"):
        store.merge_rollouts({"obs-1": "obs-2", "queued-1": "obs-2"})
    assert len(store.get_rollouts(["obs-1", "obs-2", "queued-1"])) == 3  # nothing changed
    for bad, why in (({"": "x"}, "non-empty"), ({"a": "b", "b": "c"}, "both merged")):
        with pytest.raises(StoreError, match=why):
            store.merge_rollouts(bad)
    assert store.merge_rollouts({"obs-1": "obs-1", "no-such": "obs-2"}) == 0  # nothing to move


def test_the_merge_endpoint_validates_its_body(store_server):
    for body, status in (
        ({"moves": {}}, 400),
        ({"moves": {"a": "x" * 257}}, 400),
        ({"moves": {"a": "b"}, "extra": 1}, 400),
        ({"moves": {"a": "b"}}, 200),
    ):
        response = httpx.post(store_server.url + "/api/rollouts/merge", json=body)
        assert response.status_code == status, (body, response.text)
    assert response.json() == {"moved": 0}
