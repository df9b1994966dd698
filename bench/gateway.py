"""Benchmark: what the agl gateway adds to an LLM call, and how many calls per second it passes.

Setup, each part in its own process: an *instant upstream* (an OpenAI-compatible server that answers at
once with a canned vLLM-style response: 8 generated tokens, their ids and logprobs, 30 prompt ids; 8 chunks
when streamed), the *gateway* in front of it with the vLLM backend (exact tokens asked for and recorded on
a span per call; spans are batched to an exporter that drops them, so the store's ingest is not measured
here), and a lean load generator (raw HTTP/1.1 on asyncio, one keep-alive connection per client).

* Added latency: p50 / p99 of client → gateway → upstream minus client → upstream directly, streamed and
  not, with 1 and 32 concurrent clients (closed loop: each client sends its next call when the last ends).
* Throughput: calls/s through the gateway with 32 clients, in front of the instant upstream and with an
  in-process backend that answers instantly (no upstream hop), and the same for LiteLLM's proxy (the
  published design's gateway) in front of the same upstream when it is installed beside agl:
  ``python -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'`` (or --litellm PATH).

* Protocols: the same call through the gateway's other front doors, the OpenAI Responses API
  (``/v1/responses``) and Anthropic Messages (``/v1/messages``), beside Chat Completions in the same run
  and against the same upstream (the gateway turns each into one chat call to it). The latency clients
  send the three protocols in turn, call by call, so that noise on a shared machine falls on all of them;
  the throughput blocks (32 clients) alternate and count the gateway's CPU time per call. Medians of the
  rounds are compared. Targets: added p50 within 1.2x of Chat Completions', and CPU time per call (the
  inverse of the calls/s a saturated gateway serves) within 1.2x of it.

Headline: the p50 latency the gateway adds to a non-streamed call with one client; target < 1 ms.

    python bench/gateway.py [--requests 2000] [--litellm .venv-litellm/bin/litellm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

TARGET_ADDED_P50_MS = 1.0
#: Responses / Messages against Chat Completions: added p50 and the gateway's CPU time per call at most
#: this many times chat's.
TARGET_PROTOCOL_RATIO = 1.2
HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent

PROMPT_IDS = list(range(1000, 1030))
TOKENS = ["Hello", ",", " world", "!", " How", " are", " you", "?"]
TOKEN_IDS = list(range(2000, 2008))
#: Sent by the load generator to every server; LiteLLM's proxy refuses to start without a master key.
API_KEY = "sk-bench-" + "5e" * 24


# -- the instant upstream (raw asyncio HTTP, so its own cost is small and the same for every path) -------


def _entry(i: int) -> dict[str, Any]:
    return {
        "token": TOKENS[i],
        "logprob": -0.1 * (i + 1),
        "bytes": list(TOKENS[i].encode()),
        "top_logprobs": [],
    }


def _upstream_bodies(model: str) -> tuple[bytes, list[bytes], bytes]:
    whole = {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "prompt_token_ids": PROMPT_IDS,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(TOKENS)},
                "finish_reason": "stop",
                "logprobs": {"content": [_entry(i) for i in range(len(TOKENS))]},
                "token_ids": TOKEN_IDS,
            }
        ],
        "usage": {
            "prompt_tokens": len(PROMPT_IDS),
            "completion_tokens": len(TOKENS),
            "total_tokens": len(PROMPT_IDS) + len(TOKENS),
        },
    }
    chunks = []
    for i in range(len(TOKENS)):
        chunk: dict[str, Any] = {
            "id": "chatcmpl-instant",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": TOKENS[i], **({"role": "assistant"} if i == 0 else {})},
                    "logprobs": {"content": [_entry(i)]},
                    "token_ids": [TOKEN_IDS[i]],
                    "finish_reason": "stop" if i == len(TOKENS) - 1 else None,
                }
            ],
        }
        if i == 0:
            chunk["prompt_token_ids"] = PROMPT_IDS
        chunks.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    models = {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "bench"}]}
    return json.dumps(whole).encode(), chunks, json.dumps(models).encode()


def _http(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


def _chunked(chunks: Sequence[bytes]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


async def _serve_upstream(port: int) -> None:
    whole, chunks, models = _upstream_bodies("policy")
    answers = {
        "whole": _http("200 OK", whole),
        "stream": _chunked(chunks),
        "models": _http("200 OK", models),
        "health": _http("200 OK", b"{}"),
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                path = head.split(b" ", 2)[1]
                if path.endswith(b"/chat/completions"):
                    key = "stream" if b'"stream":true' in body.replace(b" ", b"") else "whole"
                elif path.endswith(b"/models"):
                    key = "models"
                else:
                    key = "health"
                writer.write(answers[key])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, HOST, port, backlog=1024)
    async with server:
        await server.serve_forever()


# -- the gateway under test ----------------------------------------------------------------------------


class InstantBackend:
    """An in-process backend that answers at once with the same canned tokens (no upstream hop)."""

    kind = "instant"
    trainable = True
    model_names = ("policy",)
    policy_version = 0

    async def generate(self, model: str, request: Any) -> AsyncIterator[Any]:
        from agl_core.gateway import ChoiceDelta, Completion

        if request.stream:
            for tok in TOKENS:
                yield ChoiceDelta(0, tok)
        yield Completion(
            text="".join(TOKENS),
            finish_reason="stop",
            prompt_ids=tuple(PROMPT_IDS),
            response_ids=tuple(TOKEN_IDS),
            response_logprobs=tuple(-0.1 * (i + 1) for i in range(8)),
            policy_version=0,
            response_tokens=tuple(TOKENS),
        )


def _serve_gateway(port: int, upstream: str | None) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from agl_core.gateway import create_gateway_app
    from agl_core.gateway.vllm_backend import VLLMBackend
    from agl_core.server import serve_forever

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    backend = VLLMBackend(upstream + "/v1", model_name="policy") if upstream else InstantBackend()
    serve_forever(create_gateway_app(backend, tracer_provider=provider), HOST, port, log_level="warning")


# -- the load generator ----------------------------------------------------------------------------------


#: The same one-message call in each protocol the gateway serves: ``(path, body)``.
PROTOCOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "policy", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
    ),
    "responses": ("/v1/responses", {"model": "policy", "input": "Say hello.", "max_output_tokens": 8}),
    "messages": (
        "/v1/messages",
        {"model": "policy", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
    ),
}


def _request(port: int, stream: bool, protocol: str = "chat") -> bytes:
    path, fields = PROTOCOLS[protocol]
    body = json.dumps({**fields, **({"stream": True} if stream else {})}).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: {HOST}:{port}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {API_KEY}\r\nx-api-key: {API_KEY}\r\nanthropic-version: 2023-06-01\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length, chunked = None, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


async def _load(
    port: int, stream: bool, clients: int, total: int, protocol: str = "chat"
) -> tuple[list[float], float]:
    """Latencies (seconds) of ``total`` calls made by ``clients`` closed-loop clients, and the wall time."""
    raw = _request(port, stream, protocol)
    latencies: list[float] = []
    remaining = total

    async def client() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                writer.write(raw)
                status = await _read_response(reader)
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"port {port} answered {status}")
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, time.perf_counter() - start


def _measure(
    port: int, stream: bool, clients: int, total: int, protocol: str = "chat"
) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, calls/s), after a warm-up."""
    asyncio.run(_load(port, stream, clients, min(200, total), protocol))
    latencies, wall = asyncio.run(_load(port, stream, clients, total, protocol))
    q = statistics.quantiles(latencies, n=100)
    return q[49] * 1e3, q[98] * 1e3, len(latencies) / wall


async def _load_mixed(port: int, stream: bool, clients: int, total: int) -> dict[str, list[float]]:
    """Latencies (seconds) per protocol of ``total`` calls by ``clients`` closed-loop clients, each client
    sending the protocols of :data:`PROTOCOLS` in turn: whatever else the machine does falls on all of
    them alike."""
    raws = [(name, _request(port, stream, name)) for name in PROTOCOLS]
    latencies: dict[str, list[float]] = {name: [] for name in PROTOCOLS}
    remaining = total

    async def client(offset: int) -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection(HOST, port)
        turn = offset
        try:
            while remaining > 0:
                remaining -= 1
                name, raw = raws[turn % len(raws)]
                turn += 1
                t0 = time.perf_counter()
                writer.write(raw)
                status = await _read_response(reader)
                latencies[name].append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"{name} on port {port} answered {status}")
        finally:
            writer.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return latencies


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _compare_protocols(
    direct_port: int, gateway_port: int, gateway_pid: int, total: int, rounds: int
) -> bool:
    """Print each protocol's added p50 (1 client, the protocols interleaved call by call) and the
    gateway's CPU time per call and calls/s (32 clients, a block per protocol, blocks alternating), streamed
    and not, as medians of ``rounds`` rounds, with the ratios to Chat Completions; whether every target is
    met. Throughput is judged on the gateway's CPU time per call (calls/s with the gateway's CPU saturated
    is its inverse, and unlike wall time it does not move with other work on the machine)."""
    added: dict[tuple[str, bool], list[float]] = {}
    cpu: dict[tuple[str, bool], list[float]] = {}
    rate: dict[tuple[str, bool], list[float]] = {}
    for stream in (False, True):
        asyncio.run(_load_mixed(gateway_port, stream, 1, 200))  # warm-up
    for _ in range(rounds):
        for stream in (False, True):
            direct = _measure(direct_port, stream, 1, total)[0]
            mixed = asyncio.run(_load_mixed(gateway_port, stream, 1, total * len(PROTOCOLS)))
            for protocol, latencies in mixed.items():
                p50 = statistics.median(latencies) * 1e3
                added.setdefault((protocol, stream), []).append(p50 - direct)
            for protocol in PROTOCOLS:
                before = _cpu_seconds(gateway_pid)
                latencies, wall = asyncio.run(_load(gateway_port, stream, 32, total * 2, protocol))
                used = _cpu_seconds(gateway_pid) - before
                cpu.setdefault((protocol, stream), []).append(used / len(latencies) * 1e6)
                rate.setdefault((protocol, stream), []).append(len(latencies) / wall)
    print(
        f"\nprotocols through the gateway (vllm backend), medians of {rounds} rounds:\n"
        f"{'protocol':<12}{'mode':<8}{'added p50 ms':>14}{'x chat':>8}{'CPU us/call':>13}{'x chat':>8}"
        f"{'calls/s (32)':>14}"
    )
    ok = True
    for stream in (False, True):
        mode = "stream" if stream else "whole"
        chat_added = statistics.median(added[("chat", stream)])
        chat_cpu = statistics.median(cpu[("chat", stream)])
        for protocol in PROTOCOLS:
            a = statistics.median(added[(protocol, stream)])
            c = statistics.median(cpu[(protocol, stream)])
            r = statistics.median(rate[(protocol, stream)])
            a_ratio, c_ratio = a / chat_added, c / chat_cpu
            print(f"{protocol:<12}{mode:<8}{a:>14.3f}{a_ratio:>8.2f}{c:>13.0f}{c_ratio:>8.2f}{r:>14.0f}")
            if protocol != "chat":
                ok &= a_ratio <= TARGET_PROTOCOL_RATIO and c_ratio <= TARGET_PROTOCOL_RATIO
    return ok


# -- processes ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _wait_for(port: int, process: subprocess.Popen[bytes], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5) as sock:
                sock.sendall(f"GET /health HTTP/1.1\r\nhost: {HOST}\r\n\r\n".encode())
                if sock.recv(64):
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start within {timeout_s:.0f}s")


def _spawn(args: list[str], port: int, what: str, **kwargs: Any) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, **kwargs)
    _wait_for(port, process, what)
    return process


def _litellm(executable: str, upstream: str, port: int) -> subprocess.Popen[bytes]:
    config = Path(tempfile.mkdtemp(prefix="agl-bench-")) / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: policy\n    litellm_params:\n      model: openai/policy\n"
        f"      api_base: {upstream}/v1\n      api_key: bench\n"
        "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
        f"general_settings:\n  master_key: {API_KEY}\n"
    )
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}
    return _spawn(
        [executable, "--config", str(config), "--host", HOST, "--port", str(port), "--num_workers", "1"],
        port,
        "litellm",
        env=env,
        stderr=subprocess.DEVNULL,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--requests", type=int, default=2000, help="calls per measurement (default: %(default)s)"
    )
    parser.add_argument(
        "--litellm",
        default=str(ROOT / ".venv-litellm" / "bin" / "litellm"),
        help="LiteLLM proxy executable to compare with (skipped when missing)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating rounds of the protocol comparison (default: %(default)s)",
    )
    parser.add_argument("--role", choices=["upstream", "gateway"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstream":
        asyncio.run(_serve_upstream(args.port))
        return 0
    if args.role == "gateway":
        _serve_gateway(args.port, args.upstream)
        return 0

    me = [sys.executable, str(Path(__file__).resolve())]
    ports = {name: _free_port() for name in ("upstream", "gateway", "instant", "litellm")}
    upstream_url = f"http://{HOST}:{ports['upstream']}"
    processes = []
    try:
        processes.append(
            _spawn(
                [*me, "--role", "upstream", "--port", str(ports["upstream"])], ports["upstream"], "upstream"
            )
        )
        gateway = _spawn(
            [*me, "--role", "gateway", "--port", str(ports["gateway"]), "--upstream", upstream_url],
            ports["gateway"],
            "gateway",
        )
        processes.append(gateway)
        processes.append(
            _spawn(
                [*me, "--role", "gateway", "--port", str(ports["instant"])],
                ports["instant"],
                "gateway (instant backend)",
            )
        )
        litellm = None
        if Path(args.litellm).is_file():
            litellm = _litellm(args.litellm, upstream_url, ports["litellm"])
            processes.append(litellm)

        rows = []
        headline = None
        print(
            f"{'path':<26}{'mode':<8}{'clients':>8}{'p50 ms':>9}{'p99 ms':>9}"
            f"{'added p50':>11}{'added p99':>11}{'calls/s':>10}"
        )
        proxies = [("agl gateway (vllm)", ports["gateway"])] + (
            [("litellm proxy", ports["litellm"])] if litellm else []
        )
        for stream in (False, True):
            for clients in (1, 32):
                total = args.requests if clients == 1 else args.requests * 2
                direct = _measure(ports["upstream"], stream, clients, total)
                mode = "stream" if stream else "whole"
                print(
                    f"{'direct to upstream':<26}{mode:<8}{clients:>8}{direct[0]:>9.3f}{direct[1]:>9.3f}"
                    f"{'':>11}{'':>11}{direct[2]:>10.0f}"
                )
                for name, port in proxies:
                    via = _measure(port, stream, clients, total)
                    added = (via[0] - direct[0], via[1] - direct[1])
                    rows.append((name, mode, clients, via, added))
                    print(
                        f"{name:<26}{mode:<8}{clients:>8}{via[0]:>9.3f}{via[1]:>9.3f}{added[0]:>+11.3f}{added[1]:>+11.3f}{via[2]:>10.0f}"
                    )
                    if name.startswith("agl") and not stream and clients == 1:
                        headline = added[0]
        for stream in (False, True):
            mode = "stream" if stream else "whole"
            instant = _measure(ports["instant"], stream, 32, args.requests * 2)
            print(
                f"{'agl gateway (in-process)':<26}{mode:<8}{32:>8}{instant[0]:>9.3f}{instant[1]:>9.3f}"
                f"{'':>11}{'':>11}{instant[2]:>10.0f}"
            )
        agl_tp = next(r[3][2] for r in rows if r[0].startswith("agl") and r[1] == "whole" and r[2] == 32)
        if litellm:
            lite_tp = next(
                r[3][2] for r in rows if r[0] == "litellm proxy" and r[1] == "whole" and r[2] == 32
            )
            print(
                f"throughput in front of the instant upstream, 32 clients: agl {agl_tp:.0f} calls/s,"
                f" LiteLLM proxy {lite_tp:.0f} calls/s ({agl_tp / lite_tp:.1f}x)"
            )
        else:
            print(f"LiteLLM proxy not found at {args.litellm}: no comparison (see --litellm)")
        protocols_ok = _compare_protocols(
            ports["upstream"], ports["gateway"], gateway.pid, max(200, args.requests // 2), args.rounds
        )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
    assert headline is not None
    ok = headline < TARGET_ADDED_P50_MS
    print(
        f"gateway: {headline:.3f} ms p50 added per call (non-streamed, 1 client),"
        f" target < {TARGET_ADDED_P50_MS:g} ms: {'ok' if ok else 'MISSED'}"
    )
    print(
        f"protocols: Responses and Messages added p50 within {TARGET_PROTOCOL_RATIO:g}x of Chat Completions'"
        f" and gateway CPU time per call within {TARGET_PROTOCOL_RATIO:g}x of it:"
        f" {'ok' if protocols_ok else 'MISSED'}"
    )
    return 0 if ok and protocols_ok else 1


if __name__ == "__main__":
    sys.exit(main())
