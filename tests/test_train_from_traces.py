"""Training from stored traces (``traces:``): rollouts made through the real gateway (exact token ids and
logprobs, rewarded) and an OpenInference trace file imported with ``agl import`` (messages only), in one
real SQLite store; SFT, off-policy PPO-clip, the filter and the config errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from agl_core import semconv
from agl_core.importer import import_traces
from agl_core.pipeline.sft import spans_to_sft_examples
from agl_core.pipeline.transitions import NO_LLM_CALL
from agl_core.records import Span
from agl_core.testing import AglTestStack, ScriptedBackend
from agl_core.tracing import emit_reward, rollout_scope
from agl_trainer.api import Trainer
from agl_trainer.config import ConfigError, config_from_dict
from agl_trainer.run.traces import (
    OTHER_MODEL,
    NothingSelectedError,
    prepare_rl,
    prepare_sft,
    read_store,
    select,
)

from .test_import import _record, json_line

#: Gateway rollouts: (rollout id, task id, episode reward); two tasks of two rollouts each.
RUNS = [("ro-0", "t-a", 1.0), ("ro-1", "t-a", 0.0), ("ro-2", "t-b", 0.9), ("ro-3", "t-b", 0.2)]
IMPORTED_SESSION = "chat-7"


def _openinference_chat(provider: Any) -> None:
    """An API model's call as OpenInference records it: messages, no token ids."""
    tracer = provider.get_tracer("openinference.instrumentation.openai")
    common = {semconv.SESSION_ID: IMPORTED_SESSION}
    with tracer.start_as_current_span(
        "agent", attributes={**common, semconv.OPENINFERENCE_SPAN_KIND: semconv.OPENINFERENCE_KIND_AGENT}
    ):
        with tracer.start_as_current_span(
            "ChatCompletion",
            attributes={
                **common,
                semconv.OPENINFERENCE_SPAN_KIND: semconv.OPENINFERENCE_KIND_LLM,
                semconv.LLM_MODEL_NAME: "gpt-test",
                "llm.input_messages.0.message.role": "system",
                "llm.input_messages.0.message.content": "You add numbers.",
                "llm.input_messages.1.message.role": "user",
                "llm.input_messages.1.message.content": "2 + 3?",
                "llm.output_messages.0.message.role": "assistant",
                "llm.output_messages.0.message.content": "5",
            },
        ):
            pass
        with tracer.start_as_current_span(
            "ChatCompletion",  # a call recorded without its messages (content capture off)
            attributes={**common, semconv.OPENINFERENCE_SPAN_KIND: semconv.OPENINFERENCE_KIND_LLM},
        ):
            pass


@pytest.fixture(scope="module")
def trace_store(tmp_path_factory: pytest.TempPathFactory, tiny_policy) -> tuple[Path, str]:
    """A SQLite store with the gateway rollouts of :data:`RUNS` and one imported OpenInference session
    (rewarded late); returns its path and the imported rollout's id."""
    _, tokenizer = tiny_policy
    root = tmp_path_factory.mktemp("traces")
    path = root / "store.sqlite"
    backend = ScriptedBackend(["The answer is 4.", "I think 5.", "It is 7.", "No idea."], tokenizer=tokenizer)
    with AglTestStack(backend, path=path) as stack:
        for rollout_id, task_id, reward in RUNS:
            with rollout_scope(rollout_id, f"{rollout_id}-a1", task_id, tracer_provider=stack.provider):
                client = openai.OpenAI(base_url=stack.base_url(rollout_id), api_key="x")
                client.chat.completions.create(
                    model="scripted", messages=[{"role": "user", "content": f"Question of {task_id}?"}]
                )
                emit_reward(reward, tracer_provider=stack.provider)
        stack.spans()
        file = root / "oi.jsonl"
        file.write_bytes(json_line(_record(_openinference_chat)))
        summary = import_traces([file], stack.collector.url)
        assert summary.problems == [] and summary.rollouts == 1
        (imported,) = [
            r
            for r in {s.rollout_id for s in stack.client.query_spans(limit=100_000)}
            if r and r.startswith("imp-")
        ]
        stack.client.add_reward(0.95, rollout_id=imported, reward_id="grader-1", source="grader")
    return path, imported


def _config(tmp_path: Path, store: Path, **extra: Any) -> dict[str, Any]:
    traces = {"store": str(store), "batch_size": 8, **extra.pop("traces", {})}
    return {
        "output_dir": str(tmp_path / "run"),
        "model": {"source": "tiny", "lora": {"r": 4}},
        "traces": traces,
        "algorithm": {"name": "sft", "learning_rate": 1e-2, **extra.pop("algorithm", {})},
        "train": {"steps": 2, **extra.pop("train", {})},
        "logging": {"progress": "plain", "plot": False, "tensorboard": False},
        **extra,
    }


def _selection(store: Path, **filters: Any) -> Any:
    config = config_from_dict(_config(Path("/tmp"), store, traces={"filter": filters}), required=())
    assert config.traces is not None
    spans, records = read_store(config.traces.store)
    return config, select(config.traces, spans, records)


# --- the pure parts ---------------------------------------------------------------------------------------
def test_sft_examples_use_exact_ids_where_recorded_and_messages_elsewhere(trace_store):
    path, imported = trace_store
    config, selection = _selection(path)
    assert {r.rollout_id for r in selection.rollouts} == {r for r, _, _ in RUNS} | {imported}
    result = prepare_sft(config, selection)
    exact = [e for e in result.examples if e.exact]
    rebuilt = [e for e in result.examples if not e.exact]
    assert sorted(e.rollout_id for e in exact) == sorted(r for r, _, _ in RUNS)
    assert all(e.transition and e.transition.response_logprobs for e in exact)
    (oi,) = rebuilt
    assert oi.rollout_id == imported and oi.reward == 0.95
    assert [m["role"] for m in oi.messages] == ["system", "user"] and oi.response == {
        "role": "assistant",
        "content": "5",
    }
    assert result.reasons() == {"LLM call recorded no input messages (message content was not captured)": 1}


def test_genai_messages_and_tools_are_read_from_a_span():
    span = Span(
        "a" * 32,
        "b" * 16,
        None,
        "chat",
        1,
        2,
        {
            semconv.ROLLOUT_ID: "ro-g",
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_INPUT_MESSAGES: '[{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]',
            semconv.GEN_AI_OUTPUT_MESSAGES: '[{"role": "assistant", "parts": [{"type": "tool_call",'
            ' "id": "c1", "name": "add", "arguments": {"a": 1}}]}]',
            semconv.GEN_AI_TOOL_DEFINITIONS: '[{"type": "function", "function": {"name": "add"}}]',
        },
    )
    (example,) = spans_to_sft_examples([span]).examples
    assert not example.exact and example.messages == ({"role": "user", "content": "hi"},)
    assert example.response == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}, "id": "c1"}
        ],
    }
    assert example.tools == ({"type": "function", "function": {"name": "add"}},)


def test_the_reward_filter_keeps_only_well_rewarded_rollouts(trace_store):
    path, imported = trace_store
    _, selection = _selection(path, reward_min=0.8)
    assert {r.rollout_id for r in selection.rollouts} == {"ro-0", "ro-2", imported}
    assert (
        selection.describe() == "the filter matched 3 of 5 rollouts: finished left 5, reward_min 0.8 left 3"
    )
    _, imported_only = _selection(path, source="import")
    assert [r.rollout_id for r in imported_only.rollouts] == [imported]


def test_off_policy_rl_refuses_the_trace_without_token_ids_and_keeps_recorded_logprobs(
    trace_store, tiny_policy
):
    import torch

    from agl_trainer.learning.update import batch_loss, response_logprobs

    path, imported = trace_store
    # the gateway served these calls as "scripted": not this policy ("agl-policy", "tiny") unless named
    other = config_from_dict(
        _config(Path("/tmp"), path, algorithm={"name": "grpo"}, traces={"batch_size": 2}), required=()
    )
    assert other.traces is not None
    spans, records = read_store(other.traces.store)
    refused = prepare_rl(other, select(other.traces, spans, records))
    assert not refused.samples
    assert dict(refused.refused) == {
        **{r: f"{OTHER_MODEL}: 'scripted'" for r, _, _ in RUNS},
        imported: NO_LLM_CALL,
    }
    config = config_from_dict(
        _config(
            Path("/tmp"), path, algorithm={"name": "grpo"}, traces={"batch_size": 2, "models": ["scripted"]}
        ),
        required=(),
    )
    assert config.traces is not None
    data = prepare_rl(config, select(config.traces, spans, records))
    assert dict(data.refused) == {imported: NO_LLM_CALL}
    assert {s.transition.rollout_id for s in data.samples} == {r for r, _, _ in RUNS}
    assert dict(data.group_of) == {**{r: t for r, t, _ in RUNS}, imported: imported}
    assert all(
        s.transition.response_logprobs == (-0.5,) * len(s.transition.response_ids) for s in data.samples
    )

    model, tokenizer = tiny_policy
    pad = tokenizer.pad_token_id or 0
    samples = list(data.samples)
    with torch.no_grad():
        current = response_logprobs(model, samples, pad)
        on_policy = [
            dataclasses.replace(s, transition=dataclasses.replace(s.transition, response_logprobs=None))
            for s in samples
        ]
        ratio_one = [
            dataclasses.replace(
                s, transition=dataclasses.replace(s.transition, response_logprobs=tuple(lp.tolist()))
            )
            for s, lp in zip(samples, current, strict=True)
        ]
        plain, _ = batch_loss(model, on_policy, clip_eps=0.2, pad_id=pad)
        same, info = batch_loss(model, ratio_one, clip_eps=0.2, pad_id=pad)
        recorded, recorded_info = batch_loss(model, samples, clip_eps=0.2, pad_id=pad)
    assert same == pytest.approx(plain, abs=1e-6) and info["clip_fraction"] == 0.0
    # the random model's logprobs are far from the recorded -0.5: the ratio is clipped
    assert recorded_info["clip_fraction"] > 0.0 and recorded != pytest.approx(plain)


# --- whole runs -------------------------------------------------------------------------------------------
def _lora_b_norm(checkpoint: Path) -> float:
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    return sum(float(v.abs().sum()) for k, v in weights.items() if "lora_B" in k)


def test_sft_run_trains_lora_from_exact_and_retokenised_calls(trace_store, tmp_path):
    path, _ = trace_store
    lines: list[str] = []
    result = Trainer(_config(tmp_path, path), echo=lines.append).fit()
    assert result.steps == 2 and result.checkpoint is not None
    assert _lora_b_norm(result.checkpoint) > 0.0  # LoRA's B starts at zero: the weights moved
    rows = result.history
    assert sum(m.exact_transitions or 0 for m in rows) == 2 * 4 and all(m.loss for m in rows)
    assert sum(m.retokenised_transitions or 0 for m in rows) == 2
    assert rows[0].problems == {"LLM call recorded no input messages (message content was not captured)": 1}
    assert any("4 exact token ids, 1 re-tokenised" in line for line in lines)
    assert any(line.startswith("step 2/2") and "re-tokenised=" in line for line in lines)
    assert (result.metrics).read_text().count('"kind": "train"') == 2
    # the same run skeleton as an online job: run.json, which the dashboard lists, says what ran and how
    run = json.loads((result.output_dir / "run.json").read_text())
    assert run["title"] == f"traces from {Path(path).name}" and run["status"] == "finished"
    assert run["steps"] == 2 and run["phase"] is None


def test_off_policy_grpo_run_trains_on_the_gateway_rollouts(trace_store, tmp_path):
    path, imported = trace_store
    config = _config(
        tmp_path,
        path,
        algorithm={"name": "grpo"},
        traces={"batch_size": 2, "epochs": 1, "models": ["scripted"]},  # the test gateway's model name
    )
    config["train"] = {}
    result = Trainer(config, echo=lambda _: None).fit()
    assert result.steps == 1 and result.checkpoint is not None
    (row,) = result.history
    assert row.trained_transitions == 4 and row.untrained == {NO_LLM_CALL: 1}
    assert row.exact_transitions == 4 and row.retokenised_transitions == 0


def test_a_filter_matching_nothing_stops_before_loading_with_what_matched(trace_store, tmp_path):
    path, _ = trace_store
    with pytest.raises(
        NothingSelectedError, match=r"the filter matched 0 of 5 rollouts: .*reward_min 5 left 0"
    ):
        Trainer(_config(tmp_path, path, traces={"filter": {"reward_min": 5}})).fit()
    file = tmp_path / "config.yaml"
    file.write_text(yaml.safe_dump(_config(tmp_path, path, traces={"filter": {"source": "production"}})))
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "train", str(file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "the filter matched 0 of 5 rollouts: finished left 5, source 'production' left 0" in done.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"train": {"tasks_per_step": 2}}, "train.tasks_per_step applies to rollouts the trainer runs"),
        ({"traces": {"filter": {"reward_mn": 1}}}, "unknown key 'traces.filter.reward_mn'"),
        ({"traces": {"batch_size": 0}}, "'traces.batch_size'"),
        ({"traces": {"epochs": 2}}, "set either traces.epochs or train.steps"),
        ({"traces": {"filter": {"since": "yesterday"}}}, "'traces.filter.since'"),
        ({"traces": {"store": "missing.sqlite"}}, "'traces.store': store file"),
    ],
)
def test_config_errors_name_the_key(tmp_path, change, message):
    data = _config(tmp_path, tmp_path / "store.sqlite")
    (tmp_path / "store.sqlite").write_bytes(b"")
    for section, values in change.items():
        data[section] = {**data[section], **values}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config_from_dict(data, base_dir=tmp_path)


def test_sft_needs_traces_and_traces_need_no_agent_or_tasks(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.name sft fine-tunes on stored rollouts"):
        config_from_dict({"algorithm": {"name": "sft"}}, required=())
    (tmp_path / "s.sqlite").write_bytes(b"")
    config = config_from_dict({"traces": {"store": "s.sqlite"}}, base_dir=tmp_path)  # agent, tasks required
    assert config.traces is not None and config.traces.store == str(tmp_path / "s.sqlite")
