"""A process that writes an import's span rows into a SQLite store file, so that decoding (in the importing
process) and SQLite's inserts and commits (here) run on two cores at once.

Threads cannot do this: the writer's every statement gives up Python's lock and waits to take it back
while the reading thread decodes. The rows are sent pickled over a pipe, a transaction's worth per
message (pickling and unpickling cost about 2 µs of the 13 µs a span costs to decode and write). The
process reads the pipe on a thread of its own, so that the importing process never waits for a commit to
end before it can send the next batch; a bounded queue between the two keeps at most
:data:`_QUEUED_BATCHES` batches in memory, and a full queue holds the sender back.

The protocol, one way each: batches ``pickle((rows, scopes))`` then an empty message (the end) to the
process; ``("ready",)`` once the store is open, then ``("done",)`` or ``("error", kind, message)`` back.
A process that dies (killed, out of memory) is seen as the end of the pipe and reported as the store being
unavailable; what it committed stays, and importing again is safe.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..store import StoreError, StoreUnavailableError
from ..store.formats.otlp import SpanRow
from ..store.ingest import as_store_error
from ..store.workers import widen_pipe

__all__ = ["WriterProcess"]

#: Batches read from the pipe and not yet written, at most (a 512-span batch of 1 KB spans: ~0.7 MB).
_QUEUED_BATCHES = 8


class WriterProcess:
    """Writes batches of span rows into the SQLite file ``path`` from a process of its own.

    :meth:`ready` says whether the process has opened the store (until then the caller writes itself, so
    starting it costs no waiting); :meth:`send` hands it one transaction's rows; :meth:`finish` waits for
    every batch to be committed. Either raises :class:`StoreError` (as the store raised it) or
    :class:`StoreUnavailableError` when a write failed, the first failure ending the process."""

    def __init__(self, path: Path, synchronous: str) -> None:
        context = multiprocessing.get_context("spawn")
        batches_in, self._batches = context.Pipe(duplex=False)
        widen_pipe(self._batches)
        self._answers, answers_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_serve,
            args=(str(path), synchronous, batches_in, answers_out),
            name="agl-import-writer",
            daemon=True,
        )
        self._process.start()
        batches_in.close()  # the process's ends: this process keeps only its own
        answers_out.close()
        self._ready = False
        #: the process is gone (stopped, failed, or given up before it took a batch)
        self._ended = False

    def ready(self) -> bool:
        """Whether batches go to the process now: it has opened the store and is still running. A process
        that could not open the store is given up (False from then on), and the caller keeps writing."""
        if self._ready or self._ended:
            return self._ready
        if not self._answers.poll():
            return False
        answer = self._answer()
        if answer[0] == "ready":
            self._ready = True
        else:  # it could not start: the importing process writes everything itself
            self._stop()
        return self._ready

    def send(self, rows: list[SpanRow], scopes: dict[bytes, tuple[bytes, bytes]]) -> None:
        """Hand one transaction's rows to the process (waits while its queue is full)."""
        if self._answers.poll():  # a write failed: the process has said so and stopped
            self._raise(self._answer())
        try:
            self._batches.send_bytes(pickle.dumps((rows, scopes), pickle.HIGHEST_PROTOCOL))
        except OSError:  # the process has gone: its answer says why
            self._raise(self._answer())

    def finish(self) -> None:
        """Wait until every batch sent is committed, then let the process end. Nothing to wait for when it
        never took a batch (given up, or the import was over before it had opened the store): it is
        ended then."""
        if self._ended:
            return
        if not self._ready:
            self.close()
            return
        try:
            self._batches.send_bytes(b"")
        except OSError:
            pass  # gone already: its answer says why
        answer = self._answer()
        self._stop()
        if answer[0] != "done":
            self._raise(answer)

    def close(self) -> None:
        """End the process without waiting for its work (after a failure of the import's own)."""
        if self._process.is_alive():
            self._process.terminate()
        self._stop()

    def _answer(self) -> tuple[Any, ...]:
        try:
            answer: tuple[Any, ...] = self._answers.recv()
            return answer
        except (EOFError, OSError):
            self._process.join(5)
            return (
                "error",
                "unavailable",
                f"the import's writer process exited (code {self._process.exitcode})",
            )

    def _raise(self, answer: tuple[Any, ...]) -> None:
        self._stop()
        _, kind, message = answer
        raise (StoreError if kind == "store" else StoreUnavailableError)(message)

    def _stop(self) -> None:
        self._ready = False
        self._ended = True
        self._batches.close()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._answers.close()


def _serve(path: str, synchronous: str, batches: Connection, answers: Connection) -> None:
    """The writer process: open the store, then write each batch in one transaction until the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the importing process's to handle
    from ..store.sqlite import SqliteStore

    try:
        store = SqliteStore(path, synchronous=synchronous)
    except Exception as exc:
        answers.send(("error", "unavailable", f"{type(exc).__name__}: {exc}"))
        return
    received: queue.Queue[bytes] = queue.Queue(_QUEUED_BATCHES)

    def receive() -> None:
        while True:
            try:
                data = batches.recv_bytes()
            except (EOFError, OSError):  # the importing process is gone: write what came, then stop
                data = b""
            received.put(data)
            if not data:
                return

    threading.Thread(target=receive, name="agl-import-receive", daemon=True).start()
    answers.send(("ready",))
    try:
        while data := received.get():
            rows, scopes = pickle.loads(data)
            store.add_span_rows(rows, scopes)
    except Exception as exc:
        error = as_store_error(exc)
        answers.send(
            ("error", "unavailable" if isinstance(error, StoreUnavailableError) else "store", str(error))
        )
        return
    finally:
        store.close()
    answers.send(("done",))
