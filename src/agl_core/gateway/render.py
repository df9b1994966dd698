"""Rendering prompts to token ids with a model's own chat template.

:class:`TemplateRenderer` wraps a Hugging Face tokenizer (duck-typed: ``apply_chat_template``, ``encode``,
``chat_template``); nothing here imports transformers except :func:`load_renderer`. The HF backend renders
its prompts with it, and the gateway uses a second one to check what a backend reports it fed the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .tools import ToolFormat, prepare_messages, tool_format_of

__all__ = ["TemplateRenderer", "load_renderer"]


class TemplateRenderer:
    """Prompt token ids exactly as the serving side builds them from OpenAI-style messages."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.template: str | None = template if isinstance(template, str) else None
        self.tool_format: ToolFormat = tool_format_of(self.template)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the chat template applied to ``messages`` (and ``tools``), ending with the start
        of the assistant's turn. Raises ``ValueError`` when the template cannot render them."""
        prepared, native_tools = prepare_messages(messages, tools, self.template)
        try:
            ids = self.tokenizer.apply_chat_template(
                prepared, tools=native_tools, add_generation_prompt=True, tokenize=True
            )
        except Exception as exc:  # jinja errors, missing template, unsupported roles
            raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a plain-text completion prompt (ids are passed through)."""
        if not isinstance(prompt, str):
            return [int(i) for i in prompt]
        return [int(i) for i in self.tokenizer.encode(prompt)]


def load_renderer(path: str) -> TemplateRenderer:
    """A renderer for the tokenizer in a local model directory (needs ``transformers``)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            f"checking prompts against {path} needs transformers ({exc}); "
            "install agl[trainer] or pass no tokenizer"
        ) from None
    return TemplateRenderer(AutoTokenizer.from_pretrained(path))
