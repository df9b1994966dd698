"""Importing trace files into a store: the reading, the writes, the rollout records, the summary.

A span's rollout can depend on spans read after it (a session named on a later span of its trace, or a
rollout id that outranks it). Into a store written directly, each record is decoded by the store's own
ingest. Uncompressed protobuf files are read once: each record is decoded, and the spans of a trace
whose rollout can no longer change (:meth:`Grouping.settled`, knowing which grouping keys the files'
bytes hold at all) are written at once (into a SQLite file, by a process of their own for large
imports: :mod:`._writer`); the others wait, in memory up to 64 MiB, beyond it for a second reading of
their records, until the end of the files. Other files (JSON, compressed, or
any file when redacting) take two phases: the first reads the files and learns the grouping (a JSON
record is parsed there, in worker processes for large imports, and its rows kept in a temporary spill,
in memory up to 64 MiB and on disk beyond; a protobuf record is only scanned); the second gives each
row without a rollout id its rollout and hands the rows to the store's writer (the spilled rows read
back, the protobuf files read again and decoded). Into a running store, a first reading of the files
learns the grouping from the records, and a second sends them over OTLP/HTTP.
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
from ..store.formats.otlp import (
    MAX_SPANS_PER_REQUEST,
    OtlpDecodeError,
    ParsedBatch,
    SpanRow,
    decode_json,
    decode_protobuf,
)
from ..store.ingest import IngestPipeline, Overloaded, as_store_error
from ..store.redact import Redactor
from ..store.sqlite import SqliteStore
from ._files import BadRecord, Record, TraceFile, split_request
from ._grouping import Grouping
from ._writer import WriterProcess

__all__ = ["ImportSummary", "Progress", "import_traces"]

#: ``progress(phase, file, bytes_done, bytes_total, spans)``: ``phase`` is ``"scan"`` (reading the files
#: for grouping, and into a store written directly parsing them; bytes over all files, as stored, that is
#: compressed), ``"import"`` (writing: protobuf files read once, bytes over the files; else into a store
#: written directly, bytes over the spill of parsed spans, ``file`` the one a batch came from; into a
#: running store, bytes over the files again) or ``"finish"`` (protobuf files read once: the records
#: whose spans waited beyond the memory budget, read again; bytes over the files that hold them).
Progress = Callable[[str, str, int, int, int], None]
#: Parse in worker processes when the files hold more than this many bytes together.
_WORKERS_FROM_BYTES = 32 * 1024 * 1024
#: Parsed spans waiting for the second phase stay in memory up to this many bytes, then go to disk (or,
#: read once, are read again).
_SPILL_MEMORY_BYTES = 64 * 1024 * 1024
#: Spans per OTLP/HTTP request sent to a running store.
_HTTP_BATCH_SPANS = 5_000
_SOURCE = "import"
#: Spans per transaction of an import. The writer commits what is queued, and an import queues its whole
#: backlog at once: transactions of 20,000 spans (the store's limit) outgrow SQLite's page cache and pass
#: the WAL size at which the checkpointer holds writes off within one transaction; with small ones the
#: checkpointer copies each commit while the next is written (60k-span protobuf file, medians of 5
#: alternating runs: 48k spans/s at 20,000, 52k at 1,024 when read twice; read once, 61k at 4,096, 64k at
#: 1,024, 69k at 512, 66k at 256).
_COMMIT_SPANS = 512


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
    #: spans an earlier import had put in a trace's own rollout (``imp-t-<trace>``, its grouping not known
    #: then: a session or rollout id on a span it did not read) moved to the rollout this import gives
    merged_spans: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 when every line and span was imported, 1 when any was skipped (the rest was imported)."""
        return 1 if self.problems else 0


class _Rollouts:
    """The rollouts the imported spans belong to, with their metadata (from the first file, in the order
    given, that holds one of their spans; ``order`` is that file's place when spans are written out of
    the files' order)."""

    def __init__(self) -> None:
        self.metadata: dict[str, dict[str, Any]] = {}
        self._order: dict[str, int] = {}

    def note(self, rollout_id: str, file: str, grouped_by: dict[str, Any], order: int = 0) -> None:
        known = self._order.get(rollout_id)
        if known is None or order < known:
            self._order[rollout_id] = order
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
    directly (default: one per CPU, at most 4, for files over 32 MB together on more than one CPU; 0
    decodes here); protobuf records are decoded here unless ``redactor`` is given, and when they are read
    once into a SQLite file, any workers mean one process writing their rows instead. A script that calls
    this with workers needs the ``if __name__ == "__main__":`` guard that :mod:`multiprocessing` asks
    for (the processes are spawned).
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
            summary.merged_spans = sink.client.merge_rollouts(grouping.regrouped())
            summary.new_spans = sink.client.stats()["spans"] - before
    else:
        target = open_store(store) if isinstance(store, str) else store
        try:
            workers = parse_workers
            if workers is None:
                cpus = os.cpu_count() or 1
                workers = min(cpus, 4) if total > _WORKERS_FROM_BYTES and cpus > 1 else 0
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
            summary.merged_spans = target.merge_rollouts(grouping.regrouped())
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


def _held_bytes(row: SpanRow) -> int:
    """About the memory a waiting row holds: its span's encoding and the tuple around it."""
    return len(row[10]) + 256


class _Waiting:
    """Rows read before their trace's rollout was certain, in the order read: kept here up to a memory
    budget, and beyond it given up (oldest trace first) for a second reading of their records, every
    later row of those traces with them, so that a trace's spans are still written in the order read."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        #: trace id -> its rows waiting here: (row, file index, record number, record size, position)
        self.rows: dict[bytes, list[tuple[SpanRow, int, int, int, int]]] = {}
        #: traces whose rows are all left for the second reading
        self.deferred: set[bytes] = set()
        #: (file index, record number) -> (record size, positions of the rows to write in its batch)
        self.records: dict[tuple[int, int], tuple[int, list[int]]] = {}

    def hold(self, row: SpanRow, index: int, number: int, size: int, position: int) -> None:
        trace_id = row[0]
        if trace_id in self.deferred:
            self._defer(index, number, size, position)
            return
        self.rows.setdefault(trace_id, []).append((row, index, number, size, position))
        self.bytes += _held_bytes(row)
        if self.bytes > self.budget:
            while self.rows and self.bytes > self.budget // 2:
                oldest = next(iter(self.rows))
                self.deferred.add(oldest)
                for held, *place in self.rows.pop(oldest):
                    self.bytes -= _held_bytes(held)
                    self._defer(*place)

    def release(self, trace_id: bytes) -> list[tuple[SpanRow, int, int, int, int]]:
        """The rows of ``trace_id`` waiting here, in the order read, no longer held."""
        held = self.rows.pop(trace_id, [])
        self.bytes -= sum(_held_bytes(row) for row, *_ in held)
        return held

    def _defer(self, index: int, number: int, size: int, position: int) -> None:
        self.records.setdefault((index, number), (size, []))[1].append(position)


class _Embedded:
    """Spans through the store's own ingest pipeline (decoding, validation, redaction, group commit):
    :meth:`read_all` reads the files, :meth:`write_all` writes what is left to write.

    When every file is uncompressed protobuf and nothing is redacted, the files are read once
    (:meth:`_read_once`): each record is decoded here and the rows of settled traces are written in
    transactions of :data:`_COMMIT_SPANS`; the rows of traces still unsettled wait. Into a SQLite file,
    with workers (large imports on more than one core), the rows go to a process that writes them
    (:class:`WriterProcess`), so that decoding here and SQLite's inserts, commits and checkpoints run on
    two cores (200k-span file, 2 cores, medians of 3 alternating runs: 39k spans/s written here, 43k with
    the process); until that process has opened the store (about 0.4 s) and without workers, they are
    written in this thread. Not through the store's writer thread: each of its statements waits for
    Python's lock while this thread decodes (60k-span file, medians of 5: 65k spans/s through the writer
    thread, 69k written here). How much reading once saves depends on what the files hold: with no
    rollout ids and a session on each span (OpenInference's ``using_session``), or no grouping keys at
    all, every trace is settled at once and nothing waits (the same file: 60k spans/s read twice, 65k
    read once).

    Otherwise in two phases. A JSON record costs ten times more to decode than a protobuf one, so it is
    decoded once: in phase 1 (in worker processes for large imports), its rows spilled and read back in
    phase 2. A protobuf file (compressed, or beside JSON files) is read twice instead: phase 1 only scans
    its records for grouping keys, and phase 2 decodes each record again and hands its rows to the
    writer. Pickling the decoded rows to a spill and reading them back cost more than the scan, and
    decoding in worker processes costs about as much as it saves (unpickling their rows, and two more
    processes on the cores the writer needs). With a redactor every record goes the JSON way: its
    redacted rows are what is written, and the grouping is learnt from the records as read."""

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
        #: read once into a SQLite file with workers: the process that writes the rows (see _read_once)
        self.writer: WriterProcess | None = None
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
        # read once (:meth:`_read_once`): the rows waiting for their rollout, every scope read, the
        # traces whose rollout is certain, and whether the files hold each grouping key
        self.waiting: _Waiting | None = None
        self.scopes: dict[bytes, tuple[bytes, bytes]] = {}
        self.settled: set[bytes] = set()
        self.holding: dict[str, bool] = {}

    def _second_reading(self, f: TraceFile) -> bool:
        return not self.redacting and f.detected.startswith("otlp-proto")

    # --- phase 1: learn the grouping; decode and spill the JSON records -----------------------------
    def read_all(self, files: list[TraceFile], total: int, progress: Progress | None) -> None:
        self.files = files
        if not self.redacting and files and all(f.plain_protobuf() for f in files):
            self._read_once(total, progress)
            return
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

    # --- plain protobuf files: one reading, each trace written once its rollout is certain ------------
    def _read_once(self, total: int, progress: Progress | None) -> None:
        """Decode each record and write the rows whose rollout can no longer change (see
        :meth:`Grouping.settled`); the others wait for the end of the files, when the grouping is
        complete. What the files may still hold is learnt by scanning their bytes for the grouping keys
        (a key no file holds can name no rollout), each key when first needed."""
        self.waiting = waiting = _Waiting(_SPILL_MEMORY_BYTES)
        store = self.pipeline.store
        if self.pipeline.parse_workers > 0 and isinstance(store, SqliteStore):
            self.writer = WriterProcess(store.path, store.synchronous)
        for f in self.files:
            f.bounded = True  # read what was scanned, not what a writer appended since
        grouping, settled, scopes = self.grouping, self.settled, self.scopes
        done = 0
        for index, f in enumerate(self.files):
            name = str(f.path)
            number = -1
            for record in f.records():
                if isinstance(record, BadRecord):
                    self.problems.append((index, f"{name}: {record.where}: {record.problem}"))
                    continue
                number += 1
                self.summary.records += 1
                batch = self._decode(record, index, name)
                if batch is None:
                    continue
                if batch.rejected:
                    grouping.scan(record)  # refused spans are not in the rows, but their attributes group
                else:
                    grouping.learn(batch.rows)
                scopes.update(batch.scopes)
                ready: list[SpanRow] = []
                size = len(record.body)
                for position, row in enumerate(batch.rows):
                    trace_id = row[0]
                    if trace_id in settled:
                        ready.append(row)
                    elif trace_id not in waiting.deferred and grouping.settled(trace_id, self._may_hold):
                        settled.add(trace_id)
                        # what waited of it goes first, in the order read
                        self._write_held(waiting.release(trace_id))
                        ready.append(row)
                    else:
                        waiting.hold(row, index, number, size, position)
                self._write(ready, batch.scopes, name, index)
                if progress is not None:
                    progress("import", name, done + f.position, total, self.summary.spans)
            done += f.size

    def _decode(self, record: Record, index: int, file: str) -> ParsedBatch | None:
        """A protobuf record decoded here, its refused spans noted; None (the problem noted) when it
        cannot be decoded."""
        try:
            batch = self.pipeline.parse(record.body)
        except OtlpDecodeError as exc:
            self.problems.append((index, f"{file}: {record.where}: {exc}"))
            return None
        self._note_refused(batch, index, file, record.where)
        return batch

    def _may_hold(self, key: str) -> bool:
        known = self.holding.get(key)
        if known is None:
            marker = key.encode()
            known = self.holding[key] = any(f.holds(marker) for f in self.files)
        return known

    def _write_held(self, held: list[tuple[SpanRow, int, int, int, int]]) -> None:
        """Write rows that waited, a run of rows from one file at a time."""
        start = 0
        while start < len(held):
            index = held[start][1]
            end = start
            while end < len(held) and held[end][1] == index:
                end += 1
            rows = [entry[0] for entry in held[start:end]]
            scopes = {row[9]: self.scopes[row[9]] for row in rows}
            self._write(rows, scopes, str(self.files[index].path), index)
            start = end

    def _finish_waiting(self, waiting: _Waiting, progress: Progress | None) -> None:
        """At the end of the files every rollout is certain: write the rows that waited in memory, then
        read again the records whose rows were given up for lack of memory and write those rows."""
        held = [entry for rows in waiting.rows.values() for entry in rows]
        waiting.rows.clear()
        held.sort(key=lambda entry: entry[1])  # stable: each trace's rows stay in the order read
        self._write_held(held)
        indexes = sorted({index for index, _ in waiting.records})
        total = sum(self.files[i].size for i in indexes)
        done = 0
        for index in indexes:
            f = self.files[index]
            name = str(f.path)
            number = -1
            for record in f.records():
                if isinstance(record, BadRecord):
                    continue  # reported by the first reading
                number += 1
                wanted = waiting.records.pop((index, number), None)
                if wanted is None:
                    continue
                size, positions = wanted
                try:
                    if len(record.body) != size:
                        raise OtlpDecodeError("it differs from its first reading")
                    batch = self.pipeline.parse(record.body)
                    rows = [batch.rows[p] for p in sorted(positions)]
                except (OtlpDecodeError, IndexError):
                    self._changed(index, name, record.where, len(positions))
                    continue
                self._write(rows, batch.scopes, name, index)
                if progress is not None:
                    progress("finish", name, done + f.position, total, self.summary.spans)
            for (_, number), (_, positions) in sorted(
                item for item in waiting.records.items() if item[0][0] == index
            ):  # records the second reading did not reach: the file is shorter now
                self._changed(index, name, f"record {number}", len(positions))
                del waiting.records[(index, number)]
            done += f.size

    def _changed(self, index: int, file: str, where: str, spans: int) -> None:
        self.problems.append(
            (
                index,
                f"{file}: {where}: the file changed while it was imported, and {spans} span(s) of this"
                " record were not written: import it again",
            )
        )

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
        if self.waiting is not None:
            self._finish_waiting(self.waiting, progress)
            if self.writer is not None:
                self.writer.finish()
                self.writer = None
            self._drain()
            return
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
                    # decoded here: a worker process would save the decoding, but taking its rows back
                    # (unpickling them) costs this process about as much
                    batch = self._decode(record, index, name)
                    if batch is None:
                        continue
                    self._write(batch.rows, batch.scopes, name, index)
                    if progress is not None:
                        progress("import", name, spill.tell() + done + f.position, total, self.summary.spans)
                done += f.size
                continue
            while pending is not None and pending[0] == index:
                _, rows, scopes, _, _ = pending
                self._write(rows, scopes, name, index)
                pending = pickle.load(spill) if spill.tell() < spilled else None
                if progress is not None:
                    progress("import", name, spill.tell() + done, total, self.summary.spans)
        self._drain()

    def _drain(self) -> None:
        """Wait for every write, then report the problems in the files' order."""
        while self.writing:
            self.writing.popleft().result()
        self.summary.problems.extend(problem for _, problem in sorted(self.problems, key=lambda p: p[0]))

    def _write(
        self, rows: list[SpanRow], scopes: dict[bytes, tuple[bytes, bytes]], file: str, order: int
    ) -> None:
        """Give each row without a rollout id its rollout, and write the rows: when the files are read
        once, here or through the writer process, else through the store's writer thread (``order``: the
        place of ``file`` among the files)."""
        grouping, rollouts, assigned = self.grouping, self.rollouts, self.assigned
        out: list[SpanRow] = []
        for row in rows:
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
            rollouts.note(rollout_id, file, grouped_by, order)
            out.append(row)
        if not out:
            return
        self.summary.spans += len(out)
        if self.waiting is not None:  # read once: see the class's docstring
            writer = self.writer
            for start in range(0, len(out), _COMMIT_SPANS):
                if writer is not None and writer.ready():
                    writer.send(out[start : start + _COMMIT_SPANS], scopes)
                else:
                    self._commit_now(out[start : start + _COMMIT_SPANS], scopes)
            return
        for start in range(0, len(out), _COMMIT_SPANS):
            batch = ParsedBatch(out[start : start + _COMMIT_SPANS], scopes, 0, "")
            while True:
                try:
                    self.writing.append(self.pipeline.submit(batch))
                    break
                except Overloaded:
                    self._wait_write()
            while self.writing and self.writing[0].done():
                self.writing.popleft().result()  # raises what the write raised

    def _commit_now(self, rows: list[SpanRow], scopes: dict[bytes, tuple[bytes, bytes]]) -> None:
        """One transaction of ``rows`` in this thread; a failure is raised as the store's writer thread
        reports it (:class:`StoreError` as it is, anything else as :class:`StoreUnavailableError`)."""
        try:
            self.pipeline.store.add_span_rows(rows, scopes)
        except StoreError:
            raise
        except Exception as exc:
            raise as_store_error(exc) from exc

    def _wait_write(self) -> None:
        if self.writing:
            self.writing.popleft().result()
        else:
            time.sleep(0.01)

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
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
