"""A user's own agent, run outside agl's runner with the one line the README gives: its spans reach the
store the environment names (or it says why not), become a rollout, and `agl rollouts list` and
`agl inspect` find it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._servers import free_port, wait_healthy

AGENT = """
import agl_langchain
from langchain_core.runnables import RunnableLambda

agl_langchain.instrument()
chain = RunnableLambda(lambda x: x + 1, name="add_one") | RunnableLambda(lambda x: x * 2, name="double")
print(chain.invoke(1))
print(chain.invoke(2))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "OTEL_"))}
    return {**env, **extra}


@pytest.fixture
def store_url(tmp_path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(tmp_path / "s.sqlite")]
        + ["--http-port", str(port), "--no-grpc", "--group-wait", "0.5", "--parse-workers", "0"],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/healthz", proc, timeout_s=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl_core.cli", *args], env=_env(), capture_output=True, text=True, timeout=120
    )


def test_instrument_alone_sends_to_agl_store_url_and_the_run_becomes_a_rollout(tmp_path, store_url):
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    run = subprocess.run(
        [sys.executable, str(agent)],
        env=_env(AGL_STORE_URL=store_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["4", "6"]
    assert "nowhere" not in run.stderr

    deadline = time.monotonic() + 60
    while True:  # grouped once each trace has been quiet for --group-wait
        listed = _cli("rollouts", "list", "--store", store_url, "--json")
        assert listed.returncode == 0, listed.stderr
        page = json.loads(listed.stdout)
        if page["total"] == 2:
            break
        assert time.monotonic() < deadline, page
        time.sleep(0.3)
    for rollout in page["rollouts"]:
        assert rollout["rollout_id"].startswith("imp-t-") and rollout["metadata"]["source"] == "live"
        assert page["span_counts"][rollout["rollout_id"]] == 3  # the sequence and its two steps
    shown = _cli("inspect", page["rollouts"][0]["rollout_id"], "--store", store_url)
    assert shown.returncode == 0, shown.stderr
    assert "add_one" in shown.stdout and "double" in shown.stdout
    stats = _cli("store", "stats", "--store", store_url)
    assert json.loads(stats.stdout)["rollouts"] == 2


def test_instrument_with_nowhere_to_send_says_what_to_set(tmp_path):
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    run = subprocess.run(
        [sys.executable, str(agent)], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("sends spans nowhere") == 1, run.stderr  # once, not per span
    assert "AGL_STORE_URL=http://127.0.0.1:4318" in run.stderr


def test_instrument_follows_the_standard_otlp_variables(tmp_path, store_url):
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    env = _env(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=store_url + "/v1/traces")
    run = subprocess.run([sys.executable, str(agent)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    deadline = time.monotonic() + 60
    while json.loads(_cli("store", "stats", "--store", store_url).stdout)["spans"] < 6:
        assert time.monotonic() < deadline
        time.sleep(0.3)


AGENT_WITHOUT_AGL = """
from langchain_core.runnables import RunnableLambda

chain = RunnableLambda(lambda x: x + 1, name="add_one") | RunnableLambda(lambda x: x * 2, name="double")
print(chain.invoke(1))
"""


def test_opentelemetry_instrument_turns_agl_capture_on_with_no_code_change(tmp_path, store_url):
    """agl's adapters are OpenTelemetry instrumentors registered under ``opentelemetry_instrumentor``: the
    real ``opentelemetry-instrument`` command records an agent that never imports agl (OpenInference's
    instrumentors, installed here too, are turned off the standard way so nothing is recorded twice)."""
    agent = tmp_path / "plain_agent.py"
    agent.write_text(AGENT_WITHOUT_AGL)
    command = Path(sys.executable).parent / "opentelemetry-instrument"
    env = _env(
        AGL_STORE_URL=store_url,
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="langchain,openai_agents,autogen_agentchat",
    )
    run = subprocess.run(
        [str(command), sys.executable, str(agent)], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["4"]
    deadline = time.monotonic() + 60
    while True:
        page = json.loads(_cli("rollouts", "list", "--store", store_url, "--json").stdout)
        if page["total"] == 1:
            break
        assert time.monotonic() < deadline, page
        time.sleep(0.3)
    (rollout,) = page["rollouts"]
    assert page["span_counts"][rollout["rollout_id"]] == 3


def test_each_adapter_is_an_opentelemetry_instrumentor():
    script = """
import agl_autogen, agl_langchain, agl_openai_agents
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

for module, cls, needs in (
    (agl_langchain, agl_langchain.LangChainInstrumentor, "langchain-core"),
    (agl_openai_agents, agl_openai_agents.OpenAIAgentsInstrumentor, "openai-agents"),
    (agl_autogen, agl_autogen.AutoGenInstrumentor, "autogen-agentchat"),
):
    instrumentor = cls()
    assert isinstance(instrumentor, BaseInstrumentor)
    assert any(d.startswith(needs) for d in instrumentor.instrumentation_dependencies())
    assert not module.is_instrumented()
    instrumentor.instrument(capture_content=True)
    assert module.is_instrumented() and instrumentor.is_instrumented_by_opentelemetry
    instrumentor.uninstrument()
    assert not module.is_instrumented()
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
