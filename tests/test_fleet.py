"""Runners on other machines: the trainer's gateway asks for a token beyond localhost, and a training run
whose rollouts run on two other hosts goes on when one of them dies mid-rollout.

The hosts are network namespaces made by the test (``ip netns``, a bridge and veth links), so each runner
reaches the store and the gateway over a real network link, as it would from another machine: the store
(PostgreSQL behind ``agl store serve``'s app, with a token), the gateway and the trainer (``agl train``
with ``runner.workers: 0``) on the bridge's address, one ``agl run`` in each namespace. The first host is
SIGKILLed while it runs rollouts; the store reclaims their attempts when the lease runs out, the other host
retries them, and the run trains every step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from agl_core.records import RolloutStatus
from agl_core.testing import GatewayServer, ScriptedBackend
from agl_trainer.config import ConfigError, TrainerConfig
from agl_trainer.run.services import advertised_url

from ._training import cli_env, marking_agent, metrics_rows

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_DSN = os.environ.get("AGL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")

# -- the gateway's token ------------------------------------------------------------------------------


def test_the_gateway_asks_for_its_token_on_every_model_request():
    with GatewayServer(ScriptedBackend(["hello", "hello"]), client_token="s3cret-token") as gateway:
        body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
        anonymous = httpx.post(f"{gateway.v1}/chat/completions", json=body)
        wrong = httpx.post(
            f"{gateway.v1}/chat/completions", json=body, headers={"authorization": "Bearer nope-nope"}
        )
        bearer = httpx.post(
            f"{gateway.v1}/chat/completions", json=body, headers={"authorization": "Bearer s3cret-token"}
        )
        api_key = httpx.post(
            f"{gateway.url}/v1/messages",
            json={"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "s3cret-token"},
        )
        models = httpx.get(f"{gateway.v1}/models")
        metrics = httpx.get(f"{gateway.url}/metrics")
        health = httpx.get(f"{gateway.url}/health")
        assert len(gateway.spans()) == 2  # the two accepted calls; a refused one reached no model
    assert anonymous.status_code == wrong.status_code == 401
    assert "needs its token" in anonymous.json()["error"]["message"]
    assert (bearer.status_code, api_key.status_code) == (200, 200)
    assert (models.status_code, metrics.status_code, health.status_code) == (401, 401, 200)


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ({"host": "10.1.2.3"}, "gateway.host '10.1.2.3' is reachable from other machines: set gateway.token"),
        ({"host": "0.0.0.0", "token": "long-enough"}, "set gateway.advertise_url"),
        ({"host": "10.1.2.3", "token": "short"}, "token"),
        ({"advertise_url": "ftp://x"}, "advertise_url"),
    ],
)
def test_a_gateway_beyond_localhost_needs_a_token_and_an_address(gateway, message, monkeypatch):
    monkeypatch.delenv("AGL_GATEWAY_TOKEN", raising=False)
    with pytest.raises((ConfigError, ValueError)) as refused:
        TrainerConfig.model_validate({"agent": "a:b", "tasks": "t.jsonl", "gateway": gateway})
    assert message in str(refused.value)


def test_the_advertised_url_gets_the_bound_port_when_it_names_none():
    assert advertised_url(None, "http://10.0.0.1:4321") == "http://10.0.0.1:4321"
    assert advertised_url("http://gw.internal", "http://0.0.0.0:4321") == "http://gw.internal:4321"
    assert advertised_url("http://gw.internal:80/", "http://0.0.0.0:4321") == "http://gw.internal:80"


# -- two runner hosts over a real network link ----------------------------------------------------------

SUBNET = "10.231.77"
BRIDGE = "aglbr77"
HOSTS = ("aglh1", "aglh2")
STORE_TOKEN = "store-token-" + uuid.uuid4().hex[:8]
GATEWAY_TOKEN = "gateway-token-" + uuid.uuid4().hex[:8]

AGENT = marking_agent(1.5)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _teardown() -> None:
    for host in HOSTS:
        subprocess.run(["ip", "netns", "del", host], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@pytest.fixture(scope="module")
def network() -> Iterator[str]:
    """A bridge at ``SUBNET.1`` and one namespace per host (``SUBNET.2``, ``.3``) linked to it by a veth
    pair; yields the bridge's address."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    _teardown()
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for n, host in enumerate(HOSTS, start=2):
            _ip("netns", "add", host)
            _ip("link", "add", f"{host}a", "type", "veth", "peer", "name", f"{host}b")
            _ip("link", "set", f"{host}a", "master", BRIDGE)
            _ip("link", "set", f"{host}a", "up")
            _ip("link", "set", f"{host}b", "netns", host)
            _ip("-n", host, "addr", "add", f"{SUBNET}.{n}/24", "dev", f"{host}b")
            _ip("-n", host, "link", "set", f"{host}b", "up")
            _ip("-n", host, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _teardown()
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.strip()}")
    try:
        yield f"{SUBNET}.1"
    finally:
        _teardown()


@pytest.fixture
def postgres_store(network: str) -> Iterator[str]:
    """``agl store serve``'s app on PostgreSQL (a schema of its own), with a token, on the bridge."""
    from agl_core.store.postgres import PostgresStore
    from agl_core.store.service import StoreService

    schema = f"agl_fleet_{uuid.uuid4().hex[:10]}"
    store = PostgresStore(POSTGRES_DSN, schema=schema)
    service = StoreService(store, token=STORE_TOKEN, parse_workers=0, maintenance_interval_s=0.5)
    url = service.start_http_background(network, 0)
    service.start_maintenance()
    try:
        yield url
    finally:
        service.close()
        store.close()
        import psycopg

        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def _runner(host: str, store_url: str, agent_dir: Path, marks: Path) -> subprocess.Popen[str]:
    """``agl run`` in the namespace ``host``; its output goes to ``<marks>/../<host>.log``."""
    with (marks.parent / f"{host}.log").open("w") as log:
        return _start(host, store_url, agent_dir, marks, log)


def _start(host: str, store_url: str, agent_dir: Path, marks: Path, log: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            host,
            sys.executable,
            "-m",
            "agl_core.cli",
            "run",
            "fleet_agent:solve",
            "--store",
            store_url,
            "--token",
            STORE_TOKEN,
            "--workers",
            "2",
            "--lease",
            "2",
            "--path",
            str(agent_dir),
            "--report-every",
            "0",
        ],  # fmt: skip
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(AGL_TEST_MARKS=str(marks)),
    )


def test_training_goes_on_when_a_runner_host_dies_mid_rollout(network, postgres_store, tmp_path):
    agent_dir, marks = tmp_path, tmp_path / "marks"  # the agent beside the config, as the trainer expects
    marks.mkdir()
    (agent_dir / "fleet_agent.py").write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "q": f"count to {i}"}) + "\n" for i in range(8)))
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "agent": "fleet_agent:solve",
                "tasks": {"train": str(tasks)},
                "output_dir": str(tmp_path / "run"),
                "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
                "store": {"url": postgres_store},
                "gateway": {"host": network, "default_max_tokens": 4},
                "runner": {"workers": 0, "max_attempts": 3, "step_timeout_s": 120},
                "train": {"steps": 3, "tasks_per_step": 2, "rollouts_per_task": 2},
                "logging": {"plot": False, "tensorboard": False, "progress": "plain"},
            }
        )
    )
    trainer = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "AGL_STORE_TOKEN": STORE_TOKEN, "AGL_GATEWAY_TOKEN": GATEWAY_TOKEN},
    )
    first, second = (_runner(host, postgres_store, agent_dir, marks) for host in HOSTS)
    try:
        # kill the first host while one of its rollouts runs (its agent process marks it)
        deadline = time.monotonic() + 300
        while not any(m.name.startswith(f"{first.pid}-") for m in marks.iterdir()):
            assert trainer.poll() is None, trainer.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the first host never ran a rollout"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        # the gateway on the bridge refuses a request from a host without its token
        anonymous = subprocess.run(
            ["ip", "netns", "exec", HOSTS[1], sys.executable, "-c",
             "import sys, httpx; print(httpx.get(sys.argv[1] + '/v1/models').status_code)",
             _gateway_url(postgres_store)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert anonymous.stdout.strip() == "401", anonymous.stdout + anonymous.stderr
        out, _ = trainer.communicate(timeout=600)
    finally:
        for proc in (trainer, first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert trainer.returncode == 0, out[-3000:]
    rows = [r for r in metrics_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollouts"] == 4 and r["rollouts_failed"] == 0 for r in rows), rows

    from agl_core.store import StoreClient

    client = StoreClient(postgres_store, token=STORE_TOKEN)
    try:
        rollouts = client.get_rollouts([rid for r in rows for rid in r["rollout_ids"]])
    finally:
        client.close()
    retried = [r for r in rollouts if len(r.attempts) > 1]
    # the killed host's attempts were reclaimed by the store and run again by the other host
    assert retried, "no attempt of the killed host was retried"
    for r in retried:
        assert r.status == RolloutStatus.SUCCEEDED
        assert r.attempts[0].status != RolloutStatus.SUCCEEDED
        assert r.attempts[-1].status == RolloutStatus.SUCCEEDED
        assert r.attempts[0].worker_id != r.attempts[-1].worker_id


def _gateway_url(store_url: str) -> str:
    """The gateway URL the trainer published to the runners (the store's ``llm`` resource)."""
    from agl_core.runner import LLM_RESOURCE
    from agl_core.store import StoreClient

    client = StoreClient(store_url, token=STORE_TOKEN)
    try:
        resource = client.get_resource(LLM_RESOURCE)
    finally:
        client.close()
    assert resource is not None
    return str(resource.value["base_url"])
