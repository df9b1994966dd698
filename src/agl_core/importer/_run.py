"""Importing trace files into a store: the reading, the writes, the rollout records, the summary.

A span's rollout can depend on spans read after it (a session named on a later span of its trace), so
nothing is written before every file has been read. Into a store written directly, each record is
decoded by the store's own ingest: the first phase reads the files and learns the grouping (a JSON
record is parsed there, in worker processes for large imports, and its rows kept in a temporary spill, in
memory up to 64 MiB and on disk beyond; a protobuf record is only scanned); the second gives each row
without a rollout id its rollout and hands the rows to the store's writer (the spilled rows read back, the
protobuf files read again and decoded). Into a running store, a
first reading of the files learns the grouping from the records, and a second sends them over OTLP/HTTP.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .. import semconv, settings
from ..store import Store, StoreClient, StoreError, StoreUnavailableError, open_store
from ..store._ingest import IngestPipeline, Overloaded
from ..store._otlp import (
    MAX_SPANS_PER_REQUEST,
    OtlpDecodeError,
    ParsedBatch,
    SpanRow,
    decode_json,
    decode_protobuf,
)
from ..store.redact import Redactor
from ._files import BadRecord, Record, TraceFile, split_request
from ._grouping import Grouping

__all__ = ["ImportSummary", "Progress", "import_traces"]

#: ``progress(phase, file, bytes_done, bytes_total, spans)``: ``phase`` is ``"scan"`` (reading the files
#: for grouping, and into a store written directly parsing them; bytes over all files, as stored, that is
#: compressed) or ``"import"`` (writing: into a store written directly, bytes over the spill of parsed
#: spans, ``file`` the one a batch came from; into a running store, bytes over the files again).
Progress = Callable[[str, str, int, int, int], None]
#: Parse in worker processes when the files hold more than this many bytes together.
_WORKERS_FROM_BYTES = 32 * 1024 * 1024
#: Parsed spans waiting for the second phase stay in memory up to this many bytes, then go to disk.
_SPILL_MEMORY_BYTES = 64 * 1024 * 1024
#: Spans per OTLP/HTTP request sent to a running store.
_HTTP_BATCH_SPANS = 5_000
_SOURCE = "import"
#: Spans per transaction of an import. The writer commits what is queued, and an import queues its whole
#: backlog at once: transactions of 20,000 spans (the store's limit) outgrow SQLite's page cache and pass
#: the WAL size at which the checkpointer holds writes off within one transaction; at 1,024 the
#: checkpointer copies each commit while the next is written (60k-span protobuf file: 48k -> 52k spans/s,
#: medians of 5 alternating runs).
_COMMIT_SPANS = 1_024


@dataclasses.dataclass
class ImportSummary:
    """What an import did. ``problems`` holds one ``FILE: WHERE: WHY`` line per skipped line or record
    and per record of which the store refused some spans."""

    files: int = 0
    records: int = 0
    #: spans read from the files and accepted by the store (new or already stored)
    spans: int = 0
    #: spans the store did not hold before (its span count before and after)
    new_spans: int = 0
    #: spans the store's checks refused (invalid ids or times), counted in ``problems`` too
    refused_spans: int = 0
    rollouts: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 when every line and span was imported, 1 when any was skipped (the rest was imported)."""
        return 1 if self.problems else 0


class _Rollouts:
    """The rollouts the imported spans belong to, with their metadata (from the first file seen in)."""

    def __init__(self) -> None:
        self.metadata: dict[str, dict[str, Any]] = {}

    def note(self, rollout_id: str, file: str, grouped_by: dict[str, Any]) -> None:
        if rollout_id not in self.metadata:
            self.metadata[rollout_id] = {"source": _SOURCE, "file": file, **grouped_by}

    def requests(self) -> list[dict[str, Any]]:
        return [{"rollout_id": rid, "task_id": rid, "metadata": meta} for rid, meta in self.metadata.items()]


def import_traces(
    paths: Sequence[str | Path],
    store: Store | str,
    *,
    fmt: str = "auto",
    token: str | None = None,
    redactor: Redactor | None = None,
    progress: Progress | None = None,
    parse_workers: int | None = None,
) -> ImportSummary:
    """Import the OTLP trace files ``paths`` into ``store``: a :class:`Store` (written directly), a
    running store's URL (spans over OTLP/HTTP with ``token``, rollouts through its API), or a SQLite
    file / ``postgresql://`` DSN opened here.

    ``redactor`` applies to a store written directly (a running store applies its own rules). Raises
    :class:`StoreError` when the store cannot be reached or written; what was committed before stays,
    and importing again is safe. ``parse_workers``: processes decoding the records of a store written
    directly (default: one per CPU, at most 4, for files over 32 MB together; 0 decodes here); protobuf
    records are decoded here unless ``redactor`` is given.
    """
    files = [TraceFile(Path(p), fmt) for p in paths]
    total = sum(f.size for f in files)
    summary = ImportSummary(files=len(files))
    grouping = Grouping()
    rollouts = _Rollouts()
    remote = isinstance(store, str) and store.startswith(("http://", "https://"))
    if remote:
        if redactor:
            raise StoreError("a running store applies its own --redact rules; --redact is for a store file")
        assert isinstance(store, str)
        done = 0
        for f in files:  # first reading: which traces share a rollout
            for record in f.records():
                if isinstance(record, Record):
                    grouping.scan(record)
                    if progress is not None:
                        progress("scan", str(f.path), done + f.position, total, 0)
            done += f.size
        with _Remote(store, token, grouping, rollouts, summary) as sink:
            before = sink.client.stats()["spans"]
            _write_all(files, total, sink, summary, progress)
            sink.client.add_observed_rollouts(rollouts.requests())
            summary.new_spans = sink.client.stats()["spans"] - before
    else:
        target = open_store(store) if isinstance(store, str) else store
        try:
            workers = parse_workers
            if workers is None:
                workers = min(os.cpu_count() or 1, 4) if total > _WORKERS_FROM_BYTES else 0
            before = target.stats()["spans"]
            embedded = _Embedded(target, redactor, workers, grouping, rollouts, summary)
            try:
                embedded.read_all(files, total, progress)
                embedded.write_all(progress)
            finally:
                embedded.close()
            requests = rollouts.requests()
            if redactor:
                for request in requests:
                    request["metadata"] = redactor.redact_json(request["metadata"])
            for start in range(0, len(requests), 10_000):
                target.add_observed_rollouts(requests[start : start + 10_000])
            summary.new_spans = target.stats()["spans"] - before
        finally:
            if isinstance(store, str):
                target.close()
    summary.rollouts = len(rollouts.metadata)
    return summary


def _write_all(
    files: list[TraceFile], total: int, sink: _Remote, summary: ImportSummary, progress: Progress | None
) -> None:
    done = 0
    for f in files:
        name = str(f.path)
        for record in f.records():
            if isinstance(record, BadRecord):
                summary.problems.append(f"{name}: {record.where}: {record.problem}")
                continue
            summary.records += 1
            sink.add(record, name)
            if progress is not None:
                progress("import", name, done + f.position, total, summary.spans)
        done += f.size
    sink.flush()


class _Embedded:
    """Spans through the store's own ingest pipeline (decoding, validation, redaction, group commit), in
    two phases: :meth:`read_all` learns the grouping, :meth:`write_all` gives each row its rollout and
    writes it.

    A JSON record costs ten times more to decode than a protobuf one, so it is decoded once: in phase 1
    (in worker processes for large imports), its rows spilled and read back in phase 2. A protobuf file
    is read twice instead: phase 1 only scans its records for grouping keys, and phase 2 decodes each
    record again, here, and hands its rows to the store's writer thread. Pickling the decoded rows to a
    spill and reading them back cost more than the scan; decoding in worker processes costs about as
    much as it saves (unpickling their rows, and two more processes on the cores the writer needs); and
    the writer thread's SQLite inserts hold Python's lock for most of their time, so decoding and writing
    in one process add up rather than overlap. With a redactor every record goes the JSON way: its
    redacted rows are what is written."""

    def __init__(
        self,
        store: Store,
        redactor: Redactor | None,
        workers: int,
        grouping: Grouping,
        rollouts: _Rollouts,
        summary: ImportSummary,
    ) -> None:
        self.grouping, self.rollouts, self.summary = grouping, rollouts, summary
        self.pipeline = IngestPipeline(
            store, redactor=redactor, parse_workers=workers, max_commit_spans=_COMMIT_SPANS
        )
        # A redactor may drop or mask the very attributes that group spans (a session id that looks like
        # an e-mail address, say), and the parsed rows are redacted: then the grouping is learnt from the
        # records as read, as it was before redaction.
        self.redacting = bool(redactor)
        self.in_flight = 2 * workers + 2
        # in file order: a record being parsed (future, record, file index, file, where), or a part of a
        # file that could not be read as a record (None, None, file index, file, problem)
        self.parsing: collections.deque[tuple[Future[ParsedBatch] | None, Record | None, int, str, str]] = (
            collections.deque()
        )
        self.writing: collections.deque[Future[int]] = collections.deque()
        self.spill = tempfile.SpooledTemporaryFile(max_size=_SPILL_MEMORY_BYTES)
        #: (file index, problem): put in the files' order at the end, whichever phase found them
        self.problems: list[tuple[int, str]] = []
        self.files: list[TraceFile] = []
        #: indexes of the protobuf files that phase 2 reads again
        self.reread: set[int] = set()
        # trace id -> (rollout id, what it was grouped by, the attribute naming it), once per trace
        self.assigned: dict[bytes, tuple[str, dict[str, Any], bytes]] = {}

    def _second_reading(self, f: TraceFile) -> bool:
        return not self.redacting and f.detected.startswith("otlp-proto")

    # --- phase 1: learn the grouping; decode and spill the JSON records -----------------------------
    def read_all(self, files: list[TraceFile], total: int, progress: Progress | None) -> None:
        self.files = files
        done = 0
        for index, f in enumerate(files):
            name = str(f.path)
            for record in f.records():
                if self._second_reading(f):  # its problems are reported when it is read again
                    if isinstance(record, Record):
                        self.summary.records += 1
                        self.grouping.scan(record)
                elif isinstance(record, BadRecord):
                    self.parsing.append(
                        (None, None, index, name, f"{name}: {record.where}: {record.problem}")
                    )
                    continue
                else:
                    self.summary.records += 1
                    self._parse(record, index, name)
                if progress is not None:
                    progress("scan", name, done + f.position, total, 0)
            if self._second_reading(f):
                self.reread.add(index)
            done += f.size
        while self.parsing:
            self._finish_parse()

    def _parse(self, record: Record, index: int, file: str) -> None:
        while True:
            try:
                future = self.pipeline.parse_async(record.body, json_body=record.json)
                break
            except Overloaded:  # the decode budget is full: wait for the oldest parse
                if self.parsing:
                    self._finish_parse()
                else:
                    time.sleep(0.01)
        self.parsing.append((future, record, index, file, record.where))
        while self.parsing and (
            len(self.parsing) > self.in_flight or self.parsing[0][0] is None or self.parsing[0][0].done()
        ):
            self._finish_parse()

    def _finish_parse(self) -> None:
        grouping = self.grouping
        future, record, index, file, where = self.parsing.popleft()
        if future is None or record is None:
            self.problems.append((index, where))
            return
        try:
            batch = future.result()
        except OtlpDecodeError as exc:
            self.problems.append((index, f"{file}: {where}: {exc}"))
            grouping.scan(record)  # what can be read of it still groups the others, as it always did
            return
        self._note_refused(batch, index, file, where)
        if self.redacting or batch.rejected:
            grouping.scan(record)  # refused spans are not in the rows, but their attributes group
        else:
            grouping.learn(batch.rows)
        if batch.rows:
            pickle.dump(
                (index, batch.rows, batch.scopes, batch.rejected, batch.error_message),
                self.spill,
                pickle.HIGHEST_PROTOCOL,
            )

    def _note_refused(self, batch: ParsedBatch, index: int, file: str, where: str) -> None:
        problem = _refused(batch.rejected, batch.error_message, file, where, self.summary)
        if problem:
            self.problems.append((index, problem))

    # --- phase 2: rollouts, writes ---------------------------------------------------------------------
    def write_all(self, progress: Progress | None) -> None:
        spill = self.spill
        spilled = spill.tell()
        total = spilled + sum(self.files[i].size for i in self.reread)
        spill.seek(0)
        done = 0  # bytes of the files read again, before the current one
        pending = pickle.load(spill) if spilled else None
        for index, f in enumerate(self.files):
            name = str(f.path)
            if index in self.reread:
                for record in f.records():
                    if isinstance(record, BadRecord):
                        self.problems.append((index, f"{name}: {record.where}: {record.problem}"))
                        continue
                    try:
                        # decoded here: a worker process would save the decoding, but taking its rows
                        # back (unpickling them) costs this process about as much
                        batch = self.pipeline.parse(record.body)
                    except OtlpDecodeError as exc:
                        self.problems.append((index, f"{name}: {record.where}: {exc}"))
                        continue
                    self._note_refused(batch, index, name, record.where)
                    self._write(batch, name)
                    if progress is not None:
                        progress("import", name, spill.tell() + done + f.position, total, self.summary.spans)
                done += f.size
                continue
            while pending is not None and pending[0] == index:
                _, rows, scopes, rejected, error_message = pending
                self._write(ParsedBatch(rows, scopes, rejected, error_message), name)
                pending = pickle.load(spill) if spill.tell() < spilled else None
                if progress is not None:
                    progress("import", name, spill.tell() + done, total, self.summary.spans)
        while self.writing:
            self.writing.popleft().result()
        self.summary.problems.extend(problem for _, problem in sorted(self.problems, key=lambda p: p[0]))

    def _write(self, batch: ParsedBatch, file: str) -> None:
        """Give each row without a rollout id its rollout, and hand the batch to the store's writer."""
        grouping, rollouts, assigned = self.grouping, self.rollouts, self.assigned
        rows: list[SpanRow] = []
        for row in batch.rows:
            rollout_id = row[7]
            if rollout_id is None:
                trace_id = row[0]
                known = assigned.get(trace_id)
                if known is None:
                    rollout_id, grouped_by = grouping.rollout_of(trace_id)
                    known = assigned[trace_id] = (
                        rollout_id,
                        grouped_by,
                        grouping.attribute_bytes(rollout_id),
                    )
                rollout_id, grouped_by, attribute = known
                row = (*row[:7], rollout_id, row[8], row[9], row[10] + attribute)
            else:
                grouped_by = {}
            rollouts.note(rollout_id, file, grouped_by)
            rows.append(row)
        if not rows:
            return
        self.summary.spans += len(rows)
        batch = ParsedBatch(rows, batch.scopes, batch.rejected, batch.error_message)
        while True:
            try:
                self.writing.append(self.pipeline.submit(batch))
                break
            except Overloaded:
                self._wait_write()
        while self.writing and self.writing[0].done():
            self.writing.popleft().result()  # raises what the write raised

    def _wait_write(self) -> None:
        if self.writing:
            self.writing.popleft().result()
        else:
            time.sleep(0.01)

    def close(self) -> None:
        try:
            self.pipeline.close()
        finally:
            self.spill.close()


def _refused(count: int, reason: str, file: str, where: str, summary: ImportSummary) -> str | None:
    """Count ``count`` spans the store refused; the problem line to report, or None when there were none."""
    if not count:
        return None
    summary.refused_spans += count
    return f"{file}: {where}: the store refused {count} span(s): {reason}"


class _Remote:
    """Spans over OTLP/HTTP protobuf to a running store (which validates and redacts them as any
    sender's), rollouts through its API."""

    def __init__(
        self, url: str, token: str | None, grouping: Grouping, rollouts: _Rollouts, summary: ImportSummary
    ) -> None:
        import httpx

        self.grouping, self.rollouts, self.summary = grouping, rollouts, summary
        self.client = StoreClient(url, token=token)
        secret = settings.store_token(token)
        headers = {"content-type": "application/x-protobuf"}
        if secret:
            headers["authorization"] = f"Bearer {secret}"
        self.http = httpx.Client(base_url=self.client.url, headers=headers, timeout=60)

    def __enter__(self) -> _Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        self.client.close()

    def add(self, record: Record, file: str) -> None:
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue

        grouping, rollouts, summary = self.grouping, self.rollouts, self.summary
        try:
            request = decode_json(record.body) if record.json else decode_protobuf(record.body)
        except OtlpDecodeError as exc:
            summary.problems.append(f"{file}: {record.where}: {exc}")
            return
        carries_ids = semconv.ROLLOUT_ID.encode() in record.body
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    own = None
                    if carries_ids:
                        own = next((kv.value for kv in span.attributes if kv.key == semconv.ROLLOUT_ID), None)
                    if own is not None and own.WhichOneof("value") in ("string_value", "int_value"):
                        rollouts.note(str(getattr(own, str(own.WhichOneof("value")))), file, {})
                        continue
                    rollout_id, grouped_by = grouping.rollout_of(span.trace_id)
                    span.attributes.add(key=semconv.ROLLOUT_ID).value.CopyFrom(
                        AnyValue(string_value=rollout_id)
                    )
                    rollouts.note(rollout_id, file, grouped_by)
        for part in split_request(request, min(_HTTP_BATCH_SPANS, MAX_SPANS_PER_REQUEST)):
            sent = sum(len(ss.spans) for rs in part.resource_spans for ss in rs.scope_spans)
            refused, reason = self._post(part.SerializeToString(), file, record.where, summary)
            if refused < 0:  # the store refused the whole request; the reason is in problems
                continue
            summary.spans += sent - refused
            problem = _refused(refused, reason, file, record.where, summary)
            if problem:
                summary.problems.append(problem)

    def _post(self, body: bytes, file: str, where: str, summary: ImportSummary) -> tuple[int, str]:
        """Send one request, retrying while the store says "later". Returns (spans refused, why), or
        (-1, "") when the store refused the request as a whole (noted in ``summary``)."""
        import httpx
        from google.rpc import status_pb2
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        deadline = time.monotonic() + 120
        while True:
            try:
                response = self.http.post("/v1/traces", content=body)
            except httpx.HTTPError as exc:
                raise StoreUnavailableError(f"cannot reach the store at {self.client.url}: {exc}") from None
            status = response.status_code
            if status == 200:
                answer = ExportTraceServiceResponse.FromString(response.content)
                return answer.partial_success.rejected_spans, answer.partial_success.error_message
            if status in (429, 503) and time.monotonic() < deadline:
                time.sleep(min(float(response.headers.get("retry-after", "1") or 1), 10.0))
                continue
            try:
                message = status_pb2.Status.FromString(response.content).message
            except Exception:  # not a google.rpc.Status body (a proxy's page, say)
                message = response.text[:300]
            if status in (400, 413):
                summary.problems.append(f"{file}: {where}: the store refused it (HTTP {status}): {message}")
                return -1, ""
            error = StoreUnavailableError if status >= 500 else StoreError
            raise error(f"POST {self.client.url}/v1/traces -> HTTP {status}: {message}")

    def flush(self) -> None:
        pass
