"""Reading trace files as the OpenTelemetry Collector's ``file`` exporter writes them.

* ``otlp-json``: one OTLP/JSON ``TracesData`` / ``ExportTraceServiceRequest`` object per line (the
  exporter's default); a file holding one pretty-printed object is read as one record too.
* ``otlp-proto``: the exporter's ``format: proto``, each message preceded by its size as a 4-byte
  big-endian integer; or a single bare protobuf message (the whole file).
* either compressed with gzip or zstd (the Collector's ``compression: zstd``; needs the ``zstandard``
  package, ``pip install 'agl[zstd]'``), recognised by their magic bytes, whatever the file is called.

``auto`` looks at the content: a ``{`` first (after blanks) is JSON; a protobuf message starts with the
tag of its first field, ``0x0A``, where a length prefix of a message under 160 MiB cannot; anything else
is read as length-prefixed. Nothing here decodes spans: records go to the store's own OTLP decoders.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import mmap
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from .._bounded import bounded_lines

__all__ = ["FORMATS", "MAX_RECORD_BYTES", "BadRecord", "Record", "TraceFile", "split_request"]

FORMATS = ("auto", "otlp-json", "otlp-proto")
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: The largest record read: a JSON line, a length-prefixed message, a compressed file's single message
#: (decompressed). A larger one is reported and skipped without being held (no exporter writes one:
#: the store itself takes at most 32 MiB per request).
MAX_RECORD_BYTES = 64 * 1024 * 1024
#: A JSON file whose first line is not a whole object is tried as one document up to this size.
_MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
#: Spans per record when a large bare protobuf file is split (the store takes at most 100,000 per export).
_SPLIT_SPANS = 10_000


@dataclasses.dataclass(frozen=True)
class Record:
    """One export request's bytes; ``where`` locates it in its file (``line 12``, ``record 3 (byte
    4096)``) for messages."""

    body: bytes
    json: bool
    where: str


@dataclasses.dataclass(frozen=True)
class BadRecord:
    """A part of the file that could not be read as a record, and why; it is skipped."""

    where: str
    problem: str


class TraceFile:
    """One trace file, opened lazily; :meth:`records` yields its records in order."""

    def __init__(self, path: Path, fmt: str = "auto") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
        self.path = path
        self.format = fmt
        self.size = path.stat().st_size
        self._raw: BinaryIO | None = None
        #: what the file turned out to hold: ``otlp-json``, ``otlp-proto`` (length-prefixed or bare)
        self.detected = ""
        #: read only the bytes the file held when it was opened here (a file still being written is
        #: imported as it was then): set for a :meth:`plain_protobuf` file whose bytes were scanned
        self.bounded = False

    @property
    def position(self) -> int:
        """Bytes of the file (compressed, if it is) read so far."""
        try:
            return self._raw.tell() if self._raw is not None and not self._raw.closed else self.size
        except (OSError, ValueError):
            return self.size

    def plain_protobuf(self) -> bool:
        """Whether the file is a regular, uncompressed file that is read as protobuf: its bytes are then
        the spans' own encodings, and :meth:`holds` can tell what it holds without decoding it."""
        if self.format == "otlp-json":
            return False
        try:
            if not stat.S_ISREG(self.path.stat().st_mode):
                return False
            with open(self.path, "rb") as raw:
                head = raw.read(64)
        except OSError:
            return False
        if _compression(head):
            return False
        return self.format == "otlp-proto" or not _looks_like_json(head)

    def holds(self, marker: bytes) -> bool:
        """Whether ``marker`` occurs in the file's first :attr:`size` bytes (a scan at memory speed, not
        decoding; meaningful for a :meth:`plain_protobuf` file, whose strings are stored as they are)."""
        if not self.size:
            return False
        with open(self.path, "rb") as raw, mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return view.find(marker, 0, self.size) >= 0

    def records(self) -> Iterator[Record | BadRecord]:
        with open(self.path, "rb") as raw:
            self._raw = raw
            compression = _compression(raw.read(4))
            raw.seek(0)
            errors: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error)
            stream: io.BufferedReader[Any]
            if compression == "gzip":
                stream = io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), 1 << 20)
            elif compression == "zstd":
                try:
                    import zstandard
                except ImportError:
                    yield BadRecord(
                        "byte 0",
                        "the file is compressed with zstd, and the zstandard package is not installed:"
                        " pip install 'agl[zstd]' (or zstandard), or decompress it first (zstd -d)",
                    )
                    return
                stream = io.BufferedReader(_ZstdFrames(raw, zstandard), 1 << 20)
                errors += (zstandard.ZstdError,)
            else:
                stream = io.BufferedReader(raw, 1 << 20)
            try:
                yield from self._read(stream, compression)
            except errors as exc:
                yield BadRecord(
                    f"byte {raw.tell()}",
                    f"the {compression} data is truncated or corrupt ({exc}); the rest of the file is"
                    " skipped",
                )

    def _read(self, stream: io.BufferedReader[Any], compression: str) -> Iterator[Record | BadRecord]:
        head = stream.peek(64)[:64]
        fmt = self.format
        if fmt == "auto":
            if not head.lstrip():
                self.detected = "empty"
                return
            fmt = "otlp-json" if _looks_like_json(head) else "otlp-proto"
        if fmt == "otlp-json":
            self.detected = "otlp-json" + (f" ({compression})" if compression else "")
            yield from _json_records(stream)
        elif stream.peek(1)[:1] == b"\x0a":
            self.detected = "otlp-proto, one message" + (f" ({compression})" if compression else "")
            yield from _bare_records(stream, self.size if self.bounded else -1)
        else:
            self.detected = "otlp-proto, length-prefixed" + (f" ({compression})" if compression else "")
            yield from _prefixed_records(stream, self.size if self.bounded else None)


def _compression(magic: bytes) -> str:
    """``gzip``, ``zstd`` or ``""`` (not compressed), from a file's first four bytes."""
    return "gzip" if magic[:2] == _GZIP_MAGIC else "zstd" if magic[:4] == _ZSTD_MAGIC else ""


def _looks_like_json(head: bytes) -> bool:
    """Whether a file starting with ``head`` (uncompressed) is read as OTLP/JSON: a ``{`` after blanks."""
    return head.lstrip()[:1] == b"{"


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of zstd frames, one after another (a frame per write of the
    Collector's exporter); a file that ends inside a frame raises ``zstandard.ZstdError``.

    zstd's decompressor has no output bound, and one block of a few bytes can stand for 128 KiB (a
    kilobyte of a hostile file for a gigabyte), so the compressed bytes are fed in pieces sized from the
    ratio seen so far: each piece yields about :data:`_ZSTD_TARGET` bytes, never more than
    :data:`_ZSTD_MIN_PIECE` times zstd's largest ratio (about 11 MB). What is held stays bounded, as
    with gzip."""

    def __init__(self, raw: BinaryIO, zstandard: Any) -> None:
        self._raw = raw
        self._zstd = zstandard
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        self._in = b""
        self._piece = _ZSTD_MIN_PIECE
        self._out = bytearray()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            if not self._in:
                self._in = self._raw.read(1 << 20)
                if not self._in:
                    if self._in_frame:
                        raise self._zstd.ZstdError("the file ends inside a zstd frame")
                    return 0
            piece, self._in = self._in[: self._piece], self._in[self._piece :]
            made = self._feed(piece)
            ratio = max(made / len(piece), 1.0)
            self._piece = int(min(max(_ZSTD_TARGET / ratio, _ZSTD_MIN_PIECE), 1 << 20))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        del self._out[:n]
        return n

    def _feed(self, data: bytes) -> int:
        """Decompress ``data`` (crossing into the next frame where one ends); how many bytes it made."""
        before = len(self._out)
        while data:
            self._in_frame = True
            self._out += self._frame.decompress(data)
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the next frame starts here
            self._frame = self._decompressor.decompressobj()
            self._in_frame = False
        return len(self._out) - before


#: Decompressed bytes a piece of a zstd file aims to make, and the smallest piece fed.
_ZSTD_TARGET, _ZSTD_MIN_PIECE = 4 << 20, 256


def _bounded_lines(stream: Any, start: int = 1) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, line)`` of ``stream``; ``None`` for a line over :data:`MAX_RECORD_BYTES`."""
    return bounded_lines(stream, MAX_RECORD_BYTES, start)


def _too_long(number: int) -> BadRecord:
    return BadRecord(
        f"line {number}", f"longer than {MAX_RECORD_BYTES} bytes, more than this reader takes; skipped"
    )


def _json_records(stream: io.BufferedReader) -> Iterator[Record | BadRecord]:
    lines: Any = stream
    number = 0
    for number, line in _bounded_lines(stream):
        if line is None:
            yield _too_long(number)
            continue
        text = line.strip()
        if not text:
            continue
        if not _is_object(text):
            # a pretty-printed document, or a bad first line: look at what follows, within a bound
            rest = stream.read(_MAX_DOCUMENT_BYTES + 1)
            document = text + b"\n" + rest
            if len(rest) <= _MAX_DOCUMENT_BYTES and _is_object(document):
                yield Record(document, True, f"line {number} (one JSON document)")
                return
            lines = _Prepend(rest, stream)
        yield Record(text, True, f"line {number}")
        break
    for later, line in _bounded_lines(lines, number + 1):
        if line is None:
            yield _too_long(later)
        elif line.strip():
            yield Record(line.strip(), True, f"line {later}")


class _Prepend(io.RawIOBase):
    """``head`` then the rest of ``stream``, as one readable stream."""

    def __init__(self, head: bytes, stream: io.BufferedReader) -> None:
        self._head = memoryview(head)
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> bytes:
        limit = -1 if size is None else size
        if self._head.nbytes:
            cut = bytes(self._head[: limit if limit >= 0 else None])
            newline = cut.find(b"\n")
            if newline >= 0:
                cut = cut[: newline + 1]
            self._head = self._head[len(cut) :]
            if cut.endswith(b"\n") or (limit >= 0 and len(cut) >= limit):
                return cut
            more = self._stream.readline(limit - len(cut) if limit >= 0 else -1)
            return cut + more
        return self._stream.readline(limit)


def _is_object(text: bytes) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _prefixed_records(stream: io.BufferedReader, limit: int | None) -> Iterator[Record | BadRecord]:
    offset = 0
    index = 0
    while True:
        if limit is not None and offset >= limit:
            return
        header = stream.read(4)
        if not header:
            return
        where = f"record {index} (byte {offset})"
        if len(header) < 4:
            yield BadRecord(where, f"the file ends inside a length prefix ({len(header)} of 4 bytes)")
            return
        size = int.from_bytes(header, "big")
        if size > MAX_RECORD_BYTES or size == 0:
            yield BadRecord(
                where,
                f"a length prefix of {size} bytes"
                + (f" (records are read up to {MAX_RECORD_BYTES})" if size else "")
                + ": this is not a length-prefixed OTLP protobuf file, or it is corrupt here; the rest of"
                " the file is skipped",
            )
            return
        body = stream.read(size)
        if len(body) < size:
            yield BadRecord(
                where, f"the file is truncated: the record announces {size} bytes, {len(body)} are left"
            )
            return
        if limit is not None and offset + 4 + size > limit:
            yield BadRecord(
                where,
                f"the record ends at byte {offset + 4 + size}, past the {limit} bytes the file held when the"
                " import began (it is being written): import the file again for the rest",
            )
            return
        yield Record(body, False, where)
        offset += 4 + size
        index += 1


def _bare_records(stream: io.BufferedReader, limit: int) -> Iterator[Record | BadRecord]:
    if limit < 0:  # compressed: what it decompresses to is bounded, not the file
        body = stream.read(MAX_RECORD_BYTES + 1)
        if len(body) > MAX_RECORD_BYTES:
            yield BadRecord(
                "the file",
                f"it decompresses to one protobuf message of more than {MAX_RECORD_BYTES} bytes, more than"
                " this reader takes; skipped (export in smaller batches, or as length-prefixed records)",
            )
            return
    else:
        body = stream.read(limit)
    try:
        request = ExportTraceServiceRequest.FromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        yield BadRecord("the file", f"not a valid OTLP protobuf message: {exc}")
        return
    if sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans) <= _SPLIT_SPANS:
        yield Record(body, False, "the file")
        return
    for n, part in enumerate(split_request(request, _SPLIT_SPANS)):
        yield Record(part.SerializeToString(), False, f"part {n} of the file")


def split_request(
    request: ExportTraceServiceRequest, max_spans: int, max_bytes: int = 8 << 20
) -> Iterator[ExportTraceServiceRequest]:
    """``request`` as requests of at most ``max_spans`` spans and about ``max_bytes`` bytes each (a span
    larger than that goes alone), keeping every span's resource and scope."""
    out = ExportTraceServiceRequest()
    count = size = 0
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            target = None
            for span in ss.spans:
                span_size = span.ByteSize()
                if count and (count >= max_spans or size + span_size > max_bytes):
                    yield out
                    out, count, size, target = ExportTraceServiceRequest(), 0, 0, None
                if target is None:
                    holder: ResourceSpans = out.resource_spans.add(
                        resource=rs.resource, schema_url=rs.schema_url
                    )
                    target = holder.scope_spans.add(scope=ss.scope, schema_url=ss.schema_url)
                target.spans.append(span)
                count += 1
                size += span_size
    if count:
        yield out
