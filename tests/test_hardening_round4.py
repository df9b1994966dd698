"""Round four of hostile input: one bad value in a span, a request or a reward never takes reads down,
never steers a decision, and every stored span's rollout is listed. Store tests run on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agl_core import semconv
from agl_core.store import RolloutFilter
from agl_core.store._loose import LooseSpans
from agl_core.store.formats.otlp import UNREADABLE_SPAN, row_to_span
from tests._improve import improve_config as _improve_config
from tests._improve import promoted_v1 as _promoted_v1
from tests._improve import sessions as _sessions
from tests.conftest import make_span


def _otlp(rollout: str, n: int, value: float) -> bytes:
    request = ExportTraceServiceRequest()
    span = (
        request.resource_spans.add()
        .scope_spans.add()
        .spans.add(
            trace_id=bytes([n]) * 16,
            span_id=bytes([n]) * 8,
            name="step",
            start_time_unix_nano=1,
            end_time_unix_nano=2,
        )
    )
    span.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = rollout
    span.attributes.add(key="score").value.double_value = value
    inner = span.attributes.add(key="deep").value.array_value.values.add()
    inner.kvlist_value.values.add(key="x").value.double_value = value
    span.events.add(name="e", time_unix_nano=1).attributes.add(key="v").value.double_value = value
    return request.SerializeToString()


# --- 1. non-finite numbers in spans -----------------------------------------------------------------------
def test_non_finite_numbers_in_spans_never_fail_a_read(store_server, client):
    for n, value in enumerate([math.nan, math.inf, -math.inf, 1.5], start=1):
        r = httpx.post(
            store_server.url + "/v1/traces",
            content=_otlp(f"ro-{n}", n, value),
            headers={"content-type": "application/x-protobuf"},
        )
        assert r.status_code == 200
    page = httpx.post(store_server.url + "/api/spans/query", json={})
    assert page.status_code == 200, page.text
    scores = {s["attributes"][semconv.ROLLOUT_ID]: s["attributes"]["score"] for s in page.json()["spans"]}
    assert scores == {"ro-1": "NaN", "ro-2": "Infinity", "ro-3": "-Infinity", "ro-4": 1.5}
    (spans_2,) = [s for s in client.query_spans() if s.rollout_id == "ro-2"]
    assert spans_2.attributes["deep"] == [{"x": "Infinity"}]
    assert spans_2.events[0]["attributes"] == {"v": "Infinity"}
    # the Python API's spans read back the same way
    store_server.store.add_spans([make_span("py", {semconv.ROLLOUT_ID: "ro-py", "v": math.nan})])
    assert client.query_spans(rollout_ids=["ro-py"])[0].attributes["v"] == "NaN"


def test_a_damaged_span_body_reads_back_as_a_placeholder():
    span = row_to_span(7, b"\xff\xff\xff", {})
    assert span.name == UNREADABLE_SPAN and span.seq == 7 and "could not be decoded" in span.status_message


# --- 2. lone surrogates ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "body", "where"),
    [
        ("PUT", "/api/resources/p", '{"value": {"a": ["ok", "x\\ud800"]}}', "value.a.1"),
        (
            "POST",
            "/api/rollouts",
            '{"rollouts": [{"task_id": "t", "input": "a\\udfff"}]}',
            "rollouts.0.input",
        ),
        ("POST", "/api/rollouts", '{"rollouts": [{"task_id": "t", "metadata": {"k\\ud800": 1}}]}', "a key"),
    ],
)
def test_a_lone_surrogate_is_a_400_that_says_where(store_server, client, method, path, body, where):
    r = httpx.request(
        method, store_server.url + path, content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert where in message and "surrogate" in message
    assert client.stats()["rollouts"] == 0 and client.get_resource("p") is None


def test_a_surrogate_pair_is_text_and_is_kept(store_server, client):
    r = httpx.put(
        store_server.url + "/api/resources/p",
        content='{"value": "\\ud83d\\ude00"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200 and client.get_resource("p").value == "\N{GRINNING FACE}"


def test_a_lone_surrogate_in_otlp_json_is_a_400(store_server):
    span = {"traceId": "03" * 16, "spanId": "04" * 8, "name": "y\ud800", "startTimeUnixNano": "1"}
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})
    r = httpx.post(
        store_server.url + "/v1/traces", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400


def test_library_callers_get_a_value_error_for_a_lone_surrogate(store):
    with pytest.raises(ValueError, match=r"input\.k holds a lone UTF-16 surrogate"):
        store.enqueue_rollouts([{"task_id": "t", "input": {"k": "\udc00"}}])
    assert store.stats()["rollouts"] == 0


# --- 3. spans stored before the first grouping pass ----------------------------------------------------
def test_rollouts_named_by_spans_stored_before_the_first_pass_are_listed(store):
    backlog = [make_span("step", {semconv.ROLLOUT_ID: f"early-{n}"}) for n in range(3)]
    store.add_spans(backlog)  # an exporter's backlog, stored before the store's first maintenance pass
    store.group_loose_spans(LooseSpans(quiet_s=10), now=100)
    listed = {r.rollout_id for r in store.list_rollouts(limit=50).rollouts}
    assert listed == {"early-0", "early-1", "early-2"}


def test_a_restarted_store_lists_rollouts_its_last_run_missed(store):
    store.add_spans([make_span("step", {semconv.ROLLOUT_ID: "missed"})])
    loose = LooseSpans(quiet_s=10)
    loose.after_seq = store.stats()["spans"]  # what the old code left: the span was passed over
    store.group_loose_spans(loose, now=100)
    assert store.stats()["rollouts"] == 0
    store.group_loose_spans(LooseSpans(quiet_s=10), now=200)  # a restart: a new pass state
    assert [r.rollout_id for r in store.list_rollouts().rollouts] == ["missed"]


# --- 4. search matches text, not encoding bytes ----------------------------------------------------------
def test_search_matches_the_text_users_see_not_the_encoding(store):
    n = 1200
    spans = []
    for i in range(n):
        store.enqueue_rollouts([{"task_id": "t", "rollout_id": f"r{i:05d}"}])
        attrs = {
            semconv.ROLLOUT_ID: f"r{i:05d}",
            "gen_ai.input.messages": json.dumps([{"role": "user", "content": f"question {i}"}]),
            "n": i,
        }
        if i == 77:
            attrs["note"] = 'costs 5% of "it"\\n\nok'
        spans.append(make_span(f"call {i}", attrs, start=37 * i + 1))
    store.add_spans(spans)
    for text in ["%", '"it"', "\\", "\n"]:
        page = store.list_rollouts(RolloutFilter(text=text), limit=50)
        assert [r.rollout_id for r in page.rollouts] == ["r00077"], text
        assert page.total == 1
    # keys, names, message contents inside JSON values and paging over the verified matches
    assert store.list_rollouts(RolloutFilter(text="note")).total == 1
    assert store.list_rollouts(RolloutFilter(text="question 1199")).rollouts[0].rollout_id == "r01199"
    first = store.list_rollouts(RolloutFilter(text="call 11"), limit=5)
    assert first.total == 111 and len(first.rollouts) == 5 and first.before is not None
    second = store.list_rollouts(RolloutFilter(text="call 11"), before=first.before, limit=5)
    assert [r.rollout_id for r in second.rollouts] == [f"r{i:05d}" for i in (1194, 1193, 1192, 1191, 1190)]


# --- 5. a PostgreSQL password never shows ---------------------------------------------------------------
def test_store_serve_never_prints_a_postgres_password():
    import signal
    import subprocess
    import sys
    import uuid

    from tests._servers import wait_healthy
    from tests.conftest import POSTGRES_DSN
    from tests.test_cli_store import _free_port

    secret = f"pw{uuid.uuid4().hex[:8]}"
    # trust auth ignores the password; the URL still carries one, as a user's would
    db = POSTGRES_DSN.replace("://postgres@", f"://postgres:{secret}@")
    port = _free_port()
    cmd = [sys.executable, "-m", "agl_core.cli", "store", "serve", "--http-port", str(port), "--no-grpc"]
    proc = subprocess.Popen(
        [*cmd, "--db", db, "--parse-workers", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "postgres:***@" in out and "postgres:***@" in err
    unreachable = subprocess.run(
        [*cmd, "--db", f"postgresql://u:{secret}@127.0.0.1:1/db?password={secret}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unreachable.returncode == 2 and "u:***@127.0.0.1:1" in unreachable.stderr
    for text in (out, err, unreachable.stdout, unreachable.stderr):
        assert secret not in text


def test_masked_url_masks_the_password_forms():
    from agl_core.settings import masked_url

    assert masked_url("postgresql://u:p@h:5/db") == "postgresql://u:***@h:5/db"
    assert (
        masked_url("x postgresql://u@h/db?sslmode=a&password=p y")
        == "x postgresql://u@h/db?sslmode=a&password=*** y"
    )
    assert masked_url("runs/a.sqlite") == "runs/a.sqlite"


# --- agl improve: rewards, gateways, state ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("v1_mean", "legacy", "rolled_back"),
    [
        (0.7, [(1, -math.inf)], False),  # one -inf among equal ratings decided a rollback
        (0.2, [(1, math.nan), (1, math.inf)], True),  # one NaN or +inf kept a worse version
        (0.7, [(1, 1e308), (0, -1e200)], False),  # finite but absurd: crashed the service and status
    ],
)
def test_one_bad_rating_never_decides_a_rollback(tmp_path, v1_mean, legacy, rolled_back):
    from agl_core.store import open_store
    from agl_trainer.improve.service import ImproveService, status_lines
    from agl_trainer.improve.state import ImproveState

    db = tmp_path / "prod.sqlite"
    store = open_store(str(db))
    good_v1 = round(v1_mean * 10)
    ratings = [(0, float(i % 10 < 7)) for i in range(30)] + [(1, float(i % 10 < good_v1)) for i in range(30)]
    _sessions(store, ratings, legacy=legacy)
    store.close()
    state_file = _promoted_v1(tmp_path)
    lines: list[str] = []
    service = ImproveService(_improve_config(tmp_path, str(db)), echo=lines.append)
    service.tick()
    live = service.watcher.live_rewards(service.improve.rollback.reward_range)
    ignored = dict(service.watcher.ignored_rewards)
    service.watcher.close()
    after = ImproveState.load(state_file, "t")
    assert after is not None and after.serving == (0 if rolled_back else 1), lines
    assert len(live[1]) == 30 and len(live[0]) == 30
    finite_legacy = [v for _, v in legacy if math.isfinite(v)]
    assert sum(ignored.values()) == len(finite_legacy)  # non-finite ones never read back as numbers
    text = "\n".join(status_lines(after, live, ignored))
    if finite_legacy:
        assert "rewards left out: not finite, or outside rollback.reward_range" in text


def test_reward_spans_for_rollouts_the_store_does_not_know_never_count(tmp_path):
    from agl_core.records import Span
    from agl_core.store import open_store
    from agl_trainer.improve.service import ImproveService

    db = tmp_path / "prod.sqlite"
    store = open_store(str(db))
    _sessions(store, [(0, 1.0)] * 12)
    ghosts = [
        Span(
            f"{900 + i:032x}",
            f"{900 + i:016x}",
            None,
            semconv.SPAN_REWARD,
            1,
            2,
            {semconv.ROLLOUT_ID: f"ghost-{i}", semconv.REWARD_VALUE: 1.0, semconv.REWARD_NAME: "episode"},
        )
        for i in range(8)
    ]
    store.add_spans(ghosts)  # what OTLP accepts: reward spans naming rollouts that never ran
    store.close()
    service = ImproveService(_improve_config(tmp_path, str(db), min_new_rollouts=20), echo=lambda _: None)
    try:
        service.watcher.refresh()
        new, described = service._new_rollouts()
        assert len(new) == 12 and not any(r.startswith("ghost") for r in new), described
        assert not service._round_due()
        assert "12 of 20 new rewarded rollouts" in service.state.waiting
    finally:
        service.watcher.close()


def test_the_store_refuses_absurd_rewards_at_every_door(store_server, client):
    from agl_core.pipeline.rewards import Reward
    from agl_core.store import StoreError

    client.enqueue_rollouts([{"task_id": "t", "rollout_id": "ro-1"}])
    r = httpx.post(
        store_server.url + "/api/rewards",
        json={"rewards": [{"reward_id": "a", "value": 1e308, "rollout_id": "ro-1"}]},
    )
    assert r.status_code == 400 and "rewards.0.value" in r.json()["error"]["message"]
    with pytest.raises(StoreError, match="outside the accepted range"):
        client.add_rewards([Reward("x", -2e6, rollout_id="ro-1")])
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add()
    for n, value in enumerate([1e308, math.inf, math.nan, 0.5], start=1):
        span = spans.spans.add(trace_id=bytes([n]) * 16, span_id=bytes([n]) * 8, name=semconv.SPAN_REWARD)
        span.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = "ro-1"
        span.attributes.add(key=semconv.REWARD_VALUE).value.double_value = value
    r = httpx.post(
        store_server.url + "/v1/traces",
        content=json.dumps(
            {
                "resourceSpans": [
                    {
                        "scopeSpans": [
                            {
                                "spans": [
                                    {
                                        "traceId": "05" * 16,
                                        "spanId": "05" * 8,
                                        "name": semconv.SPAN_REWARD,
                                        "attributes": [
                                            {"key": semconv.REWARD_VALUE, "value": {"intValue": str(10**18)}}
                                        ],
                                    }
                                ]
                            }
                        ]
                    }
                ]
            }
        ),
        headers={"content-type": "application/json"},
    )
    assert r.json()["partialSuccess"]["rejectedSpans"] == "1"
    from agl_core.store.formats.otlp import decode_protobuf, extract_rows

    batch = extract_rows(decode_protobuf(request.SerializeToString()))
    assert batch.rejected == 3 and "outside the accepted range" in batch.error_message
    assert len(batch.rows) == 1


def test_agl_reward_and_store_serve_take_a_reward_range(tmp_path, capsys):
    from agl_core.cli import main
    from agl_core.store import SqliteStore

    db = tmp_path / "s.sqlite"
    store = SqliteStore(db)
    store.enqueue_rollouts([{"task_id": "t", "rollout_id": "ro-1"}])
    store.close()
    assert main(["reward", "ro-1", "1e308", "--store", str(db)]) == 2
    assert "outside the accepted range -1e+06 to 1e+06" in capsys.readouterr().err
    assert main(["reward", "ro-1", "5e6", "--store", str(db), "--reward-range=-1e7:1e7"]) == 0
    lines = tmp_path / "r.jsonl"
    lines.write_text('{"rollout_id": "ro-1", "value": 2}\n{"rollout_id": "ro-1", "value": 1e300}\n')
    assert main(["reward", "--file", str(lines), "--store", str(db), "--reward-range", "0:10"]) == 1
    assert "r.jsonl:2: value: reward 1e+300 is outside" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["store", "serve", "--reward-range", "1:0"])
    assert exit_.value.code == 2 and "MIN < MAX" in capsys.readouterr().err


class _Answers:
    """A fake gateway answering GET /agl/v1/policy with what a test sets (or slowly)."""

    def __init__(self) -> None:
        import time

        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        from agl_core.server import BackgroundServer

        self.body, self.delay = b"", 0.0

        def policy(request):
            time.sleep(self.delay)
            return Response(self.body, media_type="application/json")

        self.server = BackgroundServer(Starlette(routes=[Route("/agl/v1/policy", policy)]))

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.delay = 0.0
        self.server.stop()


@pytest.mark.timing
def test_a_bad_or_slow_gateway_is_down_with_the_reason(tmp_path):
    import time

    from agl_trainer.config import GatewayTargetConfig
    from agl_trainer.improve.publish import served_version

    with _Answers() as fake:
        target = GatewayTargetConfig(url=fake.server.url)
        for body in [
            b"hello",
            b"[1, 2]",
            b"[" * 100_000,
            b"",
            b"\xff\xfe\x00",
            b'{"policy_version": true}',
            b"{}",
        ]:
            fake.body = body
            result = served_version(target)
            assert result.state == "down" and "not agl's policy document" in result.message, body[:20]
        fake.body = b'{"policy_version": 3}'
        assert served_version(target).serving == 3
        fake.body, fake.delay = b'{"policy_version": 3}', 8.0
        started = time.monotonic()
        slow = served_version(target)
        assert slow.state == "down" and time.monotonic() - started < 7.5


def test_a_bad_gateway_does_not_stop_the_service_serving_the_others(tmp_path):
    from agl_core.store import open_store
    from agl_trainer.improve.service import ImproveService
    from agl_trainer.improve.state import ImproveState

    db = tmp_path / "prod.sqlite"
    open_store(str(db)).close()
    with _Answers() as bad, _Answers() as good:
        bad.body, good.body = b"[[[[", b'{"policy_version": 0}'
        gateways = [{"url": bad.server.url, "name": "bad"}, {"url": good.server.url, "name": "good"}]
        service = ImproveService(_improve_config(tmp_path, str(db), gateways=gateways), echo=lambda _: None)
        service.tick()
        service.watcher.close()
    state = ImproveState.load(tmp_path / "service" / "improve.json", "t")
    assert state is not None
    assert (
        state.targets["bad"].state == "down" and "not agl's policy document" in state.targets["bad"].message
    )
    assert state.targets["good"].state == "ok" and state.targets["good"].serving == 0


def test_an_unreachable_postgres_store_never_shows_its_password(tmp_path):
    from agl_trainer.improve.service import ImproveService

    secret = "s3cr3t-pw"
    lines: list[str] = []
    service = ImproveService(
        _improve_config(tmp_path, f"postgresql://agl:{secret}@127.0.0.1:1/prod"), echo=lines.append
    )
    service.tick()
    service.watcher.close()
    assert "agl:***@127.0.0.1:1" in service.state.waiting
    written = (tmp_path / "service" / "improve.json").read_text()
    assert (
        secret not in written
        and secret not in "\n".join(lines)
        and secret not in json.dumps(service.state.to_json(with_consumed=False))
    )


def test_an_idle_service_writes_its_lineage_on_change_only(tmp_path, monkeypatch):
    from agl_core.store import open_store
    from agl_trainer.improve import service as service_module
    from agl_trainer.improve.service import ImproveService
    from agl_trainer.improve.state import lineage_resource

    monkeypatch.setattr(service_module, "_MIRROR_WAITING_S", 0.0)
    db = tmp_path / "prod.sqlite"
    open_store(str(db)).close()
    service = ImproveService(_improve_config(tmp_path, str(db)), echo=lambda _: None)
    for _ in range(5):
        service.tick()
    service.watcher.close()
    store = open_store(str(db))
    try:
        written = store.get_resource(lineage_resource("t"))
        assert written is not None and written.version <= 2  # the start, then the first "waiting" line
        for n in range(5):
            store.put_resource("r", {"n": n}, keep=3)
        assert [v for (v,) in store._read("SELECT version FROM resources WHERE name = 'r'")] == [3, 4, 5]
        assert store.get_resource("r").value == {"n": 4}
    finally:
        store.close()


def test_resource_keep_is_validated_over_http(store_server):
    r = httpx.put(store_server.url + "/api/resources/x", json={"value": 1, "keep": 0})
    assert r.status_code == 400 and "keep" in r.json()["error"]["message"]


def test_a_bad_rollback_request_is_refused_and_the_service_goes_on(tmp_path):
    from agl_core.store import open_store
    from agl_trainer.improve.service import ROLLBACK_FILE, ImproveService

    db = tmp_path / "prod.sqlite"
    open_store(str(db)).close()
    _promoted_v1(tmp_path)
    service = ImproveService(_improve_config(tmp_path, str(db)), echo=lambda _: None)
    try:
        for body in ['{"version": 1e999}', '{"version": true}', "[0]", '"v0"', '{"version": "0"}']:
            (tmp_path / "service" / ROLLBACK_FILE).write_text(body)
            service.tick()
            assert service.state.serving == 1
            assert service.state.events[-1]["kind"] == "rollback_refused", body
            assert not (tmp_path / "service" / ROLLBACK_FILE).exists()
    finally:
        service.watcher.close()


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '"x"',
        '{"name": "t"}',
        '{"name": "t", "versions": [], "serving": 0, "rounds": 0}',
        '{"name": "t", "versions": ["v0"], "serving": 0, "rounds": 0}',
        '{"name": "t", "versions": [{"version": 0, "status": "serving"}], "serving": 3, "rounds": 0}',
        '{"name": "t", "versions": [{"version": 0, "status": "serving"}], "serving": null, "rounds": 0}',
        '{"name": 5, "versions": [{"version": "0", "status": "serving"}], "serving": 0, "rounds": 0}',
        '{"name": "t", "versions": [{"version": 0, "status": "serving"}], "serving": 0, "rounds": 0,'
        ' "targets": {"g": 1}}',
    ],
)
def test_a_state_file_of_the_wrong_shape_is_a_message(tmp_path, text):
    from agl_trainer.improve.state import ImproveState, StateError

    path = tmp_path / "improve.json"
    path.write_text(text)
    with pytest.raises(StateError, match="is not a readable agl improve state"):
        ImproveState.load(path, "t")


def test_a_lock_or_state_that_is_a_directory_is_a_message(tmp_path):
    from agl_core.store import open_store
    from agl_trainer.improve.service import ImproveError, ImproveService
    from agl_trainer.improve.state import StateError

    db = tmp_path / "prod.sqlite"
    open_store(str(db)).close()
    (tmp_path / "service" / "improve.lock").mkdir(parents=True)
    service = ImproveService(_improve_config(tmp_path, str(db), rounds=1), echo=lambda _: None)
    with pytest.raises(ImproveError, match="cannot open the lock file"):
        service.run()
    (tmp_path / "service" / "improve.lock").rmdir()
    (tmp_path / "service" / "improve.json").unlink()
    (tmp_path / "service" / "improve.json").mkdir()
    with pytest.raises(StateError, match="is not a file"):
        ImproveService(_improve_config(tmp_path, str(db)), echo=lambda _: None)


def test_a_malformed_held_out_file_is_found_before_any_round(tmp_path):
    from agl_core.store import open_store
    from agl_trainer.config import config_from_dict
    from agl_trainer.improve.service import ImproveError, ImproveService

    db = tmp_path / "prod.sqlite"
    open_store(str(db)).close()
    (tmp_path / "train.jsonl").write_text('{"question": "1+1"}\n')
    (tmp_path / "val.jsonl").write_text('{"question": "2+2"}\nnot json\n')
    config = config_from_dict(
        {
            "agent": "agent:solve",
            "tasks": {"train": str(tmp_path / "train.jsonl"), "val": str(tmp_path / "val.jsonl")},
            "output_dir": str(tmp_path / "service"),
            "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
            "traces": {"store": str(db), "filter": {"source": "gateway"}},
            "algorithm": {"name": "sft"},
            "improve": {"name": "t", "gate": {"max_drop_se": 1.0}},
        },
        required=(),
    )
    with pytest.raises(ImproveError, match=r"the held-out gate cannot run: .*val\.jsonl"):
        ImproveService(config, echo=lambda _: None)
    assert not (tmp_path / "service" / "improve.json").exists()


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000\\@10.1.2.3", "http://localhost@10.1.2.3:80", "http://u:p@127.0.0.1:1"]
)
def test_a_gateway_url_is_checked_as_the_client_parses_it(url):
    from agl_trainer.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="user info before an '@'"):
        config_from_dict(
            {
                "model": {"source": "tiny"},
                "traces": {"store": "s.sqlite"},
                "improve": {"gate": "none", "gateways": [{"url": url}]},
            },
            required=(),
        )


# --- a new user's first minutes ---------------------------------------------------------------------------
@pytest.mark.timing
def test_a_busy_port_is_one_line_before_anything_loads(tmp_path):
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        started = time.monotonic()
        train = subprocess.run(
            [sys.executable, "-m", "agl_core.cli", "train", str(root / "examples/calc_autogen/config.yaml")]
            + ["--set", f"gateway.port={port}", "--set", f"output_dir={tmp_path / 'run'}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        took = time.monotonic() - started
        gateway = subprocess.run(
            [sys.executable, "-m", "agl_core.cli", "gateway", "serve", "--backend", "hf", "--model", "tiny"]
            + ["--port", port],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert train.returncode == 2, train.stdout + train.stderr
    assert train.stderr.strip().splitlines() == [
        f"agl train: cannot listen on 127.0.0.1:{port}: Address already in use; pick another port"
        " (gateway.port in the config, or --set gateway.port=0 for any free port)"
    ]
    assert "Traceback" not in train.stderr and took < 60
    assert gateway.returncode == 2 and "(--port PORT)" in gateway.stderr
    assert "serving" not in gateway.stdout and "Traceback" not in gateway.stderr


def test_inspect_says_where_the_gateway_recorded_a_hand_run_agents_call(tmp_path, capsys):
    from agl_core.cli import main
    from agl_core.store import SqliteStore

    db = tmp_path / "s.sqlite"
    store = SqliteStore(db)
    agent = make_span(
        "agent run", {semconv.ROLLOUT_ID: "imp-t-mine", semconv.GEN_AI_OPERATION_NAME: "invoke_agent"}
    )
    call = make_span(
        "chat smollm2",
        {
            semconv.ROLLOUT_ID: "imp-t-mine",
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_RESPONSE_ID: "chatcmpl-42",
        },
        parent=agent,
    )
    gateway = make_span(
        "chat agl-policy",
        {
            semconv.ROLLOUT_ID: "imp-s-session",
            semconv.SOURCE: semconv.SOURCE_GATEWAY,
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_RESPONSE_ID: "chatcmpl-42",
            semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
            semconv.RESPONSE_TOKEN_IDS: [4],
            semconv.POLICY_VERSION: 0,
        },
    )
    store.add_spans([agent, call, gateway])
    store.add_observed_rollouts([{"rollout_id": "imp-t-mine"}, {"rollout_id": "imp-s-session"}])
    store.close()
    assert main(["inspect", "imp-t-mine", "--store", str(db)]) == 0
    out = capsys.readouterr().out
    assert "LLM call has no gateway span with token ids" in out
    assert "it did go through the gateway, which recorded it in rollout imp-s-session" in out
    assert "agl inspect imp-s-session" in out


@pytest.mark.parametrize(
    "command",
    [
        ["import", "{file}", "--store", "{db}"],
        ["dashboard", "--store", "{db}", "--port", "0"],
    ],
)
def test_commands_that_open_a_postgres_store_never_print_its_password(tmp_path, command):
    import subprocess
    import sys

    secret = "pw-4f1c9"
    file = tmp_path / "t.jsonl"
    file.write_text("{}\n")
    db = f"postgresql://agl:{secret}@127.0.0.1:1/prod"
    args = [a.format(file=file, db=db) for a in command]
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "agl:***@127.0.0.1:1" in done.stderr and secret not in done.stdout + done.stderr


def test_a_store_s_own_reward_range_governs_its_api_and_its_otlp_ingest(sqlite_store):
    """One range, the store's: the API and OTLP ingest of an app made over the store alone take it."""
    from agl_core.pipeline.rewards import RewardRange
    from agl_core.testing import Collector

    sqlite_store.reward_range = RewardRange(0, 1)
    sqlite_store.enqueue_rollouts([{"task_id": "t", "rollout_id": "ro-1"}])
    with Collector(sqlite_store) as server:
        r = httpx.post(
            server.url + "/api/rewards",
            json={"rewards": [{"reward_id": "a", "value": 2, "rollout_id": "ro-1"}]},
        )
        assert r.status_code == 400 and "rewards.0.value: reward 2" in r.json()["error"]["message"], r.text
        request = ExportTraceServiceRequest()
        span = (
            request.resource_spans.add()
            .scope_spans.add()
            .spans.add(trace_id=b"\x07" * 16, span_id=b"\x07" * 8, name=semconv.SPAN_REWARD)
        )
        span.attributes.add(key=semconv.REWARD_VALUE).value.double_value = 5.0
        r = httpx.post(
            server.url + "/v1/traces",
            content=request.SerializeToString(),
            headers={"content-type": "application/x-protobuf"},
        )
        assert r.status_code == 200 and sqlite_store.stats()["spans"] == 0


@pytest.mark.parametrize(
    ("bounds", "message"), [([1, 0], "finite MIN < MAX"), ([0, 1e16], "within ±1e15"), ([0, "x"], "number")]
)
def test_rollback_reward_range_refuses_bad_bounds(bounds, message):
    from agl_trainer.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict(
            {
                "model": {"source": "tiny"},
                "traces": {"store": "http://127.0.0.1:1"},
                "improve": {"gate": "none", "rollback": {"reward_range": bounds}},
            },
            required=(),
        )
