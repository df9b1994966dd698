"""Supervised fine-tuning on LLM calls: re-tokenising recorded messages with the policy's chat template,
and the next-token loss update.

The loss of a minibatch is the mean negative log-likelihood over all its response tokens (prompt tokens
carry no loss), accumulated micro-batch by micro-batch within ``micro_batch_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from agl_core.gateway.render import TemplateRenderer
from agl_core.gateway.tools import prepare_messages
from agl_core.pipeline.sft import SftExample
from agl_core.records import Transition

from .algo import Advantaged
from .update import UpdateStats, _micro_batches, apply_gradients, response_logprobs

__all__ = ["OUT_OF_VOCABULARY", "TEMPLATE_FAILED", "example_transition", "sft_update_step"]

#: An example whose token ids the policy cannot read (recorded with another model's tokenizer).
OUT_OF_VOCABULARY = "LLM call's token ids are outside the policy's vocabulary (another model's tokenizer)"
#: An example whose recorded messages the policy's chat template cannot render.
TEMPLATE_FAILED = "the policy's chat template cannot render the LLM call's recorded messages"


def _ids(value: Any) -> list[int]:
    if isinstance(value, Mapping) or hasattr(value, "input_ids"):
        value = value["input_ids"]
    return [int(i) for i in value]


def _retokenise(tokenizer: Any, example: SftExample) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prompt and response ids of a call from its recorded messages: the prompt as the gateway renders
    it, the response as the rest of the conversation rendered with the response appended (so it ends
    with the template's end-of-turn tokens)."""
    assert example.response is not None
    renderer = TemplateRenderer(tokenizer)
    prompt = renderer.render(example.messages, example.tools)
    prepared, native_tools = prepare_messages(
        [*example.messages, example.response], example.tools, renderer.template
    )
    full = _ids(
        tokenizer.apply_chat_template(
            prepared, tools=native_tools, add_generation_prompt=False, tokenize=True
        )
    )
    if full[: len(prompt)] == prompt and len(full) > len(prompt):
        return tuple(prompt), tuple(full[len(prompt) :])
    # the template renders history differently from a new turn: the response text, then end of sequence
    text = prepared[-1].get("content") or ""
    response = _ids(tokenizer.encode(text, add_special_tokens=False))
    eos = getattr(tokenizer, "eos_token_id", None)
    return tuple(prompt), tuple(response + ([int(eos)] if eos is not None else []))


def example_transition(tokenizer: Any, vocab_size: int, example: SftExample) -> Transition | str:
    """The example as a transition to train on, or the reason it cannot be: the gateway's exact ids, or
    its messages rendered with ``tokenizer``'s chat template (``policy_version`` ``None``,
    ``response_logprobs`` ``None``)."""
    if example.transition is not None:
        transition = example.transition
    else:
        try:
            prompt, response = _retokenise(tokenizer, example)
        except ValueError:
            return TEMPLATE_FAILED
        transition = Transition(
            rollout_id=example.rollout_id,
            attempt_id=None,
            task_id=example.task_id,
            call_index=example.call_index,
            prompt_ids=prompt,
            response_ids=response,
            response_logprobs=None,
            reward=example.reward or 0.0,
            agent_name=example.agent_name,
            span_id=example.span_id,
        )
    if not transition.prompt_ids or not transition.response_ids:
        return "LLM call has no prompt or no response tokens"
    if max(max(transition.prompt_ids), max(transition.response_ids)) >= vocab_size:
        return OUT_OF_VOCABULARY
    return transition


def sft_update_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    transitions: Sequence[Transition],
    *,
    pad_id: int,
    max_grad_norm: float = 1.0,
    micro_batch_tokens: int = 4096,
    bf16: bool = False,
) -> UpdateStats:
    """One optimizer step of the next-token loss on the response tokens of ``transitions`` (see the module
    docstring). A non-finite gradient norm skips the step."""
    if not transitions:
        raise ValueError("sft_update_step needs at least one transition")
    samples = [Advantaged(t, 0.0) for t in transitions]
    total_tokens = sum(len(t.response_ids) for t in transitions)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for micro in _micro_batches(samples, micro_batch_tokens):
        logprobs = response_logprobs(model, micro, pad_id, bf16=bf16)
        loss = -torch.cat(logprobs).sum() / total_tokens
        torch.autograd.backward(loss)
        loss_sum += float(loss.detach())
    grad_norm = apply_gradients(optimizer, max_grad_norm)
    return UpdateStats(
        loss=loss_sum,
        transitions=len(transitions),
        rollouts=len({t.rollout_id for t in transitions}),
        tokens=total_tokens,
        clip_fraction=0.0,
        approx_kl=0.0,
        grad_norm=grad_norm,
    )
