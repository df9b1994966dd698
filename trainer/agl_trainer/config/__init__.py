"""The trainer's YAML configuration: validated once, with errors that name the key and the file."""

from __future__ import annotations

import argparse
import copy
import difflib
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from agl_core.policies import BASE, PolicyRouter

from .algorithm import (
    CPU_MICRO_BATCH_TOKENS,
    GPU_MICRO_BATCH_TOKENS,
    VERL_RESERVED_KEYS,
    VERL_SECTIONS,
    AlgorithmConfig,
    RewardsConfig,
    UpdateConfig,
    check_verl_section,
)
from .base import ConfigError, _Strict
from .data import TasksConfig, TracesConfig, TracesFilterConfig
from .improve import GateConfig, GatewayTargetConfig, ImproveConfig, RollbackConfig
from .model import LoraConfig, ModelConfig, PolicyConfig
from .run import CheckpointConfig, LoggingConfig, TrainConfig, ValidationConfig
from .services import (
    GatewayConfig,
    HFServingConfig,
    RunnerConfig,
    ServingConfig,
    StoreConfig,
    VLLMLaunchConfig,
    VLLMServingConfig,
)

__all__ = [
    "CPU_MICRO_BATCH_TOKENS",
    "GPU_MICRO_BATCH_TOKENS",
    "REQUIRED_KEYS",
    "VERL_RESERVED_KEYS",
    "VERL_SECTIONS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "GateConfig",
    "GatewayConfig",
    "GatewayTargetConfig",
    "HFServingConfig",
    "ImproveConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "PolicyConfig",
    "RewardsConfig",
    "RollbackConfig",
    "RunnerConfig",
    "ServingConfig",
    "StoreConfig",
    "TasksConfig",
    "TracesConfig",
    "TracesFilterConfig",
    "TrainConfig",
    "TrainerConfig",
    "UpdateConfig",
    "VLLMLaunchConfig",
    "VLLMServingConfig",
    "ValidationConfig",
    "check_verl_section",
    "config_from_dict",
    "load_config",
]


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
    #: ``agl improve``: keep training rounds from the rollouts ``traces`` selects as they arrive, gate
    #: each candidate on the held-out tasks, publish the promoted ones to gateways (docs/improve.md).
    improve: ImproveConfig | None = None
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
    def _improve_fits(self) -> TrainerConfig:
        if self.improve is None:
            return self
        if self.traces is None:
            raise ValueError(
                "improve: trains on stored rollouts as they arrive; add a traces: section (traces.store and"
                " traces.filter: the rollouts to learn from)"
            )
        if self.traces.filter.rollout_ids:
            raise ValueError(
                "traces.filter.rollout_ids: with improve: each round chooses its rollouts itself; remove it"
            )
        if self.traces.filter.until is not None:
            raise ValueError(
                "traces.filter.until: with improve: the service learns from rollouts as they arrive, and an"
                " end date would stop it learning; remove it"
            )
        if self.policies:
            raise ValueError("improve: serves and trains one policy; remove policies:")
        if self.improve.gate != "none" and (self.agent is None or self.tasks is None or not self._has_val()):
            raise ValueError(
                "improve.gate scores each candidate on held-out tasks: set agent: and tasks.val (or"
                " tasks.val_fraction), or say gate: none to promote every candidate unchecked"
            )
        return self

    def _has_val(self) -> bool:
        return self.tasks is not None and (self.tasks.val is not None or self.tasks.val_fraction is not None)

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
            torch_only = [
                key
                for key, default in (("loss_norm", "rollout"), ("kl_reference", "base"))
                if getattr(self.algorithm, key) != default
            ]
            if torch_only:
                raise ValueError(
                    f"algorithm.{torch_only[0]} applies only to update.backend torch; verl's actor has its"
                    " own (verl.actor_rollout_ref.actor.loss_agg_mode, and a KL toward the base model)"
                )
        elif self.verl:
            raise ValueError("the verl: section applies only with update.backend: verl")
        if self.algorithm.kl_reference == "init_adapter" and self.model.init_adapter is None:
            raise ValueError(
                "algorithm.kl_reference: init_adapter pulls toward model.init_adapter, which is not set; set"
                " model.init_adapter (the warm start), or give kl_reference an adapter's path, or 'base'"
            )
        if self.algorithm.kl_reference != "base" and (self.model.lora is None or self.policies):
            raise ValueError(
                "algorithm.kl_reference other than 'base' needs model.lora and a run without policies:"
                " the reference is an adapter of model.lora's shape"
            )
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


#: The largest chat template file read (a template is a few KB).
_MAX_TEMPLATE_BYTES = 1_000_000


def _chat_template(value: str, base_dir: Path, source: str) -> str:
    """``model.chat_template``'s file, absolute, once it is a readable Jinja template that renders a short
    conversation with a tool; :class:`ConfigError` saying what is wrong otherwise."""
    file = Path(value) if Path(value).is_absolute() else base_dir / value
    where = f"{source}: 'model.chat_template'"
    if not file.is_file():
        raise ConfigError(f"{where}: {file} is not a file (give a Jinja chat template, e.g. template.jinja)")
    if file.stat().st_size > _MAX_TEMPLATE_BYTES:
        raise ConfigError(f"{where}: {file} is over {_MAX_TEMPLATE_BYTES:,} bytes; is it a chat template?")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {file} as UTF-8 text: {exc}") from None
    if not text.strip():
        raise ConfigError(f"{where}: {file} is empty")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    probe = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        "add_generation_prompt": True,
        "bos_token": "",
        "eos_token": "",
    }
    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _template_error
        rendered = env.from_string(text).render(**probe)
    except (TemplateError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(
            f"{where}: {file} does not render a conversation (system, user, assistant turns and a tool):"
            f" {type(exc).__name__}: {exc}"
        ) from None
    if "What is 2 + 2?" not in rendered:
        raise ConfigError(f"{where}: {file} renders the messages' content nowhere; is it a chat template?")
    return str(file)


def _template_error(message: str) -> None:
    raise ValueError(message)


def _kl_reference(config: TrainerConfig, init_adapter: str | None, base_dir: Path, source: str) -> str | None:
    """``algorithm.kl_reference`` as the path of the adapter weights it names, checked to fit
    ``model.lora`` (and ``model.init_adapter``'s tensors) before any model loads; ``None`` for ``base``."""
    from ..saved import CheckpointError, check_adapter_fits

    name = config.algorithm.kl_reference
    lora = config.model.lora
    if name == "base" or lora is None:
        return None
    init_weights = None
    if init_adapter is not None:
        try:
            init_weights = check_adapter_fits(
                init_adapter,
                key="model.init_adapter",
                lora=lora,
            )
        except CheckpointError as exc:
            if name == "init_adapter":
                raise ConfigError(f"{source}: 'algorithm.kl_reference' (init_adapter): {exc}") from None
    if name == "init_adapter":
        assert init_weights is not None  # the schema requires model.init_adapter
        return str(init_weights.parent)
    directory = Path(name) if Path(name).is_absolute() else base_dir / name
    if not directory.is_dir():
        raise ConfigError(
            f"{source}: 'algorithm.kl_reference': {directory} is not a directory; give 'base',"
            " 'init_adapter', or an adapter: a checkpoint, an adapter directory or a run's output_dir"
        )
    try:
        weights = check_adapter_fits(
            directory,
            key="algorithm.kl_reference",
            lora=lora,
            like=init_weights,
        )
    except CheckpointError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return str(weights.parent)


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
    task_filter = config.tasks.filter if config.tasks is not None else None
    if task_filter is not None:
        scores = task_filter.scores if task_filter.scores.is_absolute() else base_dir / task_filter.scores
        if not scores.is_file():
            raise ConfigError(
                f"{source}: 'tasks.filter.scores': file {scores} does not exist (write it with agl eval"
                " CONFIG --tasks TRAIN_FILE --split train --samples K --output FILE)"
            )
        resolved["filter"] = task_filter.model_copy(update={"scores": scores})
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
    if config.model.chat_template is not None:
        template = _chat_template(config.model.chat_template, base_dir, source)
        update["model"] = update.get("model", config.model).model_copy(update={"chat_template": template})
    reference = _kl_reference(config, update.get("model", config.model).init_adapter, base_dir, source)
    if reference is not None:
        update["algorithm"] = config.algorithm.model_copy(update={"kl_reference": reference})
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
