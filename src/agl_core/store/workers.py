"""The store's parse workers: processes that each take one request body at a time through a pipe of
their own.

A body goes straight from the thread that received it down an idle worker's pipe (widened, so a 0.7 MB
export is one system call), and the small answer comes back on a second pipe, read by one thread that
waits on every worker at once. ``concurrent.futures.ProcessPoolExecutor`` passes each job through a
manager thread, a shared queue and its feeder thread, and each answer back through the manager: on two
cores that hand-off took 1.5-1.8 ms of a 512-span export's 12 ms round trip (bench/RESULTS.md).

A worker that dies (killed, out of memory) fails only the job it held, with :class:`WorkerLost`, and is
replaced at once; jobs waiting for a worker wait for the new one. Workers exit with the store process,
however it ends (``_watch_parent``).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["WorkerLost", "WorkerPool", "widen_pipe"]

logger = logging.getLogger(__name__)

#: The pipe buffer asked for (Linux's ``/proc/sys/fs/pipe-max-size`` default).
_PIPE_BYTES = 1 << 20


class WorkerLost(Exception):
    """The worker holding a job died before answering (killed, out of memory); it has been replaced."""


def widen_pipe(connection: Connection) -> None:
    """Give a pipe a buffer as large as Linux lets any process ask for (1 MiB by default, against
    64 KiB), so that a request body goes through in one or two system calls instead of a dozen.
    Elsewhere, or refused, the pipe stays as it is."""
    try:
        import fcntl

        fcntl.fcntl(connection.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


def _watch_parent(parent: int) -> None:
    """In a worker: exit when the store process is gone, however it ended."""
    if sys.platform.startswith("linux"):
        try:  # the kernel sends SIGTERM when the parent dies (PR_SET_PDEATHSIG = 1)
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # died before prctl took effect
        os._exit(0)

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=poll, name="agl-parent-watch", daemon=True).start()


def _serve(jobs: Connection, answers: Connection, parent: int) -> None:
    """A worker's life: ``(function, arguments)`` then the body, as two messages; the answer back is
    ``("ok", result)`` or ``("error", exception)``; an empty first message (or the pipe's end) stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the store process's to handle
    _watch_parent(parent)
    while _run_one(jobs, answers):
        pass


def _run_one(jobs: Connection, answers: Connection) -> bool:
    """One job; False at the end. Its body, result and exception (whose traceback holds the decoded
    request) are let go when this returns, not kept until the next job comes."""
    try:
        head = jobs.recv_bytes()
    except (EOFError, OSError):
        return False
    if not head:
        return False
    function, args = pickle.loads(head)
    body = jobs.recv_bytes()
    try:
        answer: tuple[str, Any] = ("ok", function(body, *args))
    except Exception as exc:
        exc.__traceback__ = None
        answer = ("error", exc)
    try:
        data = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an exception that cannot be pickled: say what it was
        data = pickle.dumps(("error", RuntimeError(f"{type(answer[1]).__name__}: {exc}")))
    answers.send_bytes(data)
    return True


def _deliver(done: Future[Any], answer: tuple[str, Any]) -> None:
    if answer[0] == "ok":
        done.set_result(answer[1])
    else:
        done.set_exception(answer[1])


class _Worker:
    def __init__(self, context: Any, number: int) -> None:
        jobs_in, self.jobs = context.Pipe(duplex=False)
        self.answers, answers_out = context.Pipe(duplex=False)
        widen_pipe(self.jobs)
        self.process = context.Process(
            target=_serve,
            args=(jobs_in, answers_out, os.getpid()),
            name=f"agl-store-worker-{number}",
            daemon=True,
        )
        self.process.start()
        jobs_in.close()  # the worker's ends: this process keeps only its own
        answers_out.close()
        #: the job it holds, None when idle
        self.job: Future[Any] | None = None

    def close(self) -> None:
        for end in (self.jobs, self.answers):
            end.close()


class WorkerPool:
    """Up to ``size`` worker processes (spawned: the store process runs threads that must not be forked),
    each started when a job finds no idle one (a store that never receives a big export starts none);
    :meth:`submit` runs ``function(body, *args)`` in one of them."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._waiting: collections.deque[tuple[Future[Any], bytes, bytes]] = collections.deque()
        self._closed = False
        #: workers started in place of one that died
        self.restarted = 0
        self._started = 0
        self._size = size
        self._workers: list[_Worker] = []
        # a message wakes the answer thread: b"+" to wait on a new worker too, b"" to stop
        self._wake_reader, self._wake = self._context.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._answer_loop, name="agl-store-workers", daemon=True)
        self._thread.start()

    def _start(self) -> _Worker:
        self._started += 1
        return _Worker(self._context, self._started)

    def submit(self, function: Callable[..., Any], body: bytes, *args: Any) -> Future[Any]:
        """Run ``function(body, *args)`` (a module-level function) in a worker; the future holds its result
        or exception, or :class:`WorkerLost`. ``body`` travels as it is, never pickled."""
        done: Future[Any] = Future()
        head = pickle.dumps((function, args), pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            worker = next((w for w in self._workers if w.job is None), None)
            if worker is None and len(self._workers) < self._size:
                worker = self._start()
                self._workers.append(worker)
                self._wake.send_bytes(b"+")
            if worker is None:
                self._waiting.append((done, head, body))
            else:
                self._send(worker, done, head, body)
        return done

    def _send(self, worker: _Worker, done: Future[Any], head: bytes, body: bytes) -> None:
        """Hand a job to an idle worker (with the lock held). A worker gone meanwhile holds the job until
        the answer thread sees it died and fails it."""
        worker.job = done
        try:
            worker.jobs.send_bytes(head)
            worker.jobs.send_bytes(body)
        except OSError:
            pass

    def _answer_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                workers = list(self._workers)
            ready = wait(
                [w.answers for w in workers] + [w.process.sentinel for w in workers] + [self._wake_reader]
            )
            if self._wake_reader in ready and not self._wake_reader.recv_bytes():
                return
            for worker in workers:
                answer: tuple[str, Any] | None = None
                if worker.answers in ready:
                    try:
                        answer = pickle.loads(worker.answers.recv_bytes())
                    except (EOFError, OSError):
                        answer = None
                if answer is not None:
                    self._settle(worker, answer)
                elif worker.process.sentinel in ready or worker.answers in ready:
                    self._replace(worker)

    def _settle(self, worker: _Worker, answer: tuple[str, Any]) -> None:
        with self._lock:
            done, worker.job = worker.job, None
            if self._waiting and not self._closed:
                self._send(worker, *self._waiting.popleft())
        if done is not None:
            _deliver(done, answer)

    def _replace(self, dead: _Worker) -> None:
        """A worker died: fail its job and start another in its place, which takes the next waiting job."""
        dead.process.join(5)
        logger.warning(
            "agl store: a parse worker died (exit code %s); starting another", dead.process.exitcode
        )
        with self._lock:
            done, dead.job = dead.job, None
            dead.close()
            if self._closed:
                fresh = None
            else:
                fresh = self._start()
                self._workers[self._workers.index(dead)] = fresh
                self.restarted += 1
                if self._waiting:
                    self._send(fresh, *self._waiting.popleft())
        if done is not None:
            done.set_exception(WorkerLost("a parse worker of the store was lost; it was restarted, retry"))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Fail the jobs still waiting for a worker, let the workers finish the ones they hold, stop them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiting = list(self._waiting)
            self._waiting.clear()
            workers = list(self._workers)
        for done, _, _ in waiting:
            done.set_exception(WorkerLost("the store is shutting down; retry"))
        self._wake.send_bytes(b"")
        self._thread.join(timeout_s)
        for worker in workers:
            if worker.job is not None:  # the job it holds is answered before it stops, if it can be
                answer: tuple[str, Any] = ("error", WorkerLost("the store is shutting down; retry"))
                try:
                    if worker.answers.poll(timeout_s):
                        answer = pickle.loads(worker.answers.recv_bytes())
                except (EOFError, OSError):
                    pass
                _deliver(worker.job, answer)
            try:
                worker.jobs.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.close()
        self._wake.close()
        self._wake_reader.close()
