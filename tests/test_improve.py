"""``agl improve``: the gate and live-reward decisions, the config's refusals, the state file, the
per-agent baseline for off-policy RL, and the service end to end with the tiny model: a real store
(``agl store serve``), real gateways (the gateway app over the transformers backend) and real rounds
(``train_from_traces``), through the faults a production service meets: SIGKILL mid-round, a gateway
that is down, a store that is down, a gateway that refuses the adapter."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from agl_trainer.config import ConfigError, GateConfig, config_from_dict, load_config
from agl_trainer.improve.gate import compare_live, gate_decision
from agl_trainer.improve.state import ImproveState, StateError, Version

from ._servers import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
AGL = [sys.executable, "-m", "agl_core.cli"]


# -- decisions -------------------------------------------------------------------------------------------


def test_gate_promotes_within_the_margin_and_refuses_beyond_it() -> None:
    serving = {f"t{i}": float(i % 2) for i in range(40)}
    same = dict(serving)
    better = {t: 1.0 for t in serving}
    worse = {t: 0.0 for t in serving}
    gate = GateConfig(max_drop_se=1.0, max_loss=None)  # the SE margin alone (max_loss: below)
    assert gate_decision(gate, serving, same).decision == "promoted"
    assert gate_decision(gate, serving, better).decision == "promoted"
    refused = gate_decision(gate, serving, worse)
    assert refused.decision == "refused" and "worse than the serving version" in refused.reason
    assert refused.change == pytest.approx(-0.5) and refused.tasks == 40
    # one task of 40 lost and nothing else: exactly -1 SE, at the margin, not beyond it
    one_lost = dict(serving, t1=0.0)
    at_margin = gate_decision(gate, serving, one_lost)
    assert at_margin.decision == "promoted" and at_margin.change == pytest.approx(-at_margin.se)
    # two tasks of 40 lost: change -0.050, paired SE 0.035 -> beyond 1 SE (refused), within 2 SE (promoted)
    two_lost = dict(serving, t1=0.0, t3=0.0)
    assert gate_decision(gate, serving, two_lost).decision == "refused"
    within = gate_decision(GateConfig(max_drop_se=2.0, max_loss=None), serving, two_lost)
    assert within.decision == "promoted" and within.se == pytest.approx(0.0349, abs=1e-4)


def test_the_default_gate_wants_evidence_of_no_loss_and_says_what_it_can_see() -> None:
    serving = {f"t{i}": float(i % 2) for i in range(40)}
    gate = GateConfig()  # max_drop_se 1, max_loss 0.05
    # one task gained, one lost: change 0, SE 0.036 -> 95% lower bound -0.059, not above -0.05: refused
    even = dict(serving, t0=1.0, t1=0.0)
    tie = gate_decision(gate, serving, even)
    assert tie.decision == "refused" and tie.change == 0 and "no evidence it is not worse" in tie.reason
    assert "bound -0.059 is not above -0.05" in tie.reason
    assert tie.detectable == pytest.approx((1.6449 + 0.8416) * tie.se)
    assert f"40 tasks tell a change of {tie.detectable:.3f} from none (80% power)" in tie.reason
    # four gained: change +0.100, SE 0.048 -> lower bound +0.021: promoted, with what the gate can see
    gained = dict(serving, t0=1.0, t2=1.0, t4=1.0, t6=1.0)
    promoted = gate_decision(gate, serving, gained)
    assert promoted.decision == "promoted" and "95% lower bound above -0.05" in promoted.reason
    # identical scores on every task: nothing to fear, nothing gained; promoted (as before)
    assert gate_decision(gate, serving, dict(serving)).decision == "promoted"
    assert gate_decision(GateConfig(max_loss=None), serving, even).decision == "promoted"


def test_gate_with_a_required_gain_refuses_a_tie_and_counts_only_common_tasks() -> None:
    serving = {f"t{i}": float(i % 2) for i in range(20)}
    gate = GateConfig(max_drop_se=1.0, min_gain_se=1.0)
    tie = gate_decision(gate, serving, dict(serving))
    assert tie.decision == "refused" and "not better enough" in tie.reason
    assert gate_decision(gate, serving, {t: 1.0 for t in serving}).decision == "promoted"
    assert gate_decision(gate, serving, {"other": 1.0}).decision == "refused"
    partial = gate_decision(GateConfig(), serving, {"t1": 1.0, "t2": 1.0})
    assert partial.tasks == 2


def test_live_rollback_needs_enough_sessions_and_a_clear_drop() -> None:
    good = [1.0, 0.0] * 20  # mean 0.5
    assert compare_live([0.0] * 5, good, min_sessions=20, k_se=2.0)[0] is False  # too few sessions
    worse, live = compare_live([0.0] * 30 + [1.0] * 2, good, min_sessions=20, k_se=2.0)
    assert worse and live.change < 0 and "over 32 sessions" in live.describe()
    assert compare_live([1.0, 0.0] * 15, good, min_sessions=20, k_se=2.0)[0] is False  # no change


# -- the config --------------------------------------------------------------------------------------------


def _improve_config(tmp_path: Path, **improve: Any) -> dict[str, Any]:
    return {
        "agent": "agent:solve",
        "tasks": {
            "train": str(ROOT / "examples/calc_autogen/train.jsonl"),
            "val": str(ROOT / "examples/calc_autogen/val.jsonl"),
        },
        "output_dir": str(tmp_path / "out"),
        "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
        "traces": {"store": "http://127.0.0.1:1", "filter": {"reward_min": 1.0}},
        "algorithm": {"name": "sft"},
        "improve": {"gate": "none", **improve},
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"improve": {"min_new_rollouts": 4}}, "improve.gate is required"),
        ({"traces": None}, "add a traces: section"),
        ({"traces": {"store": "http://127.0.0.1:1", "filter": {"rollout_ids": ["a"]}}}, "rollout_ids"),
        ({"traces": {"store": "http://127.0.0.1:1", "filter": {"until": "2026-01-01"}}}, "end date"),
        ({"improve": {"gate": "none", "gateways": [{"url": "http://10.1.2.3:8000"}]}}, "not on loopback"),
        (
            {
                "improve": {
                    "gate": "none",
                    "gateways": [{"url": "http://127.0.0.1:1"}, {"url": "http://127.0.0.1:1"}],
                }
            },
            "twice",
        ),
        ({"improve": {"gate": {"max_drop_se": 1}}, "tasks": None}, "gate: none"),
        ({"improve": {"gate": "none", "min_new_rollouts": 0}}, "min_new_rollouts"),
    ],
)
def test_bad_improve_configs_are_refused_with_what_to_do(tmp_path: Path, change: dict, message: str) -> None:
    data = {**_improve_config(tmp_path), **change}
    if data.get("traces") is None:
        data.pop("traces")
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data, required=())


def test_agl_train_refuses_an_improve_config_and_names_the_command(tmp_path: Path) -> None:
    path = tmp_path / "improve.yaml"
    path.write_text(yaml.safe_dump(_improve_config(tmp_path)))
    done = _agl("train", str(path), timeout=120)
    assert done.returncode == 2 and f"agl improve {path}" in done.stderr


# -- the state -------------------------------------------------------------------------------------------


def test_state_survives_a_round_trip_and_refuses_another_service_or_garbage(tmp_path: Path) -> None:
    state = ImproveState.new("calc", None)
    state.versions.append(Version(1, "serving", parent=0, round=1, trained_on=["a", "b"]))
    state.consumed += ["a", "b"]
    path = tmp_path / "improve.json"
    state.save(path)
    again = ImproveState.load(path, "calc")
    assert again is not None and again.version(1).trained_on == ["a", "b"] and again.consumed == ["a", "b"]
    with pytest.raises(StateError, match="belongs to the improve service 'calc'"):
        ImproveState.load(path, "other")
    path.write_text("{not json")
    with pytest.raises(StateError, match="move it away"):
        ImproveState.load(path, "calc")
    with pytest.raises(KeyError, match="versions: 0, 1"):
        state.version(7)


# -- the service, end to end -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Store:
    """``agl store serve`` on a fixed port, stoppable and restartable on the same file."""

    def __init__(self, db: Path, port: int) -> None:
        self.db, self.port, self.process = db, port, None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> _Store:
        self.process = subprocess.Popen(
            [*AGL, "store", "serve", "--db", str(self.db), "--http-port", str(self.port), "--no-grpc"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_healthy(f"{self.url}/healthz", self.process, timeout_s=60)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
            self.process = None


def _seed_store(store_url: str, tmp_path: Path, n: int, prefix: str = "demo") -> list[str]:
    """``n`` demonstrations (calculator calls) imported and each rewarded 1; their rollout ids."""
    from agl_core.importer import Demonstration, import_traces, write_demonstrations
    from agl_core.pipeline.rewards import Reward
    from agl_core.store import StoreClient

    demos = [
        Demonstration(
            id=f"{prefix}-{i}",
            messages=[{"role": "user", "content": f"What is {i} + {i + 1}?"}],
            response=f"{2 * i + 1}",
        )
        for i in range(n)
    ]
    file = tmp_path / f"{prefix}.jsonl"
    write_demonstrations(file, demos, service="gold")
    import_traces([file], store_url)
    client = StoreClient(store_url)
    try:
        rollouts = [r.rollout_id for r in client.list_rollouts(limit=500).rollouts]
        ours = sorted(r for r in rollouts if r.startswith("imp-"))
        client.add_rewards([Reward(f"r-{rid}", 1.0, rollout_id=rid) for rid in ours])
    finally:
        client.close()
    return ours


class _CountingGateway:
    """The real gateway app over the transformers backend (tiny model) on a fixed port, counting the
    policy versions it was sent."""

    def __init__(self, port: int, admin_token: str = "admin-secret", source: str = "tiny") -> None:
        from agl_core.gateway import create_gateway_app
        from agl_core.server import BackgroundServer
        from agl_trainer.generation.hf_backend import HFBackend
        from agl_trainer.model import load_policy

        model, tokenizer = load_policy(source)
        self.backend = HFBackend(model, tokenizer, model_name="policy")
        self.published: list[int] = []
        original = self.backend.update_policy

        async def counting(update: Any) -> None:
            await original(update)
            self.published.append(update.version)

        self.backend.update_policy = counting  # type: ignore[method-assign]
        self.server = BackgroundServer(create_gateway_app(self.backend, admin_token=admin_token), port=port)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> _CountingGateway:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.backend.close()


def _write_config(tmp_path: Path, store_url: str, gateway_port: int, **improve: Any) -> Path:
    data = {
        "output_dir": str(tmp_path / "service"),
        "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
        "traces": {
            "store": store_url,
            "filter": {"source": "import", "reward_min": 1.0},
            "batch_size": 4,
            "epochs": 1,
        },
        "algorithm": {"name": "sft", "learning_rate": 1e-3},
        "train": {"threads": 1},
        "improve": {
            "name": "t",
            "gate": "none",
            "min_new_rollouts": 8,
            "poll_s": 0.5,
            "rounds": 1,
            "gateways": [
                {
                    "url": f"http://127.0.0.1:{gateway_port}",
                    "admin_token_env": "AGL_TEST_ADMIN",
                    "name": "prod",
                }
            ],
            **improve,
        },
    }
    path = tmp_path / "improve.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _agl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``agl ARGS`` with the gateway's admin token in the environment."""
    return subprocess.run([*AGL, *args], capture_output=True, text=True, timeout=timeout, env=_env())


def _env() -> dict[str, str]:
    return {**os.environ, "AGL_TEST_ADMIN": "admin-secret"}


def _state(tmp_path: Path) -> dict[str, Any]:
    try:
        return json.loads((tmp_path / "service" / "improve.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_round_killed_while_training_resumes_and_trains_and_publishes_once(tmp_path: Path) -> None:
    store = _Store(tmp_path / "store.sqlite", _free_port()).start()
    gateway_port = _free_port()
    try:
        ids = _seed_store(store.url, tmp_path, 12)
        # enough steps that the kill lands inside the round
        config = _write_config(tmp_path, store.url, gateway_port)
        text = yaml.safe_load(config.read_text())
        text["traces"]["epochs"] = 300
        config.write_text(yaml.safe_dump(text))
        with _CountingGateway(gateway_port) as gateway:
            log = tmp_path / "first.log"
            with log.open("w") as out:
                first = subprocess.Popen(
                    [*AGL, "improve", str(config)], env=_env(), stdout=out, stderr=subprocess.STDOUT
                )
            deadline = time.monotonic() + 180
            while (_state(tmp_path).get("pending") or {}).get("phase") != "training":
                assert first.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            time.sleep(3)  # inside train_from_traces
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
            assert _state(tmp_path)["pending"]["round"] == 1 and gateway.published == []
            text["traces"]["epochs"] = 1
            config.write_text(yaml.safe_dump(text))
            again = _agl("improve", str(config), timeout=600)
            assert again.returncode == 0, again.stdout + again.stderr
            assert "round 1 resumes at training" in again.stdout
            state = _state(tmp_path)
            assert [v["version"] for v in state["versions"]] == [0, 1]
            assert state["versions"][1]["status"] == "serving" and state["serving"] == 1
            assert sorted(state["versions"][1]["trained_on"]) == ids  # each rollout, once
            assert sorted(state["consumed"]) == ids and state["pending"] is None
            assert gateway.published == [1] and "prod" in state["versions"][1]["published"]
            # started again with the round done: nothing trained, nothing published twice
            third = _agl("improve", str(config), timeout=300)
            assert third.returncode == 0, third.stdout + third.stderr
            assert gateway.published == [1] and _state(tmp_path)["rounds"] == 1
        # the lineage is in the store too
        from agl_trainer.improve.service import read_lineage

        lineage = read_lineage(store.url, "t")
        assert lineage is not None and lineage["serving"] == 1 and lineage["consumed_count"] == 12
    finally:
        store.stop()


def test_a_gateway_down_gets_the_version_when_it_returns_and_a_store_down_is_waited_for(
    tmp_path: Path,
) -> None:
    from agl_trainer.improve.service import ImproveService

    store = _Store(tmp_path / "store.sqlite", _free_port())
    gateway_port = _free_port()
    config = load_config(_write_config(tmp_path, store.url, gateway_port), required=())
    os.environ["AGL_TEST_ADMIN"] = "admin-secret"
    lines: list[str] = []
    service = ImproveService(config, echo=lines.append)
    done = threading.Event()

    def run() -> None:
        try:
            service.run()
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        # the store is down: the service waits and says so
        assert wait_until(lambda: "waiting for the store" in _state(tmp_path).get("waiting", ""), 30)
        store.start()
        # an empty store: the service waits, and its status says the filter matches nothing yet
        assert wait_until(
            lambda: "matches no rewarded rollout yet" in _state(tmp_path).get("waiting", ""), 30
        )
        ids = _seed_store(store.url, tmp_path, 8)
        # the round runs; the gateway is down: promoted, published when it comes up
        assert wait_until(lambda: _state(tmp_path).get("serving") == 1, 300), lines
        assert _state(tmp_path)["targets"]["prod"]["state"] == "down" and not done.is_set()
        with _CountingGateway(gateway_port) as gateway:
            assert done.wait(120), lines
            assert gateway.published == [1]
        state = _state(tmp_path)
        assert sorted(state["consumed"]) == ids and state["targets"]["prod"]["serving"] == 1
        assert any("is down" in line for line in lines) and any("prod serves v1" in line for line in lines)
    finally:
        service.stop.set()
        thread.join(timeout=60)
        store.stop()
        os.environ.pop("AGL_TEST_ADMIN", None)


def test_status_rollback_and_a_gateway_that_refuses(tmp_path: Path) -> None:
    store = _Store(tmp_path / "store.sqlite", _free_port()).start()
    gateway_port = _free_port()
    try:
        _seed_store(store.url, tmp_path, 8)
        config = _write_config(tmp_path, store.url, gateway_port)
        with _CountingGateway(gateway_port) as gateway:
            done = _agl("improve", str(config), timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            status = _agl("improve", "status", str(config), timeout=120)
            assert status.returncode == 0, status.stderr
            assert "v1 serves" in status.stdout and "v1 serving from v0, round 1, 8 rollouts" in status.stdout
            # a publish without the admin token, or with a wrong one, is refused with what to set
            from agl_trainer.config import GatewayTargetConfig
            from agl_trainer.improve.publish import publish_version

            adapter = tmp_path / "service" / "versions" / "v1"
            unset = GatewayTargetConfig(url=gateway.url, admin_token_env="AGL_TEST_UNSET_TOKEN")
            refused = publish_version(unset, 5, adapter)
            assert refused.state == "refused" and "AGL_TEST_UNSET_TOKEN" in refused.message
            os.environ["AGL_TEST_WRONG_TOKEN"] = "wrong"
            try:
                wrong = publish_version(
                    GatewayTargetConfig(url=gateway.url, admin_token_env="AGL_TEST_WRONG_TOKEN"), 5, adapter
                )
            finally:
                del os.environ["AGL_TEST_WRONG_TOKEN"]
            assert wrong.state == "refused" and "HTTP 401" in wrong.message and gateway.published == [1]
            # unknown version, then back to the base: the untrained adapter published as version 0
            bad = _agl("improve", "rollback", str(config), "7", timeout=120)
            assert bad.returncode == 2 and "no version 7" in bad.stderr and "versions: 0, 1" in bad.stderr
            calls = _Traffic(gateway.url)  # calls in flight while the version changes are all answered
            back = _agl("improve", "rollback", str(config), "v0", timeout=300)
            assert back.returncode == 0, back.stdout + back.stderr
            assert gateway.published == [1, 0]
            answered, failed = calls.stop()
            assert answered > 0 and failed == [], failed
            state = _state(tmp_path)
            assert state["serving"] == 0 and state["versions"][1]["status"] == "rolled_back"
        # a gateway serving another base model refuses the adapter: said, not retried, nothing lost
        with _CountingGateway(gateway_port, source="smollm2") as other:
            again = _agl("improve", "rollback", str(config), "1", timeout=300)
            # the serving version changed, but no gateway serves it: said, with a failing status
            assert again.returncode == 1, again.stdout + again.stderr
            assert "v1 is the serving version, but not every gateway serves it: prod (refused" in again.stderr
            assert "v1 serves" not in again.stdout
            assert other.published == []
            target = _state(tmp_path)["targets"]["prod"]
            assert target["state"] == "refused" and "does not fit the served model" in target["message"]
            assert "refused v1" in again.stdout
        status = _agl("improve", "status", str(config), "--json", timeout=120)
        assert json.loads(status.stdout)["serving"] == 1
    finally:
        store.stop()


class _Traffic:
    """Chat completions sent one after another to a gateway on a thread, until :meth:`stop`."""

    def __init__(self, url: str) -> None:
        import httpx

        self.answered, self.failed = 0, []
        self._stop = threading.Event()
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
                    if response.status_code == 200:
                        self.answered += 1
                    else:
                        self.failed.append(f"{response.status_code}: {response.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> tuple[int, list[str]]:
        self._stop.set()
        self._thread.join(timeout=60)
        return self.answered, self.failed


def wait_until(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_the_per_agent_baseline_trains_sessions_that_never_repeat_a_task(tmp_path: Path) -> None:
    """Off-policy RL on sessions each of its own task: no group has two rollouts, so ``baseline: task``
    trains nothing and says to use ``agent``; ``agent`` compares each with the agents' mean."""
    from agl_core.records import Transition
    from agl_trainer.run.traces import Selection, StoredRollout, baseline_groups

    rollouts = tuple(
        StoredRollout(f"s{i}", f"s{i}", None, "gateway", float(i % 2), i, frozenset({"calc"}))  # type: ignore[arg-type]
        for i in range(6)
    )
    selection = Selection(rollouts, (), 6, ())
    from agl_trainer.learning.algo import compute_advantages

    transitions = [Transition(f"s{i}", None, f"s{i}", 0, (1,), (2,), None, float(i % 2)) for i in range(6)]
    by_task, report = compute_advantages(transitions, baseline_groups(selection, "task"), "ppo")
    assert by_task == [] and report.skipped_singleton == 6
    by_agent, _ = compute_advantages(transitions, baseline_groups(selection, "agent"), "ppo")
    assert sorted(round(s.advantage, 3) for s in by_agent) == [-0.5] * 3 + [0.5] * 3


def test_a_promoted_version_users_rate_worse_is_rolled_back_automatically(tmp_path: Path) -> None:
    """Sessions each served by one version (the gateway's spans say which), rated late: v1 serves 30
    rated 0.2 on average, its predecessor v0 served 30 rated 0.7 -> back to v0, the numbers recorded."""
    from agl_core.store import open_store
    from agl_trainer.improve.service import ImproveService
    from agl_trainer.improve.state import STATE_FILE

    from ._improve import improve_config, promoted_v1, sessions

    db = tmp_path / "prod.sqlite"
    store = open_store(str(db))
    ratings = [(0 if i < 30 else 1, float((i % 10) < (7 if i < 30 else 2))) for i in range(60)]
    sessions(store, ratings)
    store.close()
    config = improve_config(tmp_path, str(db))
    out = promoted_v1(tmp_path).parent
    lines: list[str] = []
    service = ImproveService(config, echo=lines.append)
    service.tick()
    service.watcher.close()
    after = ImproveState.load(out / STATE_FILE, "t")
    assert after is not None and after.serving == 0
    rolled = after.version(1)
    assert rolled.status == "rolled_back" and "automatic rollback" in (rolled.note or "")
    assert "live reward 0.200 over 30 sessions against 0.700 over 30" in (rolled.note or "")
    # v0 came back by a rollback: not rolled back further, whatever its own predecessor did
    service = ImproveService(config, echo=lines.append)
    service.tick()
    service.watcher.close()
    assert ImproveState.load(out / STATE_FILE, "t").serving == 0  # type: ignore[union-attr]
