"""agl improve as an on-call engineer reads it: whether the service runs (a heartbeat, a stop it records
with its reason, a restart after a kill said as such), a rollback that names the version it replaces, no
"resuming" from a service that is refused its folder, and status lines without empty fields."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agl_trainer.config import ConfigError, config_from_dict
from agl_trainer.improve.service import (
    ALIVE_FILE,
    ROLLBACK_FILE,
    ImproveError,
    ImproveService,
    liveness,
    service_lock,
    status_lines,
)
from agl_trainer.improve.state import STATE_FILE, ImproveState

from ._improve import improve_config, promoted_v1


def _beat(out: Path, *, pid: int, age_s: float, host: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    beat = {"time": time.time() - age_s, "pid": pid, "host": host or socket.gethostname(), "every_s": 1.0}
    (out / ALIVE_FILE).write_text(json.dumps(beat))


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_liveness_tells_running_stopped_killed_and_silent_apart(tmp_path):
    state = ImproveState.new("t", None)
    assert liveness(tmp_path, state).startswith("not known to run")  # no heartbeat at all
    _beat(tmp_path, pid=os.getpid(), age_s=1)
    assert liveness(tmp_path, state).startswith(f"running (pid {os.getpid()}")
    _beat(tmp_path, pid=os.getpid(), age_s=600)
    assert liveness(tmp_path, state).startswith("NOT RUNNING: not heard from since")
    _beat(tmp_path, pid=_dead_pid(), age_s=1)  # fresh, but its process is gone: killed
    assert "is gone and it never said it stopped" in liveness(tmp_path, state)
    _beat(tmp_path, pid=12345, age_s=1, host="another-machine")  # another host: judged by time only
    assert liveness(tmp_path, state).startswith("running (pid 12345")
    state.stopped_at, state.stop_reason = time.time(), "stopped: asked to stop"
    assert liveness(tmp_path, state).startswith("not running: stopped at")


def test_a_service_records_its_stop_and_a_restart_says_the_last_run_was_killed(tmp_path):
    config = improve_config(tmp_path, "http://127.0.0.1:1", poll_s=0.2)  # a store that never answers
    stop = threading.Event()
    service = ImproveService(config, echo=lambda _: None, stop=stop)
    runner = threading.Thread(target=service.run)
    runner.start()
    out = tmp_path / "service"
    deadline = time.monotonic() + 30
    while not (out / ALIVE_FILE).exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert liveness(out, ImproveState.load(out / STATE_FILE, "t")).startswith("running")  # type: ignore[arg-type]
    stop.set()
    runner.join(timeout=30)
    state = ImproveState.load(out / STATE_FILE, "t")
    assert state is not None and state.stopped_at is not None
    assert state.waiting == "not running: stopped: asked to stop" and state.events[-1]["kind"] == "stop"
    assert not (out / ALIVE_FILE).exists() and liveness(out, state).startswith("not running: stopped at")

    # a run that never said it stopped (what SIGKILL leaves): the next start says so
    state.stopped_at = None
    state.save(out / STATE_FILE)
    lines: list[str] = []
    again = ImproveService(config, echo=lines.append, stop=threading.Event())
    again.stop.set()
    again.run()
    restart = [e for e in again.state.events if e["kind"] == "restart"][-1]
    assert "never said it stopped (killed, or crashed after" in restart["message"]
    assert any(line.startswith("resuming: v0 serves") for line in lines)


def test_a_service_refused_its_folder_says_nothing_of_resuming(tmp_path):
    config = improve_config(tmp_path, "http://127.0.0.1:1")
    ImproveService(config, echo=lambda _: None)  # the state exists: a second start would resume
    lines: list[str] = []
    with service_lock(tmp_path / "service") as held:
        assert held is not None
        with pytest.raises(ImproveError, match="another agl improve runs"):
            ImproveService(config, echo=lines.append).run()
    assert not any("resuming" in line for line in lines)


def test_a_rollback_names_the_version_it_replaces_and_is_refused_when_that_no_longer_serves(tmp_path):
    promoted_v1(tmp_path)  # v1 serves, from v0
    config = improve_config(tmp_path, "http://127.0.0.1:1")
    service = ImproveService(config, echo=lambda _: None)
    request = tmp_path / "service" / ROLLBACK_FILE
    request.write_text(json.dumps({"version": 0, "replaces": 2, "why": "v2 looked bad"}))
    service._apply_rollback_request()
    assert service.state.serving == 1 and not request.exists()
    refused = service.state.events[-1]
    assert (
        refused["kind"] == "rollback_refused"
        and "asked to replace v2, and v1 serves now" in refused["message"]
    )
    request.write_text(json.dumps({"version": 0, "replaces": "1"}))  # not an integer
    service._apply_rollback_request()
    assert (
        service.state.serving == 1
        and "the integer version it replaces" in service.state.events[-1]["message"]
    )
    request.write_text(json.dumps({"version": 0, "replaces": 1, "why": "v1 looked bad"}))
    service._apply_rollback_request()
    assert service.state.serving == 0 and service.state.version(1).status == "rolled_back"


def test_status_lines_leave_out_empty_fields_and_say_whether_the_service_runs(tmp_path):
    state = ImproveState.new("t", None)
    lines = status_lines(state, alive="running (pid 1, heard from 0s ago)")
    assert "service: running (pid 1, heard from 0s ago)" in lines
    assert not any(";;" in line or line.endswith(";") for line in lines)
    assert "  v0 serving; published to -" in lines


def test_one_gateway_under_two_spellings_is_refused(tmp_path):
    data = {
        "output_dir": str(tmp_path / "out"),
        "model": {"source": "tiny"},
        "traces": {"store": "http://127.0.0.1:1"},
        "algorithm": {"name": "sft"},
        "improve": {
            "gate": "none",
            "gateways": [{"url": "http://LOCALHOST:8001/"}, {"url": "http://127.0.0.1:8001", "name": "b"}],
        },
    }
    with pytest.raises(ConfigError, match=r"lists the gateway http://127.0.0.1:8001 twice"):
        config_from_dict(data, required=())


class _Gateway:
    """An agl gateway app over a scripted backend that serves a policy version and takes new ones."""

    def __init__(self, serving: int) -> None:
        from agl_core.testing import ScriptedBackend

        class Backend(ScriptedBackend):
            policy_version = serving

            async def update_policy(inner, update) -> None:  # type: ignore[no-untyped-def]
                inner.policy_version = update.version
                self.published.append(update.version)

        self.published: list[int] = []
        self.backend = Backend(["ok"])


class _BlockedWork:
    """A round's work that trains only when let go (``release``), and saves adapters as empty folders."""

    def __init__(self) -> None:
        self.training = threading.Event()
        self.release = threading.Event()

    def train(self, round_dir: Path, selection, parent_adapter):  # type: ignore[no-untyped-def]
        self.training.set()
        assert self.release.wait(60)
        out = round_dir / "adapter"
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_text("{}")
        return out

    def score(self, candidate, serving):  # type: ignore[no-untyped-def]
        raise AssertionError("gate: none scores nothing")

    def base_adapter(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text("{}")


def _wait(check, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_while_a_round_trains_a_restarted_gateway_is_served_again_and_a_rollback_applies(tmp_path):
    from agl_core.store import open_store
    from agl_core.testing import GatewayServer

    from ._improve import sessions

    db = tmp_path / "prod.sqlite"
    store = open_store(str(db))
    sessions(store, [(1, 1.0)] * 6)  # six rated sessions v1 served: a round is due
    store.close()
    promoted_v1(tmp_path)
    gateway = _Gateway(serving=1)
    work = _BlockedWork()
    with GatewayServer(gateway.backend) as server:
        config = improve_config(
            tmp_path,
            str(db),
            min_new_rollouts=5,
            poll_s=0.1,
            rounds=2,  # v1 came from round 1; round 2 is skipped, and a third would train from v0
            gateways=[{"url": server.url, "name": "prod"}],
        )
        stop = threading.Event()
        service = ImproveService(config, echo=lambda _: None, work=work, stop=stop)  # type: ignore[arg-type]
        runner = threading.Thread(target=service.run)
        runner.start()
        try:
            assert work.training.wait(30)
            gateway.backend.policy_version = 0  # the gateway restarted on its base model mid-round
            _wait(lambda: gateway.published == [1])  # served v1 again while the round still trains
            assert not work.release.is_set() and service.state.pending is not None
            out = tmp_path / "service"
            (out / ROLLBACK_FILE).write_text(json.dumps({"version": 0, "replaces": 1, "why": "v1 is bad"}))
            _wait(lambda: gateway.published == [1, 0])  # the rollback applied mid-round, and published
            work.release.set()
            _wait(lambda: service.state.pending is None)
        finally:
            work.release.set()
            stop.set()
            runner.join(timeout=30)
    state = service.state
    assert state.serving == 0 and [v.version for v in state.versions] == [0, 1]  # no v2 from the bad v1
    skipped = [e for e in state.events if e["kind"] == "round_skipped"][-1]
    assert "its parent v1 was rolled back while it ran" in skipped["message"]
    assert state.consumed == []  # its rollouts train in the next round, from v0


def test_two_services_never_take_turns_on_one_gateway(tmp_path):
    from agl_core.store import open_store
    from agl_core.testing import GatewayServer

    db = tmp_path / "prod.sqlite"
    open_store(str(db)).close()
    promoted_v1(tmp_path)  # service "t" serves its v1
    gateway = _Gateway(serving=0)
    with GatewayServer(gateway.backend) as server:
        targets = [{"url": server.url, "name": "prod"}]
        main = ImproveService(improve_config(tmp_path, str(db), gateways=targets), echo=lambda _: None)
        main.tick()
        assert gateway.published == [1] and main.state.targets["prod"].state == "ok"
        staging_config = improve_config(tmp_path / "staging", str(db), name="staging", gateways=targets)
        staging = ImproveService(staging_config, echo=lambda _: None, work=_BlockedWork())  # type: ignore[arg-type]
        staging.tick()
        main.tick()
        main.watcher.close()
        staging.watcher.close()
    assert gateway.published == [1]  # staging's v0 never went out
    refused = staging.state.targets["prod"]
    assert refused.state == "refused" and "from the agl improve service 't'" in refused.message
    assert main.state.targets["prod"].state == "ok" and main.state.targets["prod"].serving == 1


def test_live_rewards_count_only_the_sessions_this_services_versions_served(tmp_path):
    from agl_core import semconv
    from agl_core.records import Span
    from agl_trainer.improve.watch import StoreWatcher

    config = improve_config(tmp_path, "http://127.0.0.1:1")
    watcher = StoreWatcher(config.traces, owner="t")

    def call(i: int, rollout: str, owner: str | None) -> Span:
        attrs = {
            semconv.SOURCE: semconv.SOURCE_GATEWAY,
            semconv.POLICY_VERSION: 1,
            semconv.ROLLOUT_ID: rollout,
        }
        if owner is not None:
            attrs[semconv.POLICY_OWNER] = owner
        return Span(f"{i:032x}", f"{i:016x}", None, "chat policy", 10**18 + i, 10**18 + i + 1, attrs)

    watcher.reader.spans = [
        call(1, "ours", "t"),
        call(2, "older-gateway", None),  # a gateway from before owners: counted
        call(3, "theirs", "staging"),  # staging's v1 is not our v1
        call(4, "mixed", "t"),
        call(5, "mixed", "staging"),
    ]
    assert watcher.versions_of_rollouts() == {"ours": {1}, "older-gateway": {1}}
