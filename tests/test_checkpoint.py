"""Checkpoints and ``agl train --resume``: a run killed with SIGKILL continues without repeating or
skipping a step, and draws the same tasks an uninterrupted run draws."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agl_trainer.learning.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from agl_trainer.model import load_policy

AGENT = """
import time
import openai

def solve(task, llm):
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    out = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4)
    time.sleep(0.05)
    return float(len(out.choices[0].message.content or "") % 3) / 2
"""

CONFIG = """
agent: agent:solve
tasks: {train: tasks.jsonl, val_fraction: 0.2}
model: {source: tiny, lora: {r: 4, alpha: 8}}
gateway: {default_max_tokens: 4}
train: {steps: 5, tasks_per_step: 2, rollouts_per_task: 2, seed: 7}
validation: {max_tasks: 2}
checkpoint: {every_steps: 1, keep: 2}
logging: {plot: false, tensorboard: false}
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text(
        "".join(json.dumps({"id": f"t{i}", "q": f"say {i}"}) + "\n" for i in range(20))
    )
    (tmp_path / "config.yaml").write_text(CONFIG)
    return tmp_path


def _cmd(job: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "agl_core.cli",
        "train",
        str(job / "config.yaml"),
        "--set",
        f"output_dir={out}",
        *extra,
    ]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _lora_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _lora_model():
    from peft import LoraConfig, get_peft_model

    model, _ = load_policy("tiny", seed=0)
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )


def test_lora_checkpoint_round_trip(tmp_path):
    model = _lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    saved = _lora_tensors(model)
    rng = torch.get_rng_state()
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path, step, model=model, optimizer=optimizer, state={"policy_version": step}, keep=2
        )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    assert (latest_checkpoint(tmp_path) / "adapter" / "adapter_config.json").is_file()  # a PEFT adapter dir

    fresh = _lora_model()
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    torch.rand(5)  # move the RNG on; loading must put it back
    state = load_checkpoint(latest_checkpoint(tmp_path), model=fresh, optimizer=fresh_opt)
    assert state == {"step": 3, "policy_version": 3}
    for name, value in _lora_tensors(fresh).items():
        assert torch.equal(value, saved[name]), name
    assert fresh_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert torch.equal(torch.get_rng_state(), rng)


def test_checkpoint_kind_must_match_the_run(tmp_path):
    model = _lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, state={})
    full, _ = load_policy("tiny", seed=0)
    with pytest.raises(CheckpointError, match="holds a LoRA adapter, but this run trains all weights"):
        load_checkpoint(
            latest_checkpoint(tmp_path), model=full, optimizer=torch.optim.AdamW(full.parameters())
        )


def test_a_half_written_checkpoint_is_ignored(tmp_path):
    (tmp_path / ".tmp-step-000004").mkdir()
    (tmp_path / "step-000005").mkdir()  # no state.json: the kill came before it was complete
    assert latest_checkpoint(tmp_path) is None


def test_existing_run_needs_resume_or_overwrite(job, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    done = subprocess.run(_cmd(job, out), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "already holds a training run; pass --resume" in done.stderr
    done = subprocess.run(_cmd(job, out, "--resume"), capture_output=True, text=True, timeout=120)
    assert (
        done.returncode == 2 and "nothing to resume" in done.stderr and "before its first one" in done.stderr
    )
    done = subprocess.run(
        _cmd(job, out, "--resume", "--overwrite"), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


def test_resume_after_sigkill_continues_the_same_run(job, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    straight = tmp_path / "straight"
    done = subprocess.run(_cmd(job, straight), capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    expected_tasks = {r["step"]: r["tasks"] for r in _rows(straight) if r["kind"] == "train"}
    assert sorted(expected_tasks) == [1, 2, 3, 4, 5]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(job, killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            newest = latest_checkpoint(killed / "checkpoints")
            # kill while step 4's rollouts are in flight (or the final validation's)
            if newest is not None and newest.name >= "step-000003" and (killed / "inflight.json").is_file():
                break
            time.sleep(0.01)
        else:
            pytest.fail("the run reached no fourth step in time")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    rows_at_kill = [r for r in _rows(killed) if r["kind"] == "train"]
    assert 3 <= len(rows_at_kill) < 5

    done = subprocess.run(_cmd(job, killed, "--resume"), capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "resumed from" in done.stdout and "rollouts left over from the interrupted step" in done.stdout
    rows = _rows(killed)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5]  # none repeated, none skipped
    assert {r["step"]: r["tasks"] for r in train_rows} == expected_tasks  # the same data position
    versions = [r["policy_version"] for r in train_rows]
    assert versions == sorted(versions)  # the policy version continues from the checkpoint
    val_rows = [r for r in rows if r["kind"] == "val"]
    assert [r["step"] for r in val_rows][0] == 0 and val_rows[-1][
        "step"
    ] == 5  # before once, after at the end
    assert "held-out reward: before" in done.stdout

    from agl_core.store import SqliteStore

    store = SqliteStore(killed / "store.sqlite")
    try:
        stats = store.stats()
    finally:
        store.close()
    assert (
        stats.get("rollouts_queued", 0) == 0 and stats.get("rollouts_running", 0) == 0
    )  # the killed step's work was cancelled


def test_state_json_masks_tokens_and_url_passwords(tmp_path):
    """A checkpoint's state.json (mode 644 like the rest) once held the gateway and dashboard tokens and
    the store URL's password in clear."""
    import json

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {
        "gateway": {"token": "gw-s3cret-token"},
        "logging": {"dashboard_token": "dash-s3cret"},
        "store": {"url": "postgresql://agl:db-s3cret@db.internal:5432/agl"},
        "model": {"max_tokens": 64},
    }
    path = save_checkpoint(
        tmp_path,
        1,
        model=model,
        optimizer=optimizer,
        state={"config": config, "traces": {"store": config["store"]["url"]}},
    )
    text = (path / "state.json").read_text()
    for secret in ("gw-s3cret-token", "dash-s3cret", "db-s3cret"):
        assert secret not in text
    state = json.loads(text)
    assert state["config"]["gateway"]["token"] == "***"
    assert state["config"]["store"]["url"] == "postgresql://agl:***@db.internal:5432/agl"
    assert state["config"]["model"]["max_tokens"] == 64 and state["step"] == 1


def test_sigterm_ends_a_run_cleanly_saying_what_was_kept(job, tmp_path):
    """SIGTERM once killed ``agl train`` with no message and left run.json saying "running"; it now ends
    the run as Ctrl-C does: exit 143, run.json "interrupted", and the way on (resume, or start again when
    no checkpoint exists yet), wherever it lands: before anything, during the held-out pass, the
    rollouts, the update, a checkpoint write (run.json's phase says when), and after a checkpoint."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def phase(out: Path) -> str | None:
        try:
            return json.loads((out / "run.json").read_text()).get("phase")
        except (OSError, ValueError):
            return None

    for name, ready in (
        ("early", lambda out: (out / "run.json").is_file()),
        ("validating", lambda out: phase(out) == "held-out pass before training"),
        ("rollouts", lambda out: phase(out) == "step 2 of 5: rollouts"),
        ("updating", lambda out: phase(out) == "step 2 of 5: update"),
        ("checkpointing", lambda out: phase(out) == "step 2 of 5: writing a checkpoint"),
        ("late", lambda out: latest_checkpoint(out / "checkpoints") is not None),
    ):
        out = tmp_path / name.replace(" ", "-")
        proc = subprocess.Popen(
            _cmd(job, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            deadline = time.monotonic() + 240
            while not ready(out):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, f"{name}: the run did not get there in time"
                time.sleep(0.001)  # an update or a checkpoint of the tiny model takes tens of ms
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 143, err[-2000:]
        assert "agl train: terminated (SIGTERM); run.json says interrupted" in err
        assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
        # the way on is the interrupted command itself, its --set overrides kept (they once were dropped:
        # "nothing to resume" in the config's own output_dir)
        again = f"agl train {job / 'config.yaml'} --set output_dir={out}"
        if latest_checkpoint(out / "checkpoints") is None:
            assert f"no checkpoint was written yet; start again with: {again} --overwrite" in err, err[-500:]
        else:
            assert f"with: {again} --resume" in err and "continue from step-" in err, err[-500:]


def test_a_signal_surfacing_wrapped_in_another_exception_still_ends_the_run_as_interrupted(
    job, tmp_path, monkeypatch, capsys
):
    """A signal's exception raised inside a library callback can come out wrapped (pydantic: "Error
    calling function `ser_path`: Terminated", a ValueError, seen once in CI): the signal received decides."""
    import agl_trainer.run.loop
    from agl_trainer import cli

    out = tmp_path / "wrapped"

    def train(config, **_):  # type: ignore[no-untyped-def]
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps({"status": "failed", "error": "ValueError: ..."}))
        cli.received.append(signal.SIGTERM)
        raise ValueError("Error calling function `ser_path`: Terminated: ")

    monkeypatch.setattr(agl_trainer.run.loop, "train", train)
    assert cli.run_train(str(job / "config.yaml"), [f"output_dir={out}", "train.steps=3"]) == 143
    err = capsys.readouterr().err
    assert "terminated (SIGTERM); run.json says interrupted" in err and "Error calling" not in err
    command = err.split("start again with: ", 1)[1].split()
    assert command == ["agl", "train", str(job / "config.yaml"), "--set", f"output_dir={out}"] + [
        "--set",
        "train.steps=3",
        "--overwrite",
    ]
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_agl_eval_stopped_by_a_signal_ends_at_once_saying_so(job, tmp_path, stop):
    """``agl eval`` once ran on to the end through Ctrl-C (exit 0), and died of SIGTERM without a word."""
    (job / "agent.py").write_text(AGENT.replace("time.sleep(0.05)", "time.sleep(60)"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "agl_core.cli",
        "eval",
        str(job / "config.yaml"),
        "--tasks",
        "tasks.jsonl",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the runner is up: rollouts are under way
            if line.startswith("runner:"):
                break
        time.sleep(1.0)
        started = time.monotonic()
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + stop and time.monotonic() - started < 20, err[-2000:]
    how = "terminated (SIGTERM)" if stop == signal.SIGTERM else "interrupted"
    assert f"agl eval: {how} before it finished; no score was computed or written" in err
    assert "Traceback" not in err and "terminate called" not in err
