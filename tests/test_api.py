"""Training from Python with :class:`agl_trainer.Trainer`, on the real pipeline (store, gateway serving the
tiny model, runner, update): agent functions defined inside the tests (which no process can import by
name) trained in thread and async mode, the result pointing at what the run left; process mode refusing
such a function before anything starts; and bad input refused with a message that says what to pass."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from agl_trainer import FitResult, Trainer, TrainerConfig
from agl_trainer.config import ConfigError
from agl_trainer.run.data import DatasetError

from ._training import Turns, metrics_rows

ROOT = Path(__file__).resolve().parent.parent

#: One step of two tasks x two rollouts on the tiny model; validation is the tasks the test gives.
CONFIG: dict[str, Any] = {
    "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
    "gateway": {"default_max_tokens": 4},
    "train": {"steps": 1, "tasks_per_step": 2, "rollouts_per_task": 2},
    "logging": {"plot": False, "tensorboard": False},
}
TASKS = [{"id": f"t{i}", "q": f"say {i}"} for i in range(6)]


def _job(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    return {**CONFIG, "output_dir": str(tmp_path / "run"), **sections}


def test_fit_trains_a_function_defined_in_the_test_in_thread_mode(tmp_path):
    turns = Turns()

    def solve(task, llm):  # a local function: not importable by module and name
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
        )
        return turns.reward(task)

    lines: list[str] = []
    trainer = Trainer(_job(tmp_path, runner={"workers": 2, "mode": "thread"}), echo=lines.append)
    result = trainer.fit(solve, TASKS[:4], val=TASKS[4:])

    assert isinstance(result, FitResult)
    out = (tmp_path / "run").absolute()
    assert result.output_dir == out and result.steps == 1
    assert result.metrics == out / "metrics.jsonl" and result.store == out / "store.sqlite"
    assert result.store.is_file() and result.plot is None
    assert result.checkpoint == out / "checkpoints" / "step-000001"
    assert (result.checkpoint / "adapter" / "adapter_config.json").is_file()
    assert [r["kind"] for r in metrics_rows(out)] == ["val", "train", "val"]
    (step,) = result.history
    assert step.trained_transitions == 4 and step.policy_version == 1 and step.warning is None
    assert set(step.tasks) <= {"t0", "t1", "t2", "t3"}  # the validation tasks are held out
    # where the step's time went: the backend generated 4 calls of up to 4 tokens inside the rollouts
    (row,) = metrics_rows(out, "train")
    phases = row["phases"]
    parts = ("generation", "prefill", "decode")  # generation's parts, inside the rollouts
    assert set(phases) == {"rollouts", "transitions", "update", "publish", *parts}, phases
    assert 0 < phases["generation"] <= phases["rollouts"] + 0.05
    assert 0 < phases["prefill"] and 0 < phases["decode"]
    assert phases["prefill"] + phases["decode"] <= phases["generation"] + 0.01
    assert phases["update"] > 0 and phases["publish"] >= 0
    assert sum(v for k, v in phases.items() if k not in parts) <= row["seconds"] + 0.05
    assert row["generation_tokens_per_s"] > 0 and row["peak_rss_mb"] > 100
    # the four prompts share their chat template's start, but not one whole 16-token block of it
    assert 0 <= row["prefix_reuse"] <= 1
    timing = [line for line in lines if line.startswith("  time: rollouts ")]
    assert timing and "generating" in timing[0] and ": prefill " in timing[0] and ", decode " in timing[0], (
        lines
    )
    assert result.before is not None and result.after is not None
    assert (result.before.mean, result.before.n, result.after.mean, result.after.n) == (1.0, 2, 0.0, 2)
    assert (result.change, result.change_se) == (-1.0, 0.0)
    held_out = [line for line in lines if line.startswith("held-out reward:")]
    assert held_out == [result.summary().splitlines()[0]]
    assert "runner: 2 worker(s) in thread mode" in lines
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.steps = 2  # type: ignore[misc]


def test_fit_trains_an_async_function_in_async_mode(tmp_path):
    turns = Turns()

    async def solve(task, llm):
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            await client.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
            )
        await asyncio.sleep(0)
        return turns.reward(task)

    held_out = tmp_path / "val.jsonl"  # the held-out tasks as a file, the training tasks as a list
    held_out.write_text(json.dumps(TASKS[5]) + "\n")
    lines: list[str] = []
    trainer = Trainer(_job(tmp_path, runner={"mode": "async"}), echo=lines.append)
    result = trainer.fit(solve, TASKS[:2], val=held_out)

    assert "runner: 2 worker(s) in async mode" in lines
    assert result.steps == 1 and result.history[0].trained_transitions == 4
    assert sorted(result.history[0].tasks) == ["t0", "t1"]
    assert result.checkpoint is not None and (result.checkpoint / "adapter").is_dir()
    assert result.before is not None and result.after is not None
    assert (result.before.task_scores, result.after.task_scores) == ({"t5": 1.0}, {"t5": 0.0})
    assert result.summary().splitlines()[1:3] == ["steps: 1", f"checkpoint: {result.checkpoint}"]


def test_process_mode_refuses_a_function_no_process_can_import_before_anything_starts(tmp_path):
    def solve(task, llm):
        return 1.0

    trainer = Trainer(_job(tmp_path, runner={"mode": "process"}))
    for run in (lambda: trainer.fit(solve, TASKS), lambda: trainer.dev(solve, TASKS)):
        with pytest.raises(ValueError) as refused:
            run()
        message = str(refused.value)
        assert "mode 'process' imports the agent by name in each worker process" in message
        assert "test_process_mode_refuses_a_function_no_process_can_import_before_anything_starts" in message
        assert "define it at the top level of an importable module, or run it in mode 'thread'" in message
    assert not (tmp_path / "run").exists()  # no store, no checkpoint folder: nothing started


#: A script training a function of ``__main__`` in process mode; ``{top}`` or ``{guarded}`` defines it.
MAIN_SCRIPT = """
from agl_trainer import Trainer
{top}

def main():
    config = {{"output_dir": {run!r}, "model": {{"source": "tiny"}}, "runner": {{"mode": "process"}}}}
    trainer = Trainer(config)
    try:
        trainer.fit(solve, [{{"id": "a"}}])
    except ValueError as exc:
        print(exc)


if __name__ == "__main__":
{guarded}    main()
"""
SOLVE = "def solve(task, llm):\n    return 1.0\n"


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("stdin", "'solve' is defined in an interactive session (a notebook, python -c or stdin)"),
        ("guarded file", "'solve' is bound only under 'if __name__ == \"__main__\":' in"),
    ],
)
def test_process_mode_refuses_a_function_of_main_that_worker_processes_lack(tmp_path, how, why):
    run = str(tmp_path / "run")
    if how == "stdin":  # as in a notebook: __main__ is no file a worker process could run
        script = MAIN_SCRIPT.format(top=SOLVE, guarded="", run=run)
        argv, stdin = [sys.executable, "-"], script
    else:  # defined under the entry-point guard, which a spawned worker process does not run
        guarded = "".join(f"    {line}\n" for line in SOLVE.splitlines())
        (tmp_path / "job.py").write_text(MAIN_SCRIPT.format(top="", guarded=guarded, run=run))
        argv, stdin = [sys.executable, "job.py"], None
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (
        "mode 'process' imports the agent by name in each worker process, but __main__:solve" in done.stdout
    )
    assert why in done.stdout
    assert not (tmp_path / "run").exists()


def test_the_config_comes_as_a_dict_a_file_or_a_trainer_config_with_overrides(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"id": "a"}\n')
    (tmp_path / "config.yaml").write_text("tasks: tasks.jsonl\ntrain: {steps: 3}\n")
    from_file = Trainer(tmp_path / "config.yaml", overrides=["train.tasks_per_step=2"]).config
    assert from_file.train.steps == 3 and from_file.train.tasks_per_step == 2 and from_file.agent is None
    assert from_file.tasks is not None and from_file.tasks.train == tmp_path / "tasks.jsonl"
    from_dict = Trainer({"train": {"steps": 3}}, overrides=["runner.mode=async"]).config
    assert from_dict.train.steps == 3 and from_dict.runner.mode == "async" and from_dict.tasks is None
    again = Trainer(from_file, overrides=["train.steps=5"]).config
    assert isinstance(again, TrainerConfig) and again.train.steps == 5 and again.tasks == from_file.tasks
    assert Trainer(from_file).config is from_file


def test_a_bad_config_is_refused_with_the_messages_of_agl_train(tmp_path):
    with pytest.raises(
        ConfigError, match=r"config: unknown key 'train\.stpes' \(did you mean 'train\.steps'\?\)"
    ):
        Trainer({"train": {"stpes": 2}})
    with pytest.raises(
        ConfigError, match=r"config: unknown key 'select_agents' \(did you mean 'algorithm\.agents'"
    ):
        Trainer({"select_agents": ["writer"]})
    (tmp_path / "config.yaml").write_text("train: {steps: 0}\nlogging: {colour: true}\n")
    with pytest.raises(ConfigError) as refused:
        Trainer(tmp_path / "config.yaml")
    message = str(refused.value)
    assert f"{tmp_path / 'config.yaml'}: 'train.steps': Input should be greater than or equal to 1" in message
    assert f"{tmp_path / 'config.yaml'}: unknown key 'logging.colour'" in message
    with pytest.raises(ConfigError, match=r"'tasks': file .*missing\.jsonl does not exist"):
        Trainer({"tasks": "missing.jsonl"})
    with pytest.raises(ConfigError, match=r"config: unknown key 'base_dir'"):
        Trainer({"base_dir": "."})
    with pytest.raises(
        TypeError, match="config must be a dict, the path of a YAML config file or a TrainerConfig"
    ):
        Trainer(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="overrides must be a list of 'key.sub=value' strings"):
        Trainer({}, overrides="train.steps=2")


def _solve(task, llm):
    return 1.0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda t: t.fit("agent:solve", TASKS),
            TypeError,
            "agent must be a function agent(task, llm) -> reward",
        ),
        (lambda t: t.fit("agent:solve", TASKS), TypeError, "set the config's agent key"),
        (lambda t: t.fit(lambda task: 1.0, TASKS), TypeError, "must take two arguments, (task, llm)"),
        (lambda t: t.fit(_solve, 5), TypeError, "train must be a list of task dicts or the path of a .jsonl"),
        (lambda t: t.fit(_solve, {"id": "a"}), TypeError, "(one task? put it in a list)"),
        (lambda t: t.fit(_solve, TASKS, val=iter(TASKS)), TypeError, "val must be a list of task dicts"),
        (lambda t: t.dev(_solve, 3.5), TypeError, "tasks must be a list of task dicts"),
        (lambda t: t.fit(_solve, []), DatasetError, "train: no tasks (the list is empty)"),
        (lambda t: t.fit(_solve, ["a"]), DatasetError, "train[0]: each task must be a JSON object, got str"),
        (lambda t: t.fit(_solve, [{"id": 1}, {"id": 1}]), DatasetError, "train[1]: duplicate task id '1'"),
        (
            lambda t: t.fit(_solve, [{"x": {1}}]),
            DatasetError,
            "train[0]: the task cannot be sent to the agent as JSON",
        ),
        (
            lambda t: t.fit(_solve, TASKS, val=TASKS[:1]),
            DatasetError,
            "1 task id(s) are in both train and val",
        ),
        (lambda t: t.fit(_solve, "nowhere.jsonl"), DatasetError, "task file nowhere.jsonl does not exist"),
        (lambda t: t.fit(_solve), ValueError, "no tasks: set 'tasks' in the config (a task file), or pass"),
        (lambda t: t.fit(None, TASKS), ValueError, "no agent: set 'agent: module:function' in the config"),
        (lambda t: t.dev(_solve, TASKS, n=0), ValueError, "n is the number of rollouts to run"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(tmp_path, call, error, message):
    trainer = Trainer(_job(tmp_path))
    with pytest.raises(error) as refused:
        call(trainer)
    assert message in str(refused.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("sections", "agent", "message"),
    [
        ({"runner": {"mode": "async"}}, _solve, "mode 'async' runs 'async def' agents"),
        (
            {"runner": {"workers": 0}},
            _solve,
            "runner.workers: 0 leaves the rollouts to runners started elsewhere",
        ),
    ],
)
def test_a_runner_setting_that_cannot_run_the_function_is_refused(tmp_path, sections, agent, message):
    with pytest.raises(ValueError, match=message):
        Trainer(_job(tmp_path, **sections)).fit(agent, TASKS)
    assert not (tmp_path / "run").exists()
