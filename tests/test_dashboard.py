"""The web dashboard's data: ``agl dashboard`` over a store filled by a real short run (the tiny model,
``agl train`` in a subprocess with ``logging.dashboard`` on), the rollout listing on SQLite and PostgreSQL,
validation of every parameter, the token, and span content kept inert."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from agl_core.dashboard import create_dashboard_app
from agl_core.store import RolloutFilter, SqliteStore

from ._training import metrics_rows, train_cli

#: Span content a hostile agent could record; the dashboard must show it as text.
HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1"><script>document.body.dataset.pwned=2</script>'

AGENT = f"""
import itertools
import openai
from agl_core import agent_span, tool_call

HOSTILE = {HOSTILE!r}
_calls = itertools.count()

def solve(task, llm):
    with agent_span("writer"):
        client = openai.OpenAI(base_url=llm.for_agent("writer").base_url, api_key=llm.api_key, max_retries=0)
        reply = client.chat.completions.create(
            model=llm.model, messages=[{{"role": "user", "content": task["q"]}}], max_tokens=6
        )
        with tool_call("lookup", arguments={{"q": task["q"] + HOSTILE}}):  # recorded in the span
            pass
    if next(_calls) % 5 == 4:  # every fifth rollout fails
        raise RuntimeError("this task always fails " + HOSTILE)
    text = reply.choices[0].message.content or ""
    return float(len(text) % 3) / 2.0
"""


def _write_job(root: Path) -> Path:
    (root / "agent.py").write_text(AGENT)
    tasks = [{"id": f"t{i}", "q": f"count to {i}"} for i in range(8)]
    (root / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (root / "val.jsonl").write_text(
        "".join(json.dumps({"id": f"v{i}", "q": f"say {i}"}) + "\n" for i in range(3))
    )
    (root / "config.yaml").write_text(
        f"agent: agent:solve\ntasks: {{train: tasks.jsonl, val: val.jsonl}}\noutput_dir: {root / 'run'}\n"
        "model: {source: tiny, lora: null}\n"
        "gateway: {default_max_tokens: 6, token: gw-secret-41}\n"
        "runner: {workers: 2}\n"
        "train: {steps: 2, tasks_per_step: 3, rollouts_per_task: 2, seed: 3}\n"
        "logging: {plot: false, tensorboard: false, dashboard: true, dashboard_port: 0}\n"
    )
    return root / "config.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real two-step run of the tiny model; its output directory and what it printed."""
    root = tmp_path_factory.mktemp("dashboard")
    config = _write_job(root)
    sys.path.insert(0, str(root))
    done = train_cli(config, timeout=600)
    return {"out": root / "run", "stdout": done.stdout, "config": config}


@pytest.fixture()
def app_client(run: dict[str, Any]) -> Any:
    store = SqliteStore(run["out"] / "store.sqlite")
    try:
        with TestClient(create_dashboard_app(store, [run["out"].parent])) as client:
            yield client
    finally:
        store.close()


def test_the_trainer_prints_the_dashboard_url_and_records_the_run(run):
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/", run["stdout"]), run["stdout"][-2000:]
    info = json.loads((run["out"] / "run.json").read_text())
    assert info["status"] == "finished" and info["steps"] == 2
    assert info["config"]["model"]["source"] == "tiny"
    assert info["ended_at"] >= info["started_at"]
    assert info["phase"] is None  # a finished run is doing nothing
    # the console says what a long silent phase is doing before it starts
    assert "validation (before training): scoring 3 held-out task(s) x 1 rollout(s)..." in run["stdout"]
    # secrets in the config are masked before they reach disk (and the dashboard)
    assert "gw-secret-41" not in (run["out"] / "run.json").read_text()
    assert info["config"]["gateway"]["token"] == "***"


def test_runs_list_and_one_run_show_status_curves_and_held_out_results(app_client, run):
    runs = app_client.get("/api/runs").json()["runs"]
    assert [r["name"] for r in runs] == ["run"]
    (summary,) = runs
    assert summary["status"] == "finished" and summary["step"] == 2 and summary["steps"] == 2
    assert summary["val_first"] is not None and summary["val_last"] is not None
    assert summary["eta_s"] is None  # finished
    detail = app_client.get("/api/runs/run").json()
    rows = metrics_rows(run["out"], "train")
    assert [r["step"] for r in detail["train"]] == [r["step"] for r in rows]
    assert [r["mean_reward"] for r in detail["train"]] == [r["mean_reward"] for r in rows]
    assert "rollout_ids" not in detail["train"][0]  # the curves leave the heavy lists out
    assert all("kl" in r and "phases" in r for r in detail["train"])
    held = detail["held_out"]
    val = metrics_rows(run["out"], "val")
    assert held["before"]["mean"] == val[0]["mean"] and held["after"]["mean"] == val[-1]["mean"]
    assert {t["task"] for t in held["tasks"]} == {"v0", "v1", "v2"}
    for t in held["tasks"]:
        assert t["change"] == pytest.approx(t["after"] - t["before"])
    assert detail["config"]["train"]["steps"] == 2
    assert app_client.get("/api/runs/nope").status_code == 404
    # the name its rollouts carry (metadata["run"]): the run page's step links filter on it
    assert detail["rollouts_run"] == "run"
    step_rows = app_client.get("/api/rollouts", params={"run": "run", "step": 1, "limit": 500}).json()[
        "rollouts"
    ]
    assert step_rows and all(r["run"] == "run" and r["step"] == 1 for r in step_rows)
    assert app_client.get("/api/rollouts", params={"run": "other", "step": 1}).json()["rollouts"] == []
    # what a browser asks for by itself is served (it was a 404 on every load)
    icon = app_client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
    assert app_client.get("/static/icon.svg").status_code == 200


def test_a_running_run_shows_what_it_is_doing(tmp_path):
    out = tmp_path / "runs" / "live"
    out.mkdir(parents=True)
    started = time.time() - 30
    info = {"title": "agent:solve", "status": "running", "steps": 4, "started_at": started}
    info |= {"pid": os.getpid(), "host": socket.gethostname(), "phase": "held-out pass before training"}
    (out / "run.json").write_text(json.dumps({**info, "phase_started_at": started + 5}))
    store = SqliteStore(tmp_path / "s.sqlite")
    try:
        with TestClient(create_dashboard_app(store, [tmp_path / "runs"])) as client:
            (summary,) = client.get("/api/runs").json()["runs"]
    finally:
        store.close()
    assert summary["phase"] == "held-out pass before training"
    assert summary["phase_started_at"] == pytest.approx(started + 5)


def test_rollout_table_filters_and_pages(app_client, run):
    everything = app_client.get("/api/rollouts", params={"limit": 500}).json()
    ids = [r["rollout_id"] for r in everything["rollouts"]]
    assert everything["total"] == len(ids) > 0 and everything["before"] is None
    assert len(set(ids)) == len(ids)
    # pages of 4 walk the same rollouts, newest first
    walked, before = [], None
    while True:
        page = app_client.get(
            "/api/rollouts", params={"limit": 4, **({"before": before} if before else {})}
        ).json()
        walked += [r["rollout_id"] for r in page["rollouts"]]
        before = page["before"]
        if before is None:
            break
    assert walked == ids
    rows = everything["rollouts"]
    failed = app_client.get("/api/rollouts", params={"status": "failed"}).json()
    assert failed["total"] == sum(r["status"] == "failed" for r in rows) > 0
    assert "this task always fails" in failed["rollouts"][0]["error"]
    step2 = app_client.get("/api/rollouts", params={"step": 2, "split": "train"}).json()
    assert step2["total"] == sum(r["step"] == 2 and r["split"] == "train" for r in rows) > 0
    rewarded = [r["reward"] for r in rows if r["reward"] is not None]
    high = app_client.get("/api/rollouts", params={"reward_min": 0.5}).json()
    assert high["total"] == sum(v >= 0.5 for v in rewarded)
    writer = app_client.get("/api/rollouts", params={"agent": "writer", "limit": 500}).json()
    assert writer["total"] == sum(r["spans"] > 0 for r in rows)
    assert app_client.get("/api/rollouts", params={"agent": "nobody"}).json()["total"] == 0
    tagged = app_client.get("/api/rollouts", params={"run": "run", "limit": 500}).json()
    assert tagged["total"] == everything["total"]  # every rollout names the run that queued it
    assert app_client.get("/api/rollouts", params={"run": "another-run"}).json()["total"] == 0
    by_task = app_client.get("/api/rollouts", params={"task": "t1"}).json()
    assert all(r["task_id"] == "t1" for r in by_task["rollouts"])
    # search: the tool span's argument text (each rollout asked about its own task's question)
    counted = app_client.get("/api/rollouts", params={"search": "count to 3", "limit": 500}).json()
    assert counted["total"] >= 1 and all(r["task_id"] == "t3" for r in counted["rollouts"])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"status": "exploded"}, "unknown status"),
        ({"step": "two"}, "step must be a whole number"),
        ({"step": "-1"}, "step must be between"),
        ({"reward_min": "nan"}, "finite"),
        ({"reward_min": "1", "reward_max": "0"}, "above reward_max"),
        ({"limit": "100000"}, "limit must be between"),
        ({"agent": "x" * 300}, "at most 256"),
        ({"search": "x" * 300}, "search must be at most 256"),
        ({"before": "abc"}, "before must be a whole number"),
    ],
)
def test_bad_parameters_get_a_clear_400(app_client, params, message):
    response = app_client.get("/api/rollouts", params=params)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_one_rollout_shows_its_timeline_transitions_and_why_a_call_did_not_train(app_client, run):
    rows = app_client.get("/api/rollouts", params={"limit": 500, "split": "train"}).json()["rollouts"]
    done = next(r for r in rows if r["status"] == "succeeded")
    detail = app_client.get(f"/api/rollouts/{done['rollout_id']}").json()
    kinds = {s["kind"] for s in detail["spans"]}
    assert {"agent", "tool", "gateway"} <= kinds, kinds
    assert any(s["agent"] == "writer" for s in detail["spans"])
    assert all(s["start_ms"] >= 0 and s["duration_ms"] >= 0 for s in detail["spans"])
    (call,) = detail["transitions"]
    assert call["agent"] == "writer" and call["response_tokens"] == len(call["response"]) > 0
    assert call["decoded"] is True  # the tiny model's tokenizer is on this machine
    assert all(isinstance(t["logprob"], float) and t["logprob"] <= 0 for t in call["response"])
    assert isinstance(call["prompt"], str) and "count to" in call["prompt"]
    # the trainer's own rules: a call trains with an advantage, or says why not
    assert (call["advantage"] is not None) == call["trained"]
    if not call["trained"]:
        assert call["reason"]
    assert len(detail["group"]) == 1  # rollouts_per_task 2: one sibling
    assert detail["rollout"]["run"] == "run" and detail["rollout"]["step"] in (1, 2)
    failed = next(r for r in rows if r["status"] == "failed")
    bad = app_client.get(f"/api/rollouts/{failed['rollout_id']}").json()
    assert bad["untrained"] and bad["rollout"]["attempts"][-1]["error"].startswith("RuntimeError")
    assert app_client.get("/api/rollouts/no-such-rollout").status_code == 404


def test_span_content_is_served_as_json_never_markup(app_client, run):
    rows = app_client.get("/api/rollouts", params={"status": "failed"}).json()["rollouts"]
    response = app_client.get(f"/api/rollouts/{rows[0]['rollout_id']}")
    assert response.headers["content-type"] == "application/json"
    assert any(
        HOSTILE in text for text in _strings(response.json())
    )  # as it was, for the page to show as text
    page = app_client.get("/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    script = app_client.get("/static/app.js").text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script
    assert app_client.get("/static/../run.json").status_code == 404


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_a_token_guards_every_data_endpoint(run):
    store = SqliteStore(run["out"] / "store.sqlite")
    try:
        app = create_dashboard_app(store, [run["out"]], token="s3cret")
        with TestClient(app, follow_redirects=False) as client:
            for path in ("/api/runs", "/api/rollouts", "/api/stats", "/api/runs/run"):
                assert client.get(path).status_code == 401, path
            assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert client.get("/?token=wrong").status_code == 401
            opened = client.get("/?token=s3cret")
            assert opened.status_code == 303 and "httponly" in opened.headers["set-cookie"].lower()
            assert client.get("/api/stats").status_code == 200  # the cookie now
    finally:
        store.close()


def test_agl_dashboard_cli_serves_a_run_directory_and_refuses_unsafe_or_bad_input(run, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("AGL_STORE_TOKEN", None)

    def dashboard(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agl_core.cli", "dashboard", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    refused = dashboard("--runs", str(run["out"]), "--host", "0.0.0.0")
    assert refused.returncode == 2 and "--token" in refused.stderr
    missing = dashboard("--runs", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    no_store = dashboard("--store", str(tmp_path / "typo.sqlite"))
    assert no_store.returncode == 2 and "nor an existing SQLite file" in no_store.stderr
    assert not (tmp_path / "typo.sqlite").exists()  # a mistyped path is not created as an empty store
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "dashboard", "--runs", str(run["out"]), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            found = re.search(r"open (http://\S+)", line)
            url = found.group(1) if found else None
        assert url, "agl dashboard printed no URL"
        base = url.rstrip("/")
        runs = httpx.get(f"{base}/api/runs", timeout=30).json()["runs"]
        assert runs[0]["status"] == "finished"
        stats = httpx.get(f"{base}/api/stats", timeout=30).json()
        assert stats["rollouts"] > 0  # it found the run's embedded store by itself
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_listing_reads_the_same_on_sqlite_and_postgresql(store):
    """``Store.list_rollouts`` on both backends: filters on status, task, group, metadata, reward and
    agent; keyset pages; a capped count."""
    from agl_core import semconv
    from agl_core.records import RolloutStatus

    from .conftest import make_span

    made = store.enqueue_rollouts(
        [
            {
                "task_id": f"t{i % 3}",
                "input": i,
                "group_id": f"g{i % 2}",
                "metadata": {"step": i % 4, "split": "train"},
            }
            for i in range(12)
        ]
    )
    for _ in range(5):
        claimed = store.dequeue_rollout("w")
        assert claimed is not None
        rollout, attempt = claimed
        store.complete_attempt(attempt.attempt_id, RolloutStatus.SUCCEEDED, reward=rollout.input / 10)
    named = made[0].rollout_id
    store.add_spans(
        [
            make_span(
                "invoke_agent critic",
                {semconv.ROLLOUT_ID: named, semconv.GEN_AI_AGENT_NAME: "critic", "note": "critic"},
            ),
            # the name appearing as plain text elsewhere does not count
            make_span("chat", {semconv.ROLLOUT_ID: made[1].rollout_id, "note": "critic"}),
        ]
    )
    page = store.list_rollouts(limit=5)
    assert [r.rollout_id for r in page.rollouts] == [r.rollout_id for r in reversed(made)][:5]
    rest = store.list_rollouts(before=page.before, limit=50)
    assert len(rest.rollouts) == 7 and rest.before is None and page.total == 12
    assert store.list_rollouts(RolloutFilter(statuses=("succeeded",))).total == 5
    assert store.list_rollouts(RolloutFilter(step=1)).total == 3
    assert store.list_rollouts(RolloutFilter(step=1, split="val")).total == 0
    assert store.list_rollouts(RolloutFilter(group_id="g0", task_id="t0")).total == 2
    assert store.list_rollouts(RolloutFilter(reward_min=0.2, reward_max=0.3)).total == 2
    agent = store.list_rollouts(RolloutFilter(agent="critic"))
    assert [r.rollout_id for r in agent.rollouts] == [named]
    assert agent.span_counts == {named: 1}


# --- in a real browser: Debian's Chromium, headless, driven by Playwright ---------------------------


@pytest.fixture(scope="module")
def browser() -> Any:
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("AGL_TEST_CHROMIUM", "/usr/bin/chromium")
    assert Path(chromium).is_file(), (
        f"{chromium} is missing: bash scripts/setup.sh installs Debian's chromium"
    )
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def served(run: dict[str, Any]) -> Any:
    """The dashboard over the run, on a real port, with a token."""
    from agl_core.server import BackgroundServer

    store = SqliteStore(run["out"] / "store.sqlite")
    server = BackgroundServer(
        create_dashboard_app(store, [run["out"].parent], token="tok-123"), "127.0.0.1", 0
    )
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
        store.close()


@pytest.fixture()
def page(browser: Any, served: str, tmp_path: Path) -> Any:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.goto(f"{served}/?token=tok-123")  # sets the cookie, then the page
    opened.errors = errors
    yield opened
    context.close()
    assert not errors, errors


SHOTS = (
    Path(os.environ.get("AGL_DASHBOARD_SCREENSHOTS", ""))
    if os.environ.get("AGL_DASHBOARD_SCREENSHOTS")
    else None
)


def _ready(page: Any, check: Any, timeout_s: float = 15.0) -> str:
    """Wait until ``check(document.body.dataset.ready)`` holds (the page's CSP forbids the string
    predicates Playwright would evaluate in the page, so this polls from here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = page.evaluate("() => document.body.dataset.ready")
        if ready is not None and check(ready):
            return str(ready)
        assert time.monotonic() < deadline, f"the page never got ready (last: {ready!r})"
        time.sleep(0.03)


def _visit(page: Any, hash_: str, tmp_path: Path, name: str) -> float:
    """Open ``#hash_`` and wait until the view has rendered; returns the seconds it took."""
    started = time.monotonic()
    page.evaluate("h => { location.hash = h; }", hash_)
    _ready(page, lambda ready: ready == hash_.lstrip("#"))
    took = time.monotonic() - started
    for folder in filter(None, (tmp_path, SHOTS)):
        folder.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(folder / f"{name}.png"), full_page=True)
    return took


def test_browser_runs_page_lists_the_run_and_its_progress(page, tmp_path):
    _visit(page, "#/", tmp_path, "runs")
    row = page.locator("tr[data-run='run']")
    assert row.count() == 1
    assert "finished" in row.inner_text() and "step 2 / 2" in row.inner_text()
    assert row.locator("a").inner_text() == "run"  # named by its output folder, the agent beside it
    assert "agent:solve" in row.inner_text()
    assert (tmp_path / "runs.png").stat().st_size > 10_000
    assert page.locator("#store-stats").inner_text().startswith("store:")


def test_browser_run_page_draws_curves_and_held_out_results(page, run, tmp_path):
    _visit(page, "#/run/run", tmp_path, "run")
    for title in ("Reward", "Loss", "KL", "Tokens/s", "LLM calls per agent", "Step time (s)"):
        assert page.locator(f"[data-chart='{title}']").count() == 1, title
    # the reward chart has a point per training step, with its value in the tooltip
    train = metrics_rows(run["out"], "train")
    tips = page.locator("[data-chart='Reward'] circle title").evaluate_all("ns => ns.map(n => n.textContent)")
    for row in train:
        assert any(t.startswith(f"train @ step {row['step']}:") for t in tips), tips
    assert any(t.startswith("held-out @ step 0:") for t in tips)
    assert "writer calls" in page.locator("[data-chart='LLM calls per agent']").inner_text()
    held = page.locator("text=tasks changed").inner_text()
    assert "before (step 0)" in held
    assert page.locator("table[data-test='steps'] tr").count() == 1 + len(train)
    # each step's rollouts link lists this run's rollouts of that step (it once listed every run's)
    links = page.locator("[data-test='steps-link']").evaluate_all("ns => ns.map(n => n.getAttribute('href'))")
    assert sorted(links) == sorted(f"#/rollouts?run=run&step={row['step']}" for row in train)
    # axes: round ticks, from zero for series that never go below it, every label inside the chart
    for title in ("Tokens/s", "Step time (s)", "Peak RSS (MB)", "KL", "Loss"):
        chart = page.locator(f"[data-chart='{title}'] svg")
        if chart.count() == 0:
            continue  # no data for it in this run
        labels = chart.locator("text[data-tick='y']")
        ticks = [float(t) for t in labels.evaluate_all("ns => ns.map(n => n.textContent)")]
        steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
        assert len(steps) == 1, (title, ticks)  # evenly spaced
        (step,) = steps
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-6, (title, ticks)  # 1, 2 or 5 x 10^k
        if title not in ("Loss", "KL"):  # times, rates, memory: never below zero (an approximate KL can be)
            assert ticks[0] == 0, (title, ticks)
        box = chart.bounding_box()
        for label in labels.all():
            where = label.bounding_box()
            assert where["x"] >= box["x"] - 0.5, (title, ticks)  # not clipped at the left
    lines = page.locator("[data-chart='Step time (s)'] polyline")
    dashes = lines.evaluate_all("ns => ns.map(n => n.getAttribute('stroke-dasharray'))")
    assert len(dashes) >= 2 and len(set(dashes)) >= 2, dashes  # series on top of each other stay apart


def test_browser_rollouts_filter_pages_and_open_a_rollout(page, tmp_path):
    _visit(page, "#/rollouts", tmp_path, "rollouts")
    all_rows = page.locator("tr[data-rollout]").count()
    assert all_rows > 0
    total = int(page.locator("[data-test='total']").inner_text().split()[0].replace(",", ""))
    page.select_option("select[name='status']", "failed")
    page.click("form.filters button[type='submit']")
    _ready(page, lambda ready: "status=failed" in ready)
    failed = page.locator("tr[data-rollout]")
    assert 0 < failed.count() < total
    assert all("failed" in text for text in failed.all_inner_texts())
    # the hostile error text shows as text: no element was injected, no script ran
    assert "<img src=x" in failed.first.inner_text()
    assert page.evaluate("() => document.body.dataset.pwned") is None
    assert page.locator("main img").count() == 0
    _visit(page, "#/rollouts?limit=3", tmp_path, "rollouts-page1")
    first = page.locator("tr[data-rollout]").all_inner_texts()
    page.click("text=Older →")
    _ready(page, lambda ready: "before=" in ready)
    second = page.locator("tr[data-rollout]").all_inner_texts()
    assert len(first) == 3 and second and not set(first) & set(second)
    page.click("text=← Newer")
    _ready(page, lambda ready: "before=" not in ready)
    assert page.locator("tr[data-rollout]").all_inner_texts() == first


def test_browser_rollout_page_shows_timeline_tokens_and_reasons(page, app_client, tmp_path):
    rows = app_client.get("/api/rollouts", params={"limit": 500, "split": "train"}).json()["rollouts"]
    done = next(r for r in rows if r["status"] == "succeeded")
    _visit(page, f"#/rollout/{done['rollout_id']}", tmp_path, "rollout")
    timeline = page.locator("[data-test='timeline'] .tl-row[data-span]")
    assert timeline.count() == done["spans"]
    ticks = page.locator("[data-test='time-axis'] .tl-tick").all_inner_texts()
    assert len(ticks) >= 3 and ticks[0] in ("0 ms", "0 s"), ticks  # a time axis from the first span
    assert page.locator(".tl-bar.gateway").count() == 1 and page.locator(".tl-bar.tool").count() == 1
    text = page.locator("[data-test='timeline']").inner_text()
    assert "agent=writer" in text and "→ call 0" in text
    # the tool returned hostile markup: shown in the span's attributes as text
    page.locator(".tl-row", has_text="lookup").first.click()
    assert "<script>" in page.locator(".attrs:visible").inner_text()
    assert page.evaluate("() => document.body.dataset.pwned") is None
    call = page.locator("[data-call='0']")
    tokens = call.locator("span.tok")
    assert tokens.count() > 0
    shades = {tokens.nth(i).evaluate("n => n.style.background") for i in range(tokens.count())}
    assert all(s.startswith("rgba(200, 50, 60") for s in shades)
    assert "advantage:" in call.inner_text()
    # from the rollout to its run, and to the rollouts of its run's step
    assert page.locator("[data-test='run-link']").get_attribute("href") == "#/run/run"
    step_link = page.locator("[data-test='step-link']").get_attribute("href")
    assert step_link == f"#/rollouts?run=run&step={done['step']}"
    failed = next(r for r in rows if r["status"] == "failed")
    _visit(page, f"#/rollout/{failed['rollout_id']}", tmp_path, "rollout-failed")
    assert "Did not train: the rollout failed" in page.locator("[data-test='untrained']").inner_text()


def test_browser_without_the_token_shows_what_to_do(browser, served):
    context = browser.new_context()
    try:
        opened = context.new_page()
        opened.goto(f"{served}/#/")
        _ready(opened, lambda ready: True)
        assert "needs its token" in opened.locator("[data-test='error']").inner_text()
    finally:
        context.close()


def test_the_store_api_lists_rollouts_for_a_remote_dashboard(client):
    """``POST /api/rollouts/list`` through ``StoreClient``, and its validation."""
    made = client.enqueue_rollouts(
        [{"task_id": f"t{i}", "input": i, "metadata": {"step": i}} for i in range(7)]
    )
    page = client.list_rollouts(RolloutFilter(statuses=("queued",)), limit=3)
    assert [r.rollout_id for r in page.rollouts] == [r.rollout_id for r in reversed(made)][:3]
    assert page.total == 7 and page.before is not None
    rest = client.list_rollouts(RolloutFilter(statuses=("queued",)), before=page.before, limit=10)
    assert len(rest.rollouts) == 4 and rest.before is None
    assert client.list_rollouts(RolloutFilter(step=3)).total == 1
    for body, message in (
        ({"statuses": ["exploded"]}, "statuses"),
        ({"reward_min": 2, "reward_max": 1}, "above reward_max"),
        ({"limit": 0}, "limit"),
        ({"colour": "red"}, "colour"),
    ):
        response = httpx.post(f"{client.url}/api/rollouts/list", json=body, timeout=30)
        assert response.status_code == 400, body
        assert message in response.json()["error"]["message"], response.text


def test_without_its_own_token_the_dashboard_asks_one_derived_from_the_stores_never_the_stores(monkeypatch):
    """The dashboard once reused the store token: its start line and visitors' cookies then carried a
    token that grants every store endpoint. Now it asks a token of its own, derived from the store's."""
    from agl_core import settings
    from agl_core.testing import Collector

    monkeypatch.delenv("AGL_DASHBOARD_TOKEN", raising=False)
    monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
    derived = settings.dashboard_token(None, "store-s3cret")
    assert derived is not None and derived.startswith("agl-dash-") and "store-s3cret" not in derived
    assert derived == settings.dashboard_token(None, "store-s3cret")  # the same every start
    assert settings.dashboard_token(None, "other") != derived
    assert settings.dashboard_token("mine", "store-s3cret") == "mine"
    assert settings.dashboard_token(None, None) is None
    with Collector(token="store-s3cret") as collector:
        refused = httpx.get(collector.url + "/api/stats", headers={"Authorization": f"Bearer {derived}"})
        assert refused.status_code == 401  # it opens the dashboard only
        app = create_dashboard_app(collector.client, [], token=derived)
        with TestClient(app, follow_redirects=False) as client:
            assert (
                client.get("/api/stats", headers={"Authorization": "Bearer store-s3cret"}).status_code == 401
            )
            assert client.get("/api/stats", headers={"Authorization": f"Bearer {derived}"}).status_code == 200


def test_the_gateway_span_is_shown_under_the_llm_call_it_served():
    """The gateway records a call in a trace of its own (no context propagated): the timeline puts it under
    the framework's LLM span it was joined to, not beside the rollout's tree."""
    from agl_core.dashboard._rollout import _timeline
    from tests.conftest import make_span

    agent = make_span("agent")
    llm = make_span("chat", parent=agent)
    gateway = make_span("gateway.chat")  # a root, in another trace
    rows = {r["span_id"]: r for r in _timeline([agent, llm, gateway], {}, {}, {llm.span_id: gateway.span_id})}
    assert rows[gateway.span_id]["parent_span_id"] == llm.span_id
    assert rows[gateway.span_id]["depth"] == rows[llm.span_id]["depth"] + 1 == 2
    alone = {r["span_id"]: r for r in _timeline([agent, llm, gateway], {}, {})}
    assert alone[gateway.span_id]["depth"] == 0  # without the join it stays a root


def test_browser_compares_two_runs_on_the_same_curves(browser, run, tmp_path):
    """Two runs (the same run's output copied under another name, with another learning rate in its
    config): ticked on the runs page, compared on one page with a series per run and what differs."""
    import shutil

    from agl_core.server import BackgroundServer

    root = tmp_path / "runs"
    shutil.copytree(run["out"], root / "lr-a", ignore=shutil.ignore_patterns("store.sqlite*"))
    shutil.copytree(run["out"], root / "lr-b", ignore=shutil.ignore_patterns("store.sqlite*"))
    info = json.loads((root / "lr-b" / "run.json").read_text())
    info["config"]["algorithm"]["learning_rate"] = 0.5
    (root / "lr-b" / "run.json").write_text(json.dumps(info))
    store = SqliteStore(tmp_path / "empty.sqlite")
    server = BackgroundServer(create_dashboard_app(store, [root]), "127.0.0.1", 0).start()
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url + "/")
        _ready(page, lambda ready: ready == "/")
        assert page.locator("button[data-test='compare']").is_disabled()
        page.check("input[data-pick='lr-a']")
        page.check("input[data-pick='lr-b']")
        assert page.evaluate("() => location.hash") in ("", "#/")  # ticking does not open a run
        page.click("button[data-test='compare']")
        _ready(page, lambda ready: ready.startswith("/compare"))
        legend = page.locator("[data-chart='Reward'] .legend").inner_text()
        assert "lr-a" in legend and "lr-b" in legend
        assert page.locator("[data-chart='Reward'] polyline").count() == 2
        assert page.locator("[data-chart='Held-out reward'] circle").count() == 4  # before and after, twice
        rows = page.locator("table[data-test='compared']").inner_text()
        assert "algorithm.learning_rate=0.5" in rows
        page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
        page.evaluate("() => { location.hash = '#/compare?runs=lr-a'; }")
        _ready(page, lambda ready: ready == "/compare?runs=lr-a")
        assert "choose two runs or more" in page.locator("main").inner_text()
        assert not errors, errors
    finally:
        context.close()
        server.stop()
        store.close()


def test_browser_a_slow_earlier_page_never_draws_over_the_one_asked_for_since(page, tmp_path):
    """Under load the runs list answered after the rollouts page the user had gone on to, and drew the runs
    over it (a flaky failure of the rollouts test in a full run): a view whose data arrives after a later
    navigation stops."""
    held: list[Any] = []
    page.route("**/api/runs", lambda route: held.append(route))
    page.evaluate("() => { location.hash = '#/'; }")
    deadline = time.monotonic() + 15
    while not held:  # the runs view waits for its data
        assert time.monotonic() < deadline, "the runs view asked for nothing"
        page.wait_for_timeout(20)
    _visit(page, "#/rollouts", tmp_path, "rollouts-first")
    assert page.locator("tr[data-rollout]").count() > 0
    held[0].continue_()  # the earlier view's answer arrives last
    page.wait_for_timeout(500)
    assert page.locator("main h1").inner_text() == "Rollouts"
    assert page.locator("tr[data-rollout]").count() > 0
    page.unroute("**/api/runs")


def _put_lineage(run: dict[str, Any]) -> None:
    """An ``agl improve`` lineage in the run's store: the base serving, one candidate refused by the gate,
    its note hostile markup."""
    from agl_trainer.improve.state import GateRecord, ImproveState, Version

    state = ImproveState.new("calc", None)
    state.rounds, state.waiting = 1, "waiting for data: 3 of 24 new rewarded rollouts"
    state.live = {"0": {"mean": 0.625, "se": 0.0484, "sessions": 24, "left_out": 1}}
    gate = GateRecord("refused", "worse than the serving version", 0.4, 0.6, -0.2, 0.05, 40)
    state.versions.append(
        Version(
            1,
            "refused",
            parent=0,
            round=1,
            trained_on=["a", "b"],
            gate=gate,
            note="<img src=x onerror=document.body.dataset.pwned=1>",
        )
    )
    store = SqliteStore(run["out"] / "store.sqlite")
    try:
        store.put_resource("agl.improve.calc", state.to_json(with_consumed=False))
    finally:
        store.close()


def test_improve_lineage_is_served_and_drawn_as_text(page, app_client, run, tmp_path):
    _put_lineage(run)
    data = app_client.get("/api/improve/calc").json()
    assert [v["status"] for v in data["lineage"]["versions"]] == ["serving", "refused"]
    missing = app_client.get("/api/improve/nope")
    assert missing.status_code == 404 and "improve.name" in missing.json()["error"]["message"]
    assert app_client.get("/api/improve/..bad").status_code == 400
    _visit(page, "#/improve?name=calc", tmp_path, "improve")
    rows = page.locator("tr[data-version]")
    assert rows.count() == 2
    refused = rows.first.inner_text()
    assert "refused" in refused and "-0.2 ± 0.05 (n=40)" in refused and "0.6 → 0.4" in refused
    assert "<img src=x" in refused and page.evaluate("() => document.body.dataset.pwned") is None
    assert "waiting for data" in page.locator("[data-test='waiting']").inner_text()
    assert rows.last.locator("[data-test='live']").inner_text() == "0.625 ± 0.0484 (24, 1 left out)"
    assert rows.first.locator("[data-test='live']").inner_text() == "–"
    assert "running" in page.locator(".cards").inner_text()  # written just now, never stopped
