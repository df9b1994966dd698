"""The gateway under hostile input: admin token, oversized bodies, unknown routes, public addresses."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from agl_core.gateway import create_gateway_app
from agl_core.server import BackgroundServer
from agl_core.testing import GatewayServer, ScriptedBackend


class _PolicyBackend(ScriptedBackend):
    """A scripted backend that accepts new policy versions (records them)."""

    def __init__(self) -> None:
        super().__init__(["ok"])
        self.updates: list[object] = []

    async def update_policy(self, update: object) -> None:
        self.updates.append(update)


_POLICY = {"version": 3, "path": "/tmp/adapter", "kind": "lora"}


def test_admin_token_needs_the_bearer_prefix_and_non_ascii_is_a_401():
    backend = _PolicyBackend()
    with GatewayServer(backend, admin_token="s3cret") as gateway, httpx.Client() as http:
        url = gateway.url + "/agl/v1/policy"
        bare = http.post(url, json=_POLICY, headers={"authorization": "s3cret"})
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
        odd = http.post(url, json=_POLICY, headers={"authorization": "Bearer s3cr\u00e9t".encode("latin-1")})
        assert odd.status_code == 401
        assert backend.updates == []
        ok = http.post(url, json=_POLICY, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json() == {"policy_version": 3}
        assert len(backend.updates) == 1


class _VersionedBackend(_PolicyBackend):
    """Serves a policy version; loads one of a path ending in "bad" with an error, as a backend refuses
    an adapter that does not fit."""

    policy_version = 0

    async def update_policy(self, update: object) -> None:
        from agl_core.gateway.backend import BackendError

        if str(getattr(update, "path", "")).endswith("bad"):
            raise BackendError("the adapter does not fit the served model")
        await super().update_policy(update)
        self.policy_version = int(getattr(update, "version", 0))


def test_every_publish_is_a_log_line_and_the_served_version_a_gauge(caplog):
    caplog.set_level("INFO", logger="agl_core.gateway.policy")
    with GatewayServer(_VersionedBackend()) as gateway, httpx.Client() as http:
        url = gateway.url + "/agl/v1/policy"
        assert http.post(url, json=_POLICY).status_code == 200
        refused = http.post(url, json={**_POLICY, "version": 4, "path": "/tmp/bad"})
        assert refused.status_code == 500 and "does not fit" in refused.json()["error"]["message"]
        metrics = http.get(gateway.url + "/metrics").text
    assert "agl_gateway_policy_version 3" in metrics  # the refused v4 left v3 serving
    assert "agl_gateway_policy_changes_total 1" in metrics
    assert "agl_gateway_policy_refused_total 1" in metrics
    loaded_at = [
        line for line in metrics.splitlines() if line.startswith("agl_gateway_policy_loaded_timestamp")
    ]
    assert loaded_at and float(loaded_at[0].split()[-1]) > 1.7e9
    lines = [r.getMessage() for r in caplog.records if r.name == "agl_core.gateway.policy"]
    assert lines == [
        "now serving policy v3 (lora weights from /tmp/adapter), replacing v0",
        "policy v4 (lora) refused: the adapter does not fit the served model",
    ]


def test_policy_body_must_be_an_object():
    with GatewayServer(_PolicyBackend()) as gateway:
        for body in (b"[1]", b"5", b"null", b'"x"'):
            r = httpx.post(gateway.url + "/agl/v1/policy", content=body)
            assert r.status_code == 400, body


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/agl/v1/policy"])
def test_oversized_chunked_body_is_refused_without_reading_it_all(path):
    """The app stops taking body chunks at the 8 MB limit; counted at the ASGI boundary."""
    app = create_gateway_app(_PolicyBackend())
    taken = 0

    async def counting(scope, receive, send):
        async def counted():
            nonlocal taken
            message = await receive()
            taken += len(message.get("body", b""))
            return message

        await app(scope, counted, send)

    chunk = b"x" * (1024 * 1024)
    with BackgroundServer(counting) as server, httpx.Client(timeout=60) as http:
        r = http.post(
            server.url + path,
            content=(chunk for _ in range(100)),  # 100 MB, chunked
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        assert taken <= 9 * 1024 * 1024, f"the gateway read {taken} bytes of an oversized body"
        assert http.get(server.url + "/health").status_code == 200


def test_declared_length_over_the_limit_is_refused_before_reading():
    with GatewayServer(_PolicyBackend()) as gateway, httpx.Client(timeout=10) as http:
        big = b"{" + b" " * (9 * 1024 * 1024) + b"}"
        r = http.post(
            gateway.url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"}
        )
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_routes_and_methods_answer_json():
    with GatewayServer(_PolicyBackend()) as gateway, httpx.Client() as http:
        missing = http.get(gateway.url + "/v2/nothing")
        assert missing.status_code == 404 and "no endpoint" in missing.json()["error"]["message"]
        wrong = http.get(gateway.url + "/v1/chat/completions")
        assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
        assert "POST" in wrong.json()["error"]["message"]


def _gateway_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "agl_core.cli", "gateway", "serve", "--backend", "openai"]
    command += ["--upstream", "http://127.0.0.1:9/v1", "--upstream-model", "m", "--port", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def test_gateway_refuses_a_public_address_without_an_admin_token():
    done = _gateway_serve("--host", "0.0.0.0")
    assert done.returncode == 2
    assert "--admin-token" in done.stderr and "AGL_GATEWAY_ADMIN_TOKEN" in done.stderr
    assert "Traceback" not in done.stderr
    empty = _gateway_serve("--host", "0.0.0.0", "--admin-token", " ")
    assert empty.returncode == 2 and "empty" in empty.stderr


def test_store_refuses_a_public_address_without_a_token(tmp_path):
    command = [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(tmp_path / "s.sqlite")]
    done = subprocess.run(
        [*command, "--host", "0.0.0.0", "--http-port", "1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--token" in done.stderr and "AGL_STORE_TOKEN" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "s.sqlite").exists()


def _fn(**function: object) -> dict[str, object]:
    return {"type": "function", "function": {"name": "lookup", **function}}


@pytest.mark.parametrize(
    "tools",
    [
        "lookup",  # not a list
        ["lookup"],  # a tool that is not an object
        [{"type": "retrieval", "function": {"name": "lookup"}}],  # not a function tool
        [{"type": "function", "function": {}}],  # no name
        [_fn(name="look up!")],  # characters OpenAI refuses
        [_fn(name="x" * 65)],  # over 64 characters
        [_fn(parameters="{}")],  # parameters not an object
        [_fn(parameters={"type": "dict"})],  # not a JSON Schema type
        [_fn(parameters={"type": "object", "properties": ["q"]})],  # properties not a mapping
        [_fn(parameters={"type": "object", "required": "q"})],  # required not a list
        [_fn(), _fn()],  # the same name twice
    ],
)
def test_invalid_tool_schemas_are_refused_before_the_backend(tools):
    backend = ScriptedBackend(["never"])
    with GatewayServer(backend) as gateway:
        r = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": tools},
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "tools" in r.json()["error"]["message"]
    assert backend.calls == 0


def test_a_valid_tool_schema_is_served():
    backend = ScriptedBackend(["fine"])
    tool = _fn(description="find", parameters={"type": "object", "properties": {"q": {"type": "string"}}})
    with GatewayServer(backend) as gateway:
        r = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]},
        )
    assert r.status_code == 200 and backend.calls == 1


# -- tool-count bombs and the previous_response_id history (round three) -----------------------------


def _many_tools(count: int, shape: str) -> list[dict[str, object]]:
    params = {"type": "object", "properties": {}}
    if shape == "chat":
        return [
            {"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(count)
        ]
    if shape == "responses":
        return [{"type": "function", "name": f"f{i}", "parameters": params} for i in range(count)]
    return [{"name": f"f{i}", "input_schema": params} for i in range(count)]


_TOOL_DOORS = [
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", "responses", {"input": "hi"}),
    ("/v1/messages", "anthropic", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize(("path", "shape", "body"), _TOOL_DOORS)
def test_twenty_thousand_tools_are_refused_naming_the_bound(path, shape, body):
    """20,000 tools (about 1 MB) once took 73 s on /v1/responses with /health blocked (a quadratic
    duplicate check on the event loop): now a 400 naming the bound, the backend never called."""
    backend = ScriptedBackend(["ok"])
    with GatewayServer(backend) as gateway:
        r = httpx.post(
            gateway.url + path,
            json={"model": "scripted", **body, "tools": _many_tools(20_000, shape)},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert "at most 128 tools per request, got 20000" in r.text
        assert httpx.get(gateway.url + "/health").status_code == 200
    assert backend.calls == 0


@pytest.mark.parametrize(("path", "shape", "body"), _TOOL_DOORS)
def test_a_repeated_tool_name_among_128_is_named(path, shape, body):
    tools = _many_tools(128, shape)
    tools[-1] = tools[3]
    backend = ScriptedBackend(["ok"])
    with GatewayServer(backend) as gateway:
        r = httpx.post(gateway.url + path, json={"model": "scripted", **body, "tools": tools})
    assert r.status_code == 400 and "repeated: f3" in r.text
    assert backend.calls == 0


def test_health_answers_while_a_heavy_body_is_parsed(monkeypatch):
    """A body over 256 KiB is parsed on a worker thread: while its parse is held, /health still answers
    (on the event loop, the held parse would block it and the health check would time out)."""
    import threading

    from agl_core.gateway import _door

    entered, released = threading.Event(), threading.Event()
    real = _door.parse_chat

    def held(raw: bytes):  # type: ignore[no-untyped-def]
        entered.set()
        assert released.wait(60)
        return real(raw)

    monkeypatch.setattr(_door, "parse_chat", held)
    backend = ScriptedBackend(["ok"])
    messages = [{"role": "user", "content": "x" * 100} for _ in range(3_000)]  # about 350 KB of JSON
    with GatewayServer(backend) as gateway:
        answers: list[int] = []
        poster = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    gateway.url + "/v1/chat/completions",
                    json={"model": "scripted", "messages": messages, "max_tokens": 4},
                    timeout=120,
                ).status_code
            )
        )
        poster.start()
        assert entered.wait(60)
        try:
            assert httpx.get(gateway.url + "/health", timeout=20).status_code == 200
        finally:
            released.set()
            poster.join()
    assert answers == [200] and backend.calls == 1


def test_the_response_log_is_bounded_by_bytes():
    from agl_core.gateway.protocols.responses import ResponseLog

    log = ResponseLog(capacity=4096, max_bytes=100_000)
    big = [{"role": "user", "content": "y" * 30_000}]
    for i in range(10):
        log.put((None, None), f"r{i}", big)
    assert log.bytes <= 100_000 and len(log) == 3  # the three newest
    assert log.get((None, None), "r9") == big and log.get((None, None), "r0") is None
    log.put((None, None), "huge", [{"role": "user", "content": "z" * 200_000}])  # over the bound alone
    assert log.get((None, None), "huge") is None and len(log) == 3
    with pytest.raises(ValueError, match="max_bytes"):
        ResponseLog(max_bytes=0)


def test_a_client_that_goes_away_stops_its_generation_and_is_counted():
    """Non-streamed calls once kept generating after their client was killed (9-15 requests stayed in
    flight, competing for the backend). The generation is now stopped and the call recorded as such."""
    import asyncio
    import threading

    from agl_core.gateway.backend import ChatRequest

    started, stopped = threading.Event(), threading.Event()

    class _Slow(ScriptedBackend):
        async def generate(self, model: str, chat: ChatRequest):  # type: ignore[override]
            started.set()
            try:
                await asyncio.sleep(120)
                yield  # never reached
            finally:
                stopped.set()

    backend = _Slow(["ok"])
    with GatewayServer(backend) as gateway:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gateway.url + "/v1/chat/completions",
                json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
                timeout=httpx.Timeout(30, read=1.0),
            )
        assert started.is_set()
        assert stopped.wait(30), "the backend kept generating for a client that left"
        metrics = gateway.metrics
        for _ in range(100):
            if metrics.inflight == 0:
                break
            threading.Event().wait(0.05)
        assert (metrics.inflight, metrics.client_disconnects) == (0, 1)
        (span,) = gateway.spans()
        assert span.attributes["error.type"] == "client_disconnected"


def test_the_first_service_to_publish_owns_the_gateway_and_its_calls_say_whose_version_served_them():
    from agl_core import semconv

    backend = _VersionedBackend()
    with GatewayServer(backend) as gateway, httpx.Client() as http:
        url = gateway.url + "/agl/v1/policy"
        assert http.get(url).json() == {"policy_version": 0, "owner": None}
        assert http.post(url, json={**_POLICY, "owner": "main"}).status_code == 200
        assert http.get(url).json() == {"policy_version": 3, "owner": "main"}
        for body in ({**_POLICY, "version": 1, "owner": "staging"}, {**_POLICY, "version": 1}):
            taken = http.post(url, json=body)
            assert taken.status_code == 409, body
            assert (
                "takes its policy versions from the agl improve service 'main'"
                in taken.json()["error"]["message"]
            )
        assert backend.policy_version == 3 and len(backend.updates) == 1
        for owner in ("", "x" * 129, 7, "bad\nname"):
            assert http.post(url, json={**_POLICY, "owner": owner}).status_code == 400, owner
        chat = {"model": backend.model_names[0], "messages": [{"role": "user", "content": "hi"}]}
        assert http.post(gateway.url + "/v1/chat/completions", json=chat).status_code == 200
        served = [s for s in gateway.spans() if semconv.POLICY_VERSION in (s.attributes or {})]
        assert served and all(s.attributes[semconv.POLICY_OWNER] == "main" for s in served)
        assert "agl_gateway_policy_refused_total 2" in http.get(gateway.url + "/metrics").text
