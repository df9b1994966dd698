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
