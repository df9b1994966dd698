"""Memory of ``agl store serve`` under hostile OTLP bodies: a small gzip body holding a million minimal
spans, alone and four at once, and the largest accepted request (100,000 spans).

Reports the store's resident memory (its process and its parse workers) before, at the peak while the
requests are handled (sampled every 10 ms), and after, with each request's status and time. The median of
``--repeat`` runs is printed; this machine is shared, so compare within one run.

    .venv/bin/python bench/ingest_memory.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import gzip
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def _body(spans: int) -> bytes:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i in range(1, spans + 1):
        scope.spans.add(trace_id=i.to_bytes(16, "big"), span_id=i.to_bytes(8, "big"))
    return gzip.compress(request.SerializeToString())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _run(body: bytes, concurrent: int) -> tuple[float, float, float, list[int], float]:
    """(before, peak, after) in MB, the statuses and the slowest answer in seconds."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(Path(tmp) / "s.sqlite")]
            + ["--http-port", str(port), "--no-grpc"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            # one small big-enough request starts the parse worker, so "before" includes it
            warm = _body(600)
            httpx.post(url + "/v1/traces", content=warm, headers=_HEADERS, timeout=60)
            proc = psutil.Process(server.pid)
            time.sleep(0.5)
            before = _rss(proc)
            peak = [before]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], _rss(proc))
                    time.sleep(0.01)

            sampler = threading.Thread(target=sample)
            sampler.start()

            def send(_: int) -> tuple[int, float]:
                t0 = time.monotonic()
                r = httpx.post(url + "/v1/traces", content=body, headers=_HEADERS, timeout=300)
                return r.status_code, time.monotonic() - t0

            with ThreadPoolExecutor(concurrent) as pool:
                answers = list(pool.map(send, range(concurrent)))
            time.sleep(1.0)
            done.set()
            sampler.join()
            after = _rss(proc)
        finally:
            server.terminate()
            server.wait(30)
    mb = 1024 * 1024
    return before / mb, peak[0] / mb, after / mb, [s for s, _ in answers], max(t for _, t in answers)


_HEADERS = {"content-type": "application/x-protobuf", "content-encoding": "gzip"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cases = [
        ("1M minimal spans, 1 request", _body(1_000_000), 1),
        ("1M minimal spans, 4 at once", None, 4),
        ("100k spans (the cap), 1 request", _body(100_000), 1),
    ]
    million = cases[0][1]
    print(f"1M-span body: {len(million or b'') / 1e6:.1f} MB gzip")
    for label, body, concurrent in cases:
        runs = [_run(body if body is not None else million or b"", concurrent) for _ in range(args.repeat)]
        before, peak, after = (statistics.median(r[i] for r in runs) for i in range(3))
        slowest = statistics.median(r[4] for r in runs)
        print(
            f"{label:<34} RSS before {before:6.0f} MB  peak {peak:6.0f} MB  after {after:6.0f} MB"
            f"  answers {sorted(set(s for r in runs for s in r[3]))}  slowest {slowest:.1f} s"
        )


if __name__ == "__main__":
    main()
