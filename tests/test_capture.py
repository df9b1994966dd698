"""Production capture: the gateway with no runner records each call under the rollout of its session and
registers that rollout in the real store (SQLite behind its HTTP server, with a token); the real openai and
anthropic clients make the calls."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from agl_core import semconv
from agl_core.cli import main
from agl_core.gateway._door import SessionHint
from agl_core.gateway._schema import RequestError
from agl_core.gateway.capture import SESSION_ID_MAX_LENGTH, Capture, captured_session
from agl_core.importer import import_traces, session_rollout_id, trace_rollout_id
from agl_core.pipeline.transitions import NOT_TRAINABLE, spans_to_transitions
from agl_core.records import RolloutStatus
from agl_core.store import NotFoundError
from agl_core.testing import Collector, GatewayServer, ScriptedBackend

TOKEN = "capture-test-token"
HEADER = semconv.HEADER_SESSION_ID
MODEL = "scripted"
TRACE = bytes(range(1, 17))


@pytest.fixture
def collector() -> Iterator[Collector]:
    with Collector(token=TOKEN) as running:
        yield running


@pytest.fixture
def gateway(collector: Collector) -> Iterator[GatewayServer]:
    capture = Capture(collector.url, token=TOKEN, debounce_s=0.01)
    backend = ScriptedBackend(model_name=MODEL)
    with GatewayServer(backend, export_to=collector.url, token=TOKEN, capture=capture) as served:
        yield served


def _openai(gateway: GatewayServer, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.v1, api_key="x", max_retries=0, **kwargs)


def _ask(client: openai.OpenAI, text: str, **kwargs: Any) -> str:
    """A chat call; the response id the client got."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **kwargs
    )
    return reply.id


def _span(gateway: GatewayServer, response_id: str) -> ReadableSpan:
    (span,) = gateway.spans(response_id)
    return span


def _attrs(gateway: GatewayServer, response_id: str) -> dict[str, Any]:
    return dict(_span(gateway, response_id).attributes or {})


# -- the session of a call ------------------------------------------------------------------------------


def test_the_session_is_the_header_then_metadata_then_the_trace_then_the_user():
    everything = SessionHint(("metadata.session_id", "meta"), ("user", "alice"))
    assert captured_session("hdr", everything, TRACE).session_id == "hdr"  # type: ignore[union-attr]
    assert captured_session(None, everything, TRACE).session_id == "meta"  # type: ignore[union-attr]
    by_trace = captured_session(None, SessionHint(user=("user", "alice")), TRACE)
    assert by_trace is not None and by_trace.session_id is None
    assert by_trace.rollout_id == trace_rollout_id(TRACE) == "imp-t-" + TRACE.hex()
    assert by_trace.metadata == {"source": "gateway", "named_by": "traceparent", "trace_id": TRACE.hex()}
    by_user = captured_session(None, SessionHint(user=("metadata.user_id", "bob")), None)
    assert by_user is not None and by_user.rollout_id == session_rollout_id("bob")
    assert by_user.metadata == {"source": "gateway", "named_by": "metadata.user_id", "session.id": "bob"}
    assert captured_session(None, SessionHint(), None) is None
    longest = captured_session(None, SessionHint(("metadata.session_id", "é" * SESSION_ID_MAX_LENGTH)), None)
    assert longest is not None and longest.session_id == "é" * 512
    utf8_header = captured_session("é".encode().decode("latin-1"), SessionHint(), None)  # as received
    assert utf8_header is not None and utf8_header.session_id == "é"
    with pytest.raises(RequestError) as refused:
        captured_session(None, SessionHint(("metadata.session_id", "x" * 513)), None)
    assert refused.value.param == "metadata.session_id" and "more than 512" in str(refused.value)


def test_each_way_of_naming_a_session_makes_one_rollout_in_the_store(gateway, collector):
    by_header = _openai(gateway, default_headers={HEADER: "conv-header"})
    plain = _openai(gateway)
    header_calls = [_ask(by_header, "one")]
    stream = by_header.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two"}], stream=True
    )
    header_calls.append([chunk.id for chunk in stream][0])
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
    message = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "three"}],
        extra_headers={HEADER: "conv-header"},
    )
    header_calls.append(message.id)
    meta_calls = [
        _ask(plain, "four", metadata={"session_id": "conv-meta"}),
        plain.responses.create(model=MODEL, input="five", metadata={"session_id": "conv-meta"}).id,
    ]
    agent = TracerProvider()
    agent.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    with agent.get_tracer("my-agent").start_as_current_span("agent run") as run:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        trace_calls = [
            _ask(plain, "six", extra_headers=carrier),
            plain.responses.create(model=MODEL, input="seven", extra_headers=carrier).id,
        ]
    trace_id = run.get_span_context().trace_id
    user_call = _ask(plain, "eight", user="alice")
    # anthropic 2.x traces its own calls and, with a tracer provider registered (as earlier tests leave
    # one), sends each call's traceparent, which outranks a user (docs/gateway.md): off for this call
    quiet_claude = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0, open_telemetry=False)
    claude_user = quiet_claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "nine"}],
        metadata={"user_id": "bob"},
    ).id
    unnamed = _ask(plain, "ten")

    expected = {
        session_rollout_id("conv-header"): (header_calls, "conv-header", HEADER),
        session_rollout_id("conv-meta"): (meta_calls, "conv-meta", "metadata.session_id"),
        trace_rollout_id(trace_id.to_bytes(16, "big")): (trace_calls, None, "traceparent"),
        session_rollout_id("alice"): ([user_call], "alice", "user"),
        session_rollout_id("bob"): ([claude_user], "bob", "metadata.user_id"),
    }
    for rollout_id, (calls, session, _) in expected.items():
        for response_id in calls:
            attrs = _attrs(gateway, response_id)
            assert attrs[semconv.ROLLOUT_ID] == rollout_id
            assert attrs.get(semconv.SESSION_ID) == session
            assert semconv.ATTEMPT_ID not in attrs
    for response_id in trace_calls:  # the gateway's span is in the agent's own trace
        assert _span(gateway, response_id).context.trace_id == trace_id
    unnamed_attrs = _attrs(gateway, unnamed)
    assert semconv.ROLLOUT_ID not in unnamed_attrs and semconv.SESSION_ID not in unnamed_attrs

    assert gateway.capture.flush()
    stored = {r.rollout_id: r for r in collector.client.get_rollouts(list(expected))}
    assert set(stored) == set(expected)
    for rollout_id, (calls, session, named_by) in expected.items():
        rollout = stored[rollout_id]
        assert rollout.status == RolloutStatus.SUCCEEDED and rollout.task_id == rollout_id
        assert rollout.metadata["source"] == "gateway" and rollout.metadata["named_by"] == named_by
        if session is not None:
            assert rollout.metadata["session.id"] == session
        spans = collector.spans(rollout_id)
        assert sorted(s.attributes[semconv.GEN_AI_RESPONSE_ID] for s in spans) == sorted(calls)
    assert gateway.capture.registered == len(expected)  # once per session, not per call
    metrics = httpx.get(f"{gateway.url}/metrics").text  # what capture did, for the operator
    assert f"agl_gateway_captured_sessions_registered_total {gateway.capture.registered}\n" in metrics
    assert "agl_gateway_captured_sessions_pending 0\n" in metrics
    assert "agl_gateway_captured_sessions_dropped_total 0\n" in metrics
    captured = re.search(r"^agl_gateway_captured_calls_total (\d+)$", metrics, re.M)
    assert captured is not None and int(captured.group(1)) >= sum(len(c) for c, _, _ in expected.values())


def test_a_captured_session_trains_with_a_late_reward(gateway, collector):
    client = _openai(gateway, default_headers={HEADER: "thumbs-up-later"})
    calls = [_ask(client, f"turn {i}") for i in range(2)]
    rollout_id = session_rollout_id("thumbs-up-later")
    assert gateway.capture.flush()
    reward = collector.client.add_reward(1.0, rollout_id=rollout_id, source="user", reward_id="thumbs-1")
    assert reward.rollout_id == rollout_id
    result = spans_to_transitions(collector.spans(rollout_id))
    assert result.problems == ()
    assert len(result.transitions) == 2
    for transition, response_id in zip(result.transitions, calls, strict=True):
        attrs = _attrs(gateway, response_id)
        assert transition.rollout_id == rollout_id and transition.reward == 1.0
        assert transition.prompt_ids == tuple(attrs[semconv.PROMPT_TOKEN_IDS])
        assert transition.response_ids == tuple(attrs[semconv.RESPONSE_TOKEN_IDS])
        assert transition.response_logprobs == tuple(attrs[semconv.RESPONSE_LOGPROBS])
    decoded = gateway.backend.tokenizer.decode(list(result.transitions[1].response_ids))
    assert decoded.startswith("turn 1")


def test_the_same_session_imported_from_a_file_joins_the_captured_rollout(gateway, collector, tmp_path):
    agent_spans = InMemorySpanExporter()
    agent = TracerProvider()
    agent.add_span_processor(SimpleSpanProcessor(agent_spans))
    tracer = agent.get_tracer("my-agent")
    client = _openai(gateway)
    with tracer.start_as_current_span("agent step", attributes={semconv.SESSION_ID: "support-42"}):
        captured = _ask(client, "hello", extra_headers={HEADER: "support-42"})
    with tracer.start_as_current_span("other agent run") as run:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        traced = _ask(client, "hi", extra_headers=carrier)
    assert gateway.capture.flush()
    path = tmp_path / "agent-traces.pb"
    path.write_bytes(encode_spans(agent_spans.get_finished_spans()).SerializeToString())

    summary = import_traces([path], collector.url, token=TOKEN)

    assert summary.exit_code == 0 and summary.new_spans == 2
    session_rollout = session_rollout_id("support-42")
    names = sorted(s.name for s in collector.spans(session_rollout))
    assert names == ["agent step", f"chat {MODEL}"]
    assert _attrs(gateway, captured)[semconv.ROLLOUT_ID] == session_rollout
    trace_rollout = trace_rollout_id(run.get_span_context().trace_id.to_bytes(16, "big"))
    assert sorted(s.name for s in collector.spans(trace_rollout)) == [f"chat {MODEL}", "other agent run"]
    assert _attrs(gateway, traced)[semconv.ROLLOUT_ID] == trace_rollout
    # the records the gateway registered first are kept as they were
    for rollout in collector.client.get_rollouts([session_rollout, trace_rollout]):
        assert rollout.metadata["source"] == "gateway"


@pytest.mark.timing
def test_a_store_that_is_down_neither_fails_nor_slows_the_call(caplog):
    # bound and listening, not yet answering: a registration hangs until its timeout
    store = Collector(token=TOKEN)
    capture = Capture(store.url, token=TOKEN, debounce_s=0.01, retry_s=0.05, max_retry_s=0.2, timeout_s=1.0)
    caplog.set_level(logging.WARNING, logger="agl_core.gateway.capture")
    try:
        with GatewayServer(ScriptedBackend(model_name=MODEL), capture=capture) as gateway:
            client = _openai(gateway, default_headers={HEADER: "while-down"})
            for i in range(3):
                started = time.monotonic()
                _ask(client, f"call {i}")
                assert time.monotonic() - started < 0.5
            rollout_id = session_rollout_id("while-down")
            assert capture.pending() == [rollout_id]
            deadline = time.monotonic() + 10
            while "cannot register" not in caplog.text:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.3)  # a few more failed tries
            store.start()
            assert capture.flush(timeout_s=15)
            (rollout,) = store.client.get_rollouts([rollout_id])
            assert rollout.metadata["source"] == "gateway" and capture.registered == 1
    finally:
        store.stop()
    assert caplog.text.count("cannot register") == 1  # logged once for the whole outage
    assert "answers again" in caplog.text


@pytest.mark.parametrize(
    "path, body, headers, field",
    [
        ("/v1/chat/completions", {}, {HEADER: "x" * (SESSION_ID_MAX_LENGTH + 1)}, HEADER),
        ("/v1/chat/completions", {}, {HEADER: b"\xff\xfe"}, HEADER),
        ("/v1/chat/completions", {"metadata": {"session_id": "a\u0007b"}}, {}, "metadata.session_id"),
        ("/v1/chat/completions", {"metadata": {"session_id": 42}}, {}, "metadata.session_id"),
        ("/v1/chat/completions", {"metadata": {"session_id": "next\u0085line"}}, {}, "metadata.session_id"),
        ("/v1/chat/completions", {"user": ""}, {}, "user"),
        ("/v1/responses", {"metadata": {"session_id": "s" * 600}}, {}, "metadata.session_id"),
        ("/v1/responses", {"user": "line\nbreak"}, {}, "user"),
        ("/v1/messages", {"metadata": {"user_id": "tab\there"}}, {}, "metadata.user_id"),
        ("/v1/messages", {"metadata": {"session_id": ""}}, {}, "metadata.session_id"),
        ("/v1/messages", {}, {HEADER: "y" * 1000}, HEADER),
        ("/v1/chat/completions", {}, {HEADER: "line\u2028sep".encode()}, HEADER),
        ("/v1/responses", {"metadata": {"session_id": "abc\u202edef"}}, {}, "metadata.session_id"),
        ("/v1/messages", {"metadata": {"user_id": "zero\u200bwidth"}}, {}, "metadata.user_id"),
    ],
)
def test_a_bad_session_value_is_refused_in_the_protocols_shape(gateway, path, body, headers, field):
    if path == "/v1/chat/completions":
        request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    elif path == "/v1/responses":
        request = {"model": MODEL, "input": "hi", **body}
    else:
        request = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    response = httpx.post(gateway.url + path, json=request, headers=headers)
    assert response.status_code == 400
    error = response.json()
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"]
    else:
        assert error["error"]["param"] == field and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"]
    assert gateway.spans() == [] and gateway.capture.pending() == []


@pytest.mark.parametrize("raw", [b"a\x01b", b"a\x7fb", b"a\x00b"])
def test_a_control_character_in_the_session_header_gets_a_json_error_naming_it(gateway, raw):
    """HTTP itself forbids these bytes in a header, so the server refuses the request before the app: the
    400 is still JSON in the shape OpenAI and Anthropic clients read, and says what was wrong."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + HEADER.encode()
            + b": "
            + raw
            + b"\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    error = json.loads(payload)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "control character" in error["error"]["message"] and HEADER in error["error"]["message"]
    assert gateway.spans() == [] and gateway.capture.pending() == []


def test_a_call_that_names_a_rollout_is_never_reattributed(gateway, collector):
    scoped = openai.OpenAI(
        base_url=gateway.base_url("ro-run", "at-1"),
        api_key="x",
        max_retries=0,
        default_headers={HEADER: "someone-elses"},
    )
    by_url = _ask(scoped, "one", metadata={"session_id": "meta"}, user="alice")
    plain = _openai(gateway)
    by_header = _ask(plain, "two", extra_headers={semconv.HEADER_ROLLOUT_ID: "ro-hdr", HEADER: "x" * 5000})
    claude = anthropic.Anthropic(
        base_url=gateway.base_url("ro-claude").removesuffix("/v1"), api_key="x", max_retries=0
    )
    by_claude = claude.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "3"}], metadata={"user_id": "bob"}
    ).id
    for response_id, rollout_id in (by_url, "ro-run"), (by_header, "ro-hdr"), (by_claude, "ro-claude"):
        attrs = _attrs(gateway, response_id)
        assert attrs[semconv.ROLLOUT_ID] == rollout_id and semconv.SESSION_ID not in attrs
    assert _attrs(gateway, by_url)[semconv.ATTEMPT_ID] == "at-1"
    assert gateway.capture.flush() and gateway.capture.registered == 0
    with pytest.raises(NotFoundError):  # no rollout record was made for them
        collector.client.get_rollouts(["ro-run", "ro-hdr", "ro-claude"])


def test_without_capture_a_call_is_recorded_as_before(collector):
    with GatewayServer(ScriptedBackend(model_name=MODEL), export_to=collector.url, token=TOKEN) as gateway:
        client = _openai(gateway, default_headers={HEADER: "ignored"})
        response_id = _ask(client, "hi", metadata={"session_id": "\u0007 not checked"}, user="")
        attrs = _attrs(gateway, response_id)
    assert semconv.ROLLOUT_ID not in attrs and semconv.SESSION_ID not in attrs
    (stored,) = collector.spans()
    assert stored.rollout_id is None


# -- agl gateway serve --capture ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _registered(collector: Collector, rollout_id: str) -> bool:
    try:
        return bool(collector.client.get_rollouts([rollout_id]))
    except NotFoundError:
        return False


def test_capture_beyond_localhost_needs_an_admin_token(capsys):
    argv = ["gateway", "serve", "--backend", "openai", "--upstream", "http://h/v1", "--upstream-model", "m"]
    assert main([*argv, "--capture", "--host", "0.0.0.0", "--insecure-no-admin-token"]) == 2
    assert "--capture on --host 0.0.0.0 needs an admin token" in capsys.readouterr().err


def test_agl_gateway_serve_capture_in_front_of_an_openai_compatible_server(collector):
    port = _free_port()
    # the production model: any OpenAI-compatible server (here another gateway, its token ids unseen)
    with GatewayServer(ScriptedBackend(model_name=MODEL)) as upstream:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "OTEL_"))}
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agl_core.cli",
                "gateway",
                "serve",
                "--backend",
                "openai",
                "--upstream",
                upstream.v1,
                "--upstream-model",
                MODEL,
                "--port",
                str(port),
                "--capture",
                "--store-url",
                collector.url,
                "--store-token",
                TOKEN,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.1)
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            response_id = _ask(client, "ping", extra_headers={HEADER: "cli-session"})
            rollout_id = session_rollout_id("cli-session")
            deadline = time.monotonic() + 15
            while not (_registered(collector, rollout_id) and collector.spans(rollout_id)):
                assert time.monotonic() < deadline, "the session did not reach the store"
                time.sleep(0.1)
        finally:
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=30)
    assert process.returncode == 143, err  # the shell's code for a process SIGTERM ended
    assert "agl gateway serve: stopped by SIGTERM; the spans of the calls it answered were sent to" in err
    assert "capturing sessions as rollouts" in out
    (rollout,) = collector.client.get_rollouts([rollout_id])
    assert rollout.metadata == {"source": "gateway", "named_by": HEADER, "session.id": "cli-session"}
    (span,) = collector.spans(rollout_id)
    assert span.attributes[semconv.GEN_AI_RESPONSE_ID] == response_id
    assert span.attributes[semconv.SESSION_ID] == "cli-session"
    assert span.attributes[semconv.TRAINABLE] is False  # an external model's calls carry no token ids
    collector.client.add_reward(1.0, rollout_id=rollout_id)
    result = spans_to_transitions(collector.spans(rollout_id))
    assert result.transitions == () and NOT_TRAINABLE in result.reasons()


def test_the_answer_names_the_rollout_the_call_was_recorded_in(gateway):
    """``x-agl-rollout-id`` on the answer: the captured session's rollout (JSON and streamed), the rollout
    the caller named, none for a call in no rollout."""
    plain = _openai(gateway)
    raw = plain.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_headers={HEADER: "conv-9"}
    )
    assert raw.headers[semconv.HEADER_ROLLOUT_ID] == session_rollout_id("conv-9")
    with plain.chat.completions.with_streaming_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, user="carol"
    ) as streamed:
        assert streamed.headers[semconv.HEADER_ROLLOUT_ID] == session_rollout_id("carol")
        list(streamed.iter_lines())
    named = plain.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={semconv.HEADER_ROLLOUT_ID: "ro-7"},
    )
    assert named.headers[semconv.HEADER_ROLLOUT_ID] == "ro-7"
    with GatewayServer(ScriptedBackend(model_name=MODEL)) as bare:
        answer = _openai(bare).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert semconv.HEADER_ROLLOUT_ID not in answer.headers
